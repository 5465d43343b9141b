"""The mark that says llmforge made a folder, and what ``--overwrite`` may clear.

Every run directory llmforge creates holds :data:`MARK` (``.llmforge-run``, a small JSON file).
``llmforge train`` writes into, and ``--overwrite`` deletes, only a folder that is empty,
missing, or an llmforge run (:func:`is_run_dir`). Before ``--overwrite`` clears anything, the
paths the command will read are checked against what it clears (:func:`refuse_overlap`); a
``checkpoint.dir`` inside another run is refused (:func:`refuse_run_inside_run`); ``convert
to-hf --overwrite`` replaces only a folder it exported itself (:data:`EXPORT_MARK`).
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

import yaml

from llmforge.errors import ConfigError
from llmforge.paths import is_special_file

__all__ = ["EXPORT_MARK", "LOCK", "MARK", "check_export_dir", "check_run_dir", "clear_run_dir", "is_run_dir",
           "mark_run_dir", "refuse_file_link", "refuse_link", "refuse_nested_runs", "refuse_overlap",
           "refuse_run_inside_run"]

MARK = ".llmforge-run"
LOCK = ".llmforge-lock"
"""The run directory's lock file (:mod:`llmforge.run_guard.lock`): kept by ``--overwrite``."""
EXPORT_MARK = ".llmforge-export"
"""The mark of a Hugging Face folder ``llmforge convert to-hf`` wrote: the one kind of
non-empty folder its ``--overwrite`` replaces."""

def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a folder llmforge made: it holds :data:`MARK`, or it has the layout
    of a run written before the mark existed: ``metrics.jsonl`` beside the ``config.yaml``
    llmforge saved for a run of this folder's name, or a complete checkpoint ``checkpoints/step_<digits>/COMPLETE`` (the names of
    :mod:`llmforge.checkpoint.layout`)."""
    if (path / MARK).is_file():
        return True
    if (path / "metrics.jsonl").is_file() and _premark_config(path):
        return True
    return any((path / "checkpoints").glob("step_[0-9]*/COMPLETE"))


def _premark_config(path: Path) -> bool:
    """``path/config.yaml`` is the resolved config llmforge saved in it: a mapping with ``model``
    and ``trainer`` sections and ``run.name`` equal to the folder's name (any folder may hold a
    ``config.yaml`` beside a ``metrics.jsonl``; only llmforge's names its own folder)."""
    config = path / "config.yaml"
    try:
        if not config.is_file() or config.stat().st_size > 1 << 20:
            return False
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError):
        return False
    run = data.get("run") if isinstance(data, dict) else None
    return (isinstance(run, dict) and run.get("name") == path.name
            and isinstance(data.get("model"), dict) and isinstance(data.get("trainer"), dict))


def check_run_dir(path: Path, key: str) -> None:
    """Refuse a run directory llmforge must not write into (nor ``--overwrite`` delete).

    Args:
        path: the run directory (``run.output_dir/run.name``) or checkpoint folder.
        key: the config key that chose it, named in the message.

    Raises:
        ConfigError: ``path`` is a symbolic link, or a folder with more than llmforge's lock in
            it that is not an llmforge run (:func:`is_run_dir`).
    """
    refuse_link(path, key)
    # only llmforge's lock in it: rank 0 of this run is claiming it (it opens the lock, then
    # writes the mark under it), which another rank's check may see half way
    if path.is_dir() and any(e.name != LOCK for e in path.iterdir()) and not is_run_dir(path):
        raise ConfigError(f"{key}: {path} is not empty and is not an llmforge run (no {MARK} file); "
                          "llmforge neither trains into nor deletes (--overwrite) a folder it did not "
                          f"make: choose another {key}, or move the files away")


def refuse_link(path: Path, key: str) -> None:
    """Raises ConfigError when ``path`` (the folder itself, not its parents) is a symbolic link."""
    if path.is_symlink():
        raise ConfigError(f"{key}: {path} is a symbolic link (to {os.path.realpath(path)}); llmforge "
                          "does not write a run through a link (the new run would mix with the old "
                          "one's files, and --overwrite would not replace them): give the folder it "
                          "points to instead")


def refuse_file_link(path: Path) -> None:
    """Raises ConfigError when ``path`` (the mark or the lock) exists but is not a regular file:
    writing through a symbolic link would truncate or create the file it points to (a run
    directory someone shared may hold ``.llmforge-lock -> ~/.bashrc``); opening a named pipe
    blocks for ever; a folder cannot be opened."""
    if path.is_symlink():
        raise ConfigError(f"{path} is a symbolic link (to {os.path.realpath(path)}); llmforge writes "
                          "its run files only into the run directory itself: delete the link")
    if is_special_file(path):
        raise ConfigError(f"{path} is not a regular file; llmforge keeps its own small file there: "
                          "delete it")


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def refuse_overlap(cleared: Iterable[tuple[str, Path]], inputs: Iterable[tuple[str, str]],
                   flag: str = "--overwrite") -> None:
    """Refuse to clear a folder that holds a path the same command will read.

    ``--overwrite`` deletes before the new run reads its inputs: fine-tuning a run in place
    (``model.init_from`` = the run being replaced), a round trip ``convert from-hf RUN/hf RUN``,
    would delete the very files it needs. Paths are compared after links and ``~`` are resolved;
    a glob is expanded (and its folder before the first wildcard checked too, so a pattern that
    spans the cleared folder is refused); the files directly in an input folder are followed
    through their links (a Hugging Face cache snapshot links its files elsewhere); local URLs
    (``file://``, ``local://``, ``simplecache::file://``) are local paths.

    Args:
        cleared: ``(key, folder)`` pairs ``flag`` will delete (e.g. ``("run.name", runs/ip)``).
        inputs: ``(key, path)`` pairs the command reads (``model.init_from``, ``tokenizer.path``,
            ``data.path``, ...); remote URLs and empty values are skipped.

    Raises:
        ConfigError: naming both keys and both paths (exit 2); nothing is deleted.
    """
    cleared = [(key, _real(folder)) for key, folder in cleared]
    for in_key, value in inputs:
        for path in _local_paths(value):
            for out_key, folder in cleared:
                if path == folder or folder in path.parents:
                    raise ConfigError(
                        f"{in_key}={value} lies inside {folder} ({out_key}), which {flag} would "
                        f"delete before {in_key} is read; copy it elsewhere first, or choose "
                        f"another {out_key}")


