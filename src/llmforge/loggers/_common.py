"""Helpers shared by the tracker adapters: lazy SDK import, API keys, run identity, fallbacks.

Every adapter is built as ``builder(run_dir=Path, run=cfg.run, config=<redacted dict>, **kwargs)``
(see :meth:`llmforge.training.trainer.Trainer.build_loggers`). Building checks the settings and
imports the SDK but contacts no server; the tracker's run starts on first use (rank zero only).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from typing import Any, Optional

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
