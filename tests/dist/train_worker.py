"""Run under torchrun: several ``llmforge train`` runs in sequence in each process, in-process.

Usage: ``train_worker.py OUT RUNS.json`` where RUNS.json maps a name to the ``llmforge``
argument list of one run (``["train", CONFIG, key=value, ...]``). Every rank runs every entry,
in order, through :func:`llmforge.cli.main` (what ``python -m llmforge`` runs) and writes
``OUT/rank<R>.json``: ``{name: {"code": exit code, "stdout": ..., "stderr": ...}}``. It runs
from OUT with OUT first on ``sys.path``, as ``python -m llmforge`` started in OUT would (a
config may name a module written there, e.g. a callback).

One launch pays the interpreter and import start (~8 s of CPU per process) once for all the
runs, instead of once per ``--nproc`` run. The process group that the first run's Lightning
strategy starts stays up for the next ones (Lightning destroys it only at exit). An entry whose
exit code is not 0 is an expected failure only if its name starts with ``fail_``: such entries
must fail before training starts (a config error on every rank), or the ranks would fall out of
step; any other failure stops this process, and torchrun then stops the rest.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from llmforge.cli import main

def run_all(out: Path, runs: dict) -> int:
    rank = os.environ.get("RANK", "0")
    os.chdir(out)
    sys.path.insert(0, str(out))
    report = {}
    for name, argv in runs.items():
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        report[name] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        if code != 0 and not name.startswith("fail_"):
            print(f"rank {rank}: {name} exited with {code}\n{stderr.getvalue()[-4000:]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    sys.exit(run_all(out_dir, json.loads(Path(sys.argv[2]).read_text())))
