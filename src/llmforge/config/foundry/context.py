"""The bookkeeping of one conversion: the Foundry keys read, the llmforge keys written, the
report (mapped, mapped with a difference, not mapped), and Composer's time strings.

Composer's time strings (``composer.core.time.Time.from_timestring``): a number and a unit,
``ba`` (batches = optimizer steps), ``ep`` (epochs), ``tok`` (tokens), ``sp`` (samples = sequences),
``dur`` (a share of ``max_duration``); a bare integer is epochs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from llmforge.errors import ConfigError

_TIME = re.compile(r"^([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)(ba|ep|tok|sp|dur)$", re.IGNORECASE)
_MISSING = object()


def parse_time(value: Any, key: str) -> tuple[float, str]:
    """``(number, unit)`` of a Composer time value (``"100ba"``, ``"0.1dur"``, ``2`` = 2 epochs).

    Raises:
        ConfigError: not a time string (names ``key`` and the units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value), "ep"
    m = _TIME.match(value.replace("_", "").strip()) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{key}: {value!r} is not a Composer time string; write a number and a unit: "
                          "100ba (batches), 1ep (epochs), 1000tok (tokens), 500sp (samples) or 0.1dur "
                          "(a share of max_duration)")
    return float(m.group(1)), m.group(2).lower()


@dataclass
class Clock:
    """What turns Composer time into optimizer steps: sequences and tokens per step, the run's
    length in steps (for ``dur``) and an epoch's length in steps (``--steps-per-epoch``)."""

    global_batch: int
    seq_len: int
    max_steps: Optional[int] = None
    steps_per_epoch: Optional[int] = None

    def steps(self, value: Any, key: str) -> tuple[int, str]:
        """Optimizer steps of a time value and how they were computed ("" when exact).

        Raises:
            ConfigError: unparseable, or epochs without ``--steps-per-epoch``."""
        number, unit = parse_time(value, key)
        if unit == "ba":
            return int(number), "" if number == int(number) else f"{number} batches rounded down"
        if unit == "sp":
            exact = number / self.global_batch
            return math.ceil(exact), ("" if exact == int(exact) else
                                      f"{number:g} samples / {self.global_batch} per step, rounded up")
        if unit == "tok":
            per_step = self.global_batch * self.seq_len
            exact = number / per_step
            how = f"{number:g} tokens / ({self.global_batch} x {self.seq_len} tokens per step)"
            return math.ceil(exact), how + ("" if exact == int(exact) else ", rounded up")
        if unit == "ep":
            if self.steps_per_epoch is None:
                raise ConfigError(f"{key}: {value!r} is in epochs, whose length depends on the data; "
                                  "pass --steps-per-epoch N (optimizer steps in one pass over the "
                                  "training data) or write the duration in ba or tok")
            return math.ceil(number * self.steps_per_epoch), f"{number:g} x {self.steps_per_epoch} steps per epoch"
        if self.max_steps is None:  # dur in max_duration itself
            raise ConfigError(f"max_duration: {value!r} is a share of itself; write it in ba, tok or ep")
        # Composer: int(value * max_duration) (composer.optim.scheduler._convert_time)
        return int(number * self.max_steps), f"{number:g} x max_duration ({self.max_steps} steps)"


@dataclass
class Conversion:
    """One conversion: ``src`` (the resolved Foundry YAML), ``out`` (the llmforge YAML being
    built) and the report. Every Foundry key is either read by :meth:`take` (and then mapped,
    changed or dropped with a reason) or listed by :meth:`leftovers` as not known."""

    src: dict
    out: dict = field(default_factory=dict)
    mapped: list = field(default_factory=list)
    changed: list = field(default_factory=list)
    unmapped: list = field(default_factory=list)
    todo: list = field(default_factory=list)
    used: set = field(default_factory=set)

    def has(self, key: str) -> bool:
        return self._lookup(key) is not _MISSING

    def _lookup(self, key: str) -> Any:
        node: Any = self.src
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def peek(self, key: str, default: Any = None) -> Any:
        """The value at the dotted ``key`` (``default`` when absent), not marked as read (a
        section whose keys are read one by one)."""
        value = self._lookup(key)
        return default if value is _MISSING else value

    def take(self, key: str, default: Any = None) -> Any:
        """The value at the dotted ``key`` (``default`` when absent), marked as read."""
        value = self._lookup(key)
        if value is _MISSING:
            return default
        self.used.add(key)
        return value

    def touched(self, key: str) -> bool:
        """Whether ``key`` or a key below it was read (a section partly mapped)."""
        return key in self.used or any(u.startswith(key + ".") for u in self.used)

    def set(self, key: str, value: Any) -> None:
        """Write ``value`` at the dotted llmforge ``key``."""
        node = self.out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def map(self, src_key: str, dst_key: str, value: Any, note: str = "") -> None:
        """``src_key`` becomes ``dst_key: value``; ``note`` (a difference in behaviour) puts it
        among the changed rows of the report."""
        self.set(dst_key, value)
        self.used.add(src_key)
        (self.changed if note else self.mapped).append((src_key, f"{dst_key}: {value}", note))

    def change(self, src_key: str, what: str, note: str) -> None:
        """``src_key`` is carried over as ``what``, with a difference ``note``."""
        self.used.add(src_key)
        self.changed.append((src_key, what, note))

    def drop(self, src_key: str, reason: str, nearest: str) -> None:
        """``src_key`` has no llmforge equivalent: why, and the nearest setting."""
        self.used.add(src_key)
        self.unmapped.append((src_key, reason, nearest))

    def defaults(self) -> None:
        """Report the keys read without a row of their own (a value that is llmforge's behaviour
        already, e.g. ``activation_checkpointing: false``) as mapped to that behaviour."""
        reported = {k for rows in (self.mapped, self.changed, self.unmapped) for k, _, _ in rows}

        def walk(node: Any, path: str, used: bool) -> None:
            if path in reported:
                return
            used = used or path in self.used
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    walk(v, f"{path}.{k}" if path else str(k), used)
            elif used:
                self.mapped.append((path, "llmforge's behaviour (no key needed)", ""))

        walk(self.src, "", False)

    def leftovers(self) -> list[str]:
        """Dotted keys of the source that nothing read (nor an ancestor of them)."""
        out: list[str] = []

        def walk(node: Any, path: str) -> None:
            if path and (path in self.used):
                return
            if isinstance(node, dict) and node:
                for k, v in node.items():
                    walk(v, f"{path}.{k}" if path else str(k))
            elif path:
                out.append(path)

        walk(self.src, "")
        return out
