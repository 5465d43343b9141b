"""Prepared-corpus helpers shared by tests/test_prepared*.py, and (run as a script) one rank that
opens a prepared URL, for the tests that race real processes for the node-local cache.

    python tests/helpers/prepared.py URL CACHE_DIR BARRIER_DIR SEQ_LEN

prints ``{"downloads": shards this process copied, "windows": sha256 of every train window}``.
The URL may use ``slowfile://``, a local filesystem whose opens sleep 100 ms, so the copy lasts
long enough for the other process to find the lock taken.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

TOK = ["tokenizer.vocab_size=1024", "tokenizer.train_max_bytes=2000000"]


def write_corpus(folder: Path, files: int = 3, docs: int = 60) -> str:
    """``files`` jsonl files of ``docs`` short documents each; returns their glob."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        rows = [{"text": f"file {f} document {d}: " + " ".join(f"w{(d * 7 + i) % 97}" for i in range(40))}
                for d in range(docs)]
        (folder / f"part{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "*.jsonl")


def prepare(source: str, out, *extra: str) -> int:
    """``llmforge data prepare`` in this process, one worker, shards of 25 documents."""
    from llmforge.cli import main

    return main(["data", "prepare", source, str(out), *TOK, "--workers", "1", "--docs-per-shard", "25",
                 *extra])


def windows_digest(prepared, seq_len: int) -> str:
    """sha256 of every training window of an opened prepared corpus, in order."""
    import hashlib

    from llmforge.data.prepared import PreparedWindows

    w = PreparedWindows(prepared, "train", seq_len)
    h = hashlib.sha256()
    for i in range(len(w)):
        h.update(w[i].numpy().tobytes())
    return h.hexdigest()


def _register_slowfile() -> None:
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class SlowFile(LocalFileSystem):
        protocol = ("slowfile",)  # LocalFileSystem strips its own protocol(s) from paths

        def _open(self, path, mode="rb", **kwargs):
            time.sleep(0.1)
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("slowfile", SlowFile, clobber=True)


def _rank(url: str, cache_dir: str, barrier: str, seq_len: int) -> None:
    import llmforge.data.remote as remote
    from llmforge.data.prepared import open_prepared

    _register_slowfile()
    real, count = remote._download, [0]

    def counting(fs, src, target, where, size=None, sha256=None):
        count[0] += sha256 is not None  # shards only (the tokenizer files carry no hash)
        return real(fs, src, target, where, size, sha256)

    # the copier starts its first shard only once the other process found the lock taken: on a
    # loaded machine the other could otherwise arrive after the copy and never wait
    import filelock

    waiting, real_acquire = Path(f"{barrier}-waiting"), filelock.FileLock.acquire

    def acquire(self, timeout=None, *a, **kw):
        try:
            return real_acquire(self, timeout, *a, **kw)
        except filelock.Timeout:
            waiting.touch()
            raise

    def counting_after_the_other_waits(fs, src, target, where, size=None, sha256=None):
        deadline = time.monotonic() + 60
        while sha256 is not None and count[0] == 0 and not waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return counting(fs, src, target, where, size, sha256)

    filelock.FileLock.acquire = acquire
    remote._download = counting_after_the_other_waits
    Path(barrier, str(time.time_ns())).touch()  # start together: wait for the other process
    while len(list(Path(barrier).iterdir())) < 2:
        time.sleep(0.01)
    prepared = open_prepared(url, cache_dir=cache_dir)
    print(json.dumps({"downloads": count[0], "root": str(prepared.root),
                      "windows": windows_digest(prepared, seq_len)}))


if __name__ == "__main__":
    _rank(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
