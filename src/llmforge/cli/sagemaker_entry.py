"""SageMaker entry point: ``llmforge train CONFIG OVERRIDES`` inside a SageMaker training job.

SageMaker (``torch_distributed``) runs this file as a script under torchrun on every instance
with the hyperparameters ``--config``, ``--overrides`` and ``--channel_keys`` (JSON: channel
name -> config key). Each mounted channel (``SM_CHANNEL_<NAME>``, e.g.
``/opt/ml/input/data/train``) becomes ``KEY=<dir>/**/*.*`` unless the overrides set that key
already. The run directory goes to ``/opt/ml/checkpoints`` (synced to S3) and the run resumes
from its newest checkpoint there. ``--print-command`` prints the command instead of running it.

Run as a script, Python puts this file's folder first on ``sys.path``, where llmforge's own
modules would shadow installed ones; that entry is dropped before anything else is imported.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if __name__ == "__main__":  # the folder of llmforge.runs must not shadow top-level modules
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    _SRC = os.path.dirname(os.path.dirname(_HERE))  # src/ of an uploaded source_dir
    try:
        import llmforge  # noqa: F401  (installed in the image)
    except ImportError:
        sys.path.insert(0, _SRC)

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
from typing import Mapping, Optional, Sequence  # noqa: E402


def channel_overrides(channel_keys: Mapping[str, str], overrides: Sequence[str],
                      env: Optional[Mapping[str, str]] = None) -> list[str]:
    """``KEY=<dir>/**/*.*`` for each channel SageMaker mounted whose key the overrides leave unset."""
    env = os.environ if env is None else env
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    out = []
    for name, key in sorted(channel_keys.items()):
        folder = env.get(f"SM_CHANNEL_{name.upper()}")
        if folder and key not in given:
            out.append(f"{key}={folder.rstrip('/')}/**/*.*")
    return out


def train_argv(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The ``llmforge`` arguments for SageMaker's hyperparameters ``argv``."""
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--overrides", default="")
    p.add_argument("--channel_keys", default="{}")
    p.add_argument("--print-command", action="store_true")
    args, _ = p.parse_known_args(argv)
    overrides = shlex.split(args.overrides)
    extra = channel_overrides(json.loads(args.channel_keys or "{}"), overrides, env)
    return ["train", args.config, *overrides, *extra, "run.output_dir=/opt/ml/checkpoints",
            "checkpoint.resume=auto"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = train_argv(argv)
    if "--print-command" in argv:
        print(shlex.join(["llmforge", *command]))
        return 0
    from llmforge.cli import main as cli  # after the sys.path set-up above (run as a script)

    return cli(command, own_process=True)  # the job's process: a stop in startup exits at once


if __name__ == "__main__":
    sys.exit(main())
