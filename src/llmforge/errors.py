"""Errors that reach the user as one clear message and a non-zero exit code.

The CLI catches :class:`LLMForgeError` and prints ``error: <message>`` without a
traceback (``--debug`` shows it). Each subclass carries the exit code it maps to.
"""

from __future__ import annotations


class LLMForgeError(Exception):
    """Base class for errors with a user-facing message. Exit code 1."""

    exit_code: int = 1


class ConfigError(LLMForgeError):
    """A YAML file, an override or a combination of settings is invalid. Exit code 2.

    The message names the key path, file or value and says how to fix it.
    """

    exit_code = 2


class DataError(LLMForgeError):
    """The data source cannot be read or is too small for the configured batch. Exit code 2."""

    exit_code = 2


class TrainingDiverged(LLMForgeError):
    """Training produced a non-finite loss or gradient norm (raised by the ``nan_guard``
    callback before the bad update is applied). Exit code 3.

    The message names the step and the values; the last complete checkpoint is left intact.
    """

    exit_code = 3
    hint = ("Lower optimizer.lr, lengthen scheduler.warmup_steps or set trainer.gradient_clip_val, "
            "then resume from it (checkpoint.resume=auto checkpoint.allow_config_changes=true); "
            "to skip such steps instead, add algorithms: [{name: loss_spike_guard}] (it skips "
            "a non-finite step once it has min_history steps); to train on regardless, set "
            "trainer.nan_guard=false")
    """How to continue: printed after the message by every raiser."""