_LOCAL_SCHEMES = ("file://", "local://")


def _local_paths(value: Any) -> list[Path]:
    """The real local paths a config value names: itself (``hf:PATH`` -> PATH), a glob's folder
    and matches, an input folder's own files; none for a remote URL or an empty value."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        return []
    text = str(value).removeprefix("hf:").split("::")[-1]  # fsspec chains: the last is the store
    for scheme in _LOCAL_SCHEMES:
        text = text.removeprefix(scheme)
    if "://" in text:
        return []
    wild = next((i for i, ch in enumerate(text) if ch in "*?["), None)
    if wild is not None:
        found = [_real(os.path.dirname(text[:wild]) or ".")]
        found += [_real(m) for m in glob.glob(os.path.expanduser(text), recursive=True)[:10_000]]
        return found
    path = _real(text)
    found = [path]
    if path.is_dir():
        with contextlib.suppress(OSError):
            found += [_real(entry) for entry in list(Path(os.path.expanduser(text)).iterdir())[:10_000]]
    return found


def refuse_run_inside_run(path: Path, run_dir: Path, key: str) -> None:
    """Refuse a folder (``checkpoint.dir``) that is, or lies inside, an llmforge run other than
    ``run_dir``: this run's ``--overwrite`` and ``keep_last_n`` would delete that run's checkpoints.

    Raises:
        ConfigError: naming ``key`` and the other run's folder (exit 2).
    """
    own = _real(run_dir)
    for folder in [_real(path), *_real(path).parents]:
        if folder == own or own in folder.parents:
            return  # inside this run (or below it): its own
        if folder.is_dir() and is_run_dir(folder):
            raise ConfigError(f"{key}={path} lies inside another llmforge run, {folder}; its "
                              f"checkpoints are that run's to keep: choose a {key} outside it (or "
                              f"leave {key} unset for {run_dir}/checkpoints)")


def refuse_nested_runs(run_dir: Path, key: str, clearing: bool) -> None:
    """Refuse a run directory inside another llmforge run (that run's ``--overwrite`` would
    delete it), and, when ``clearing`` it, one that holds other runs two levels down.

    Raises:
        ConfigError: naming ``key`` and the other run's folder (exit 2).
    """
    for folder in _real(run_dir).parents:
        if folder.is_dir() and is_run_dir(folder):
            raise ConfigError(f"{key}: {run_dir} lies inside another llmforge run, {folder}, whose "
                              "--overwrite would delete it: choose a run.output_dir outside it")
    if clearing and run_dir.is_dir():
        inner = [m.parent for pattern in (f"*/{MARK}", f"*/*/{MARK}") for m in run_dir.glob(pattern)]
        if inner:
            raise ConfigError(f"{key}: {run_dir} holds another llmforge run, {inner[0]}, which "
                              "--overwrite would delete with it: move that run out first")


def check_export_dir(path: Path, key: str, overwrite: bool) -> bool:
    """May ``llmforge convert to-hf`` write its folder at ``path``? Returns whether an earlier
    export there is replaced (``overwrite`` and :data:`EXPORT_MARK` present).

    Raises:
        ConfigError: ``path`` is a symbolic link or a file; it is a non-empty folder without
            ``overwrite``; or a non-empty folder llmforge did not export (no :data:`EXPORT_MARK`),
            which ``overwrite`` does not touch either.
    """
    refuse_link(path, key)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: {path} is a file, not a folder; choose another {key}")
    if not path.is_dir() or not any(path.iterdir()):
        return False
    if not overwrite:
        raise ConfigError(f"{key}: {path} already exists and is not empty; choose another output "
                          "folder or pass --overwrite to replace an earlier export there")
    if not (path / EXPORT_MARK).is_file():
        raise ConfigError(f"{key}: {path} is not empty and is not a folder llmforge exported (no "
                          f"{EXPORT_MARK} file); --overwrite replaces only llmforge's own exports: "
                          "choose an empty or new folder")
    return True


def clear_run_dir(path: Path) -> None:
    """Delete what a run directory holds (``--overwrite``; :func:`check_run_dir` has passed),
    except :data:`MARK` and :data:`LOCK` (the lock stays held by this process). Links inside are
    removed, never followed.

    Raises:
        ConfigError: ``path`` is a symbolic link.
    """
    refuse_link(path, "run.name")
    if not path.is_dir():
        return
    for entry in path.iterdir():
        if entry.name in (MARK, LOCK):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def mark_run_dir(path: Path) -> bool:
    """Create ``path`` (and parents) if needed and write :data:`MARK` if missing; returns
    whether the mark was written now."""
    path.mkdir(parents=True, exist_ok=True)
    mark = path / MARK
    refuse_file_link(mark)
    if mark.exists():
        return False
    mark.write_text(json.dumps({"made_by": "llmforge", "created": _now()}) + "\n", encoding="utf-8")
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
