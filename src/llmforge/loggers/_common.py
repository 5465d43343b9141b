"""Helpers shared by the tracker adapters: lazy SDK import, API keys, run identity, fallbacks.

Every adapter is built as ``builder(run_dir=Path, run=<redacted run:>, config=<redacted dict>, **kwargs)``
(see :meth:`llmforge.training.trainer.Trainer.build_loggers`). Building checks the settings and
imports the SDK but contacts no server; the tracker's run starts on first use (rank zero only).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import warnings
from typing import Any, Callable, Iterator, Optional

from llmforge.config.redaction import redact_argv
from llmforge.errors import ConfigError

MODES = ("online", "offline")


class TrackerOfflineWarning(UserWarning):
    """A tracker's server could not be reached; the adapter switched to offline mode."""


def import_sdk(module: str, extra: str, logger: str) -> Any:
    """Import a tracker SDK that is an optional extra of llmforge.

    Raises:
        ConfigError: the package is not installed; the message says ``pip install 'llmforge[EXTRA]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"loggers: {logger} needs the '{module}' package, which is not installed ({exc}); "
            f"run: pip install 'llmforge[{extra}]'"
        ) from exc


def check_mode(mode: str, logger: str) -> str:
    """``mode`` must be ``online`` or ``offline``.

    Raises:
        ConfigError: any other value.
    """
    if mode not in MODES:
        raise ConfigError(f"loggers: {logger}: mode must be 'online' or 'offline'; got {mode!r}")
    return mode


def require_api_key(env_var: str, logger: str, mode: str, given: Any = None) -> Optional[str]:
    """The API key of an online tracker, from the environment only.

    Args:
        env_var: e.g. ``WANDB_API_KEY``.
        logger: the logger's name (for the message).
        mode: ``online`` needs the key; ``offline`` does not.
        given: an ``api_key`` written in the YAML (refused: keys never live in config files).

    Raises:
        ConfigError: an ``api_key`` in the YAML, or ``mode: online`` without ``env_var`` set.
    """
    if given is not None:
        raise ConfigError(
            f"loggers: {logger}: api_key is not read from YAML (config files are saved and "
            f"shared); remove it and export {env_var} in the environment instead"
        )
    key = os.environ.get(env_var) or None
    if mode == "online" and key is None:
        raise ConfigError(
            f"loggers: {logger} is online but {env_var} is not set; export {env_var}=... "
            f"before training, or set mode: offline in its loggers: entry"
        )
    return key


def run_identity(run: Any, name: Optional[str], group: Optional[str],
                 tags: Optional[list]) -> tuple[Optional[str], Optional[str], list[str]]:
    """``(name, group, tags)``: the logger entry's own values, else those of ``run:``."""

    def get(key: str) -> Any:
        return getattr(run, key, None) if run is not None else None

    name = name if name is not None else get("name")
    group = group if group is not None else get("group")
    tags = list(tags) if tags is not None else list(get("tags") or [])
    return name, group, [str(t) for t in tags]


def unreachable(url: str, timeout: float) -> Optional[str]:
    """``None`` when ``url`` answers an HTTP GET within ``timeout`` seconds (any status, even an
    error, means the server is there), else why not (DNS failure, refused, timed out).

    Checked before starting an online tracker run: the SDKs retry for tens of seconds, and some
    also wait at interpreter exit for background exports to a server that never answers.
    """
    import socket
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, socket.timeout, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{url}: {type(reason).__name__}: {reason}"[:300]


def warn_offline(logger: str, reason: str, where: str) -> None:
    """Say once, as a :class:`TrackerOfflineWarning`, that a tracker fell back to offline
    (server unreachable, timed out, or the key was refused)."""
    warnings.warn(f"{logger}: could not start an online run ({reason}); logging offline to "
                  f"{where} instead, the run continues", TrackerOfflineWarning, stacklevel=2)


def say(message: str) -> None:
    """One informational line on stderr (the console a run's progress goes to)."""
    print(message, file=sys.stderr, flush=True)


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (bools, strings and other objects left out); NaN/inf kept."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@contextlib.contextmanager
def redacted_argv() -> Iterator[None]:
    """``sys.argv`` with secrets redacted (:func:`llmforge.config.redaction.redact_argv`) while
    a tracker SDK starts its run: W&B and Comet record the command line as the run's ``args``
    (``llmforge train ... variables.api_key=S`` would reach them). Restored afterwards."""
    saved = list(sys.argv)
    sys.argv[:] = redact_argv(saved)
    try:
        yield
    finally:
        sys.argv[:] = saved


class MetricNames:
    """llmforge's metric names -> names one tracker accepts, the same mapping for the whole run.

    ``fix(name)`` returns an accepted spelling (e.g. characters the tracker refuses replaced by
    ``_``). Two names that ``fix`` maps alike get a short hash of the original appended, so no
    record overwrites another. Each renamed metric is reported once, in one warning line per
    record that brings new ones (``data/code+math/tokens_seen`` from a mixture entry named
    ``code+math`` is ``data/code_math/tokens_seen`` in MLflow).
    """

    def __init__(self, logger: str, fix: Callable[[str], str]) -> None:
        self.logger, self.fix = logger, fix
        self.mapping: dict[str, str] = {}
        self._taken: dict[str, str] = {}  # accepted name -> the original it stands for

    def name(self, name: str) -> str:
        """The accepted name of ``name`` (computed once, then reused)."""
        if name not in self.mapping:
            fixed = self.fix(name)
            if self._taken.get(fixed, name) != name:
                fixed = self.fix(f"{fixed}_{hashlib.sha1(name.encode()).hexdigest()[:6]}")
            self._taken[fixed] = name
            self.mapping[name] = fixed
        return self.mapping[name]

    def __call__(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with accepted names; warns about names renamed for the first time."""
        new = [k for k in values if k not in self.mapping]
        out = {self.name(k): v for k, v in values.items()}
        renamed = [f"{k} -> {self.mapping[k]}" for k in new if self.mapping[k] != k]
        if renamed:
            warnings.warn(f"{self.logger}: logs under other names what it does not accept (or what "
                          f"would then collide): {', '.join(renamed)}", UserWarning, stacklevel=2)
        return out
