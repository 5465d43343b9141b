"""SageMaker entry point: ``llmforge train CONFIG OVERRIDES`` inside a SageMaker training job.

SageMaker (``torch_distributed``) runs this script under torchrun on every instance with the
hyperparameters ``--config`` and ``--overrides``; the run directory goes to
``/opt/ml/checkpoints`` (synced to S3) and the run resumes from its newest checkpoint there.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--overrides", default="")
    args, _ = p.parse_known_args(argv)
    from llmforge.cli import main as cli

    return cli(["train", args.config, *shlex.split(args.overrides),
                "run.output_dir=/opt/ml/checkpoints", "checkpoint.resume=auto"])


if __name__ == "__main__":
    sys.exit(main())
