"""``llmforge data prepare`` interrupted at ten moments, then run again (issues 26.3, 50.7).

    python benchmarks/prepare_interrupt.py                  # a 4 MB jsonl corpus, 2 tokenizing workers
    python benchmarks/prepare_interrupt.py --smoke          # 0.3 MB, 3 moments
    python benchmarks/prepare_interrupt.py --signals TERM   # SIGTERM to the group at every moment

Runs the command twice uninterrupted (T: the shorter wall time), then, for ten moments spread
from 0.5 s to 0.9 T, starts it in a fresh folder, sends SIGKILL, SIGTERM or SIGINT (in turn; or
only those of ``--signals``) to its whole process group at that moment, runs the same command
again to completion and compares the sha256 of every shard with the uninterrupted run. Then as
many moments again, counted from when ``OUT/tokenizer/tokenizer.json`` appears (0 to 0.5 s after:
the workers are starting; SIGTERM to the group there hung the command for good before issue
50.7). Prints one row per moment: the signal, the moment, the interrupted run's exit code and
its last stderr line, and whether the shards match. A moment fails when the exit code is not the
signal's (-9, 75 for SIGTERM, 130 for SIGINT; 0 when it had finished), the run is still alive
60 s after the signal (HUNG), or the rerun's shards differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_corpus(folder: Path, mb: float) -> str:
    rng = random.Random(0)
    words = "the of and to in a is that for it as was with be by on not he this are or".split()
    folder.mkdir(parents=True)
    for f in range(2):
        with open(folder / f"part{f}.jsonl", "w") as fh:
            written = 0
            while written < mb * 1e6 / 2:
                line = json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 300)))}) + "\n"
                fh.write(line)
                written += len(line)
    return str(folder / "*.jsonl")


def command(source: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "llmforge", "data", "prepare", source, str(out), "--workers", "2",
            "--docs-per-shard", "200", "--no-progress", "tokenizer.vocab_size=1024",
            "tokenizer.train_max_bytes=1000000"]


def digests(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.glob("*/shard_*.bin"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--moments", type=int, default=10)
    ap.add_argument("--signals", default="KILL,TERM,INT", help="signals sent in turn, e.g. TERM")
    args = ap.parse_args()
    mb, moments = (0.3, 3) if args.smoke else (args.mb, args.moments)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = write_corpus(work / "corpus", mb)
        times = []
        for run in ("ref", "ref2"):  # the shorter of two: a loaded machine stretches one
            start = time.perf_counter()
            ref = subprocess.run(command(source, work / run), env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - start)
            if ref.returncode != 0:
                print(ref.stderr[-2000:])
                return 1
        total = min(times)
        want = digests(work / "ref")
        assert digests(work / "ref2") == want, "two uninterrupted runs differ"
        print(f"uninterrupted: {times[0]:.1f}s and {times[1]:.1f}s, {len(want)} shards ({mb} MB of jsonl)")
        sigs = [getattr(signal, f"SIG{name.strip().upper()}") for name in args.signals.split(",")]
        expect = {signal.SIGKILL: -signal.SIGKILL, signal.SIGTERM: 75, signal.SIGUSR1: 75, signal.SIGINT: 130}
        bad = 0
        plan = [(None, 0.5 + (total * 0.9 - 0.5) * i / max(1, moments - 1)) for i in range(moments)]
        plan += [("tokenizer", 0.5 * i / max(1, moments - 1)) for i in range(moments)]
        for i, (after, at) in enumerate(plan):
            sig, out = sigs[i % len(sigs)], work / f"k{i}"
            proc = subprocess.Popen(command(source, out), env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            if after == "tokenizer":  # the tokenizer is saved just before the workers start
                while proc.poll() is None and not (out / "tokenizer" / "tokenizer.json").exists():
                    time.sleep(0.002)
            time.sleep(at)
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                _, err = proc.communicate(timeout=60)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                _, err = proc.communicate()
                code = None
            again = subprocess.run(command(source, out), env=env, capture_output=True, text=True)
            same = again.returncode == 0 and digests(out) == want
            ok = same and code in (expect[sig], 0)
            bad += not ok
            last = (err.strip().splitlines() or [""])[-1][:90]
            when = f"{at:4.2f}s after the tokenizer file" if after else f"{at:5.1f}s"
            print(f"{sig.name:8s} at {when}: {'HUNG (killed after 60 s)' if code is None else f'exit {code:4d}'}"
                  f"{' (had finished)' if code == 0 else ''} {last!r}; rerun exit "
                  f"{again.returncode}, shards {'identical' if same else 'DIFFER'}{'' if ok else '  <- FAIL'}")
            if again.returncode != 0:
                print("  " + again.stderr.strip().splitlines()[-1])
        print(f"{len(plan) - bad}/{len(plan)} moments: the signal's exit code, and the rerun's shards identical (sha256)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
