"""``seq_length_warmup``: train on short sequences first, growing to ``trainer.seq_len``.

YAML::

    algorithms:
      - name: seq_length_warmup
        duration: 1000      # optimizer steps of the warmup
        min_seq_len: 64     # length at step 1 (tokens)
        step_size: 8        # lengths are multiples of this (fewer distinct shapes to compile)

Composer's ``SeqLengthWarmup`` (Li, Zhang and He 2022, "The Stability-Efficiency Dilemma:
Investigating Sequence Length Warmup for Training GPT Models", arXiv:2108.06084). At step
``s`` (1-based) the length is::

    L(s) = min_seq_len + (seq_len - min_seq_len) * (s - 1) / duration,   s <= duration
    L(s) = seq_len,                                                      s >  duration

rounded down to a multiple of ``step_size`` and kept within ``[min_seq_len, seq_len]``.

The windows are **truncated** (Composer's ``truncate=True``): each window keeps its first
``L + 1`` tokens and the rest of it is not trained on, so the data order and the data position
in checkpoints are unchanged and a resume is exact (the length is a function of the step).
``train/tokens_seen`` and ``throughput/tokens_per_second`` count the tokens really trained on;
``train/seq_len`` logs ``L``. With ``compile`` each new length compiles once more (``step_size``
bounds how many).
"""

from __future__ import annotations

from typing import Any

from llmforge.errors import ConfigError
from llmforge.plugin import Algorithm, CheckContext


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"algorithms: seq_length_warmup.{key}={value!r} must be an integer >= 1")
    return int(value)


class SeqLengthWarmup(Algorithm):
    """Truncates each step's windows to :meth:`length` tokens during the warmup.

    Args:
        duration: warmup length in optimizer steps (>= 1).
        min_seq_len: sequence length at step 1 (tokens, >= 1, <= ``trainer.seq_len``).
        step_size: lengths are multiples of it (>= 1).

    Raises:
        ConfigError: a bad value, ``min_seq_len`` or ``step_size`` above ``trainer.seq_len``,
            ``data.task=sft`` (truncation would cut the responses, the only targets), or under
            ``strategy.cp > 1`` a ``min_seq_len`` or ``step_size`` that ``2 x cp`` does not divide.
    """

    name = "seq_length_warmup"
    order = -10  # first at BATCH_START: later handlers see the truncated batch
    summary = "sequence length warmup: windows truncated from min_seq_len to seq_len over duration steps"

    def __init__(self, duration: int = 1000, min_seq_len: int = 64, step_size: int = 8) -> None:
        self.duration = _positive_int(duration, "duration")
        self.min_seq_len = _positive_int(min_seq_len, "min_seq_len")
        self.step_size = _positive_int(step_size, "step_size")

    def check(self, run: CheckContext) -> None:
        cfg = run.cfg
        if self.min_seq_len > int(cfg.trainer.seq_len):
            raise ConfigError(f"algorithms: seq_length_warmup.min_seq_len={self.min_seq_len} exceeds "
                              f"trainer.seq_len={cfg.trainer.seq_len}; lower it")
        if getattr(getattr(cfg, "data", None), "task", None) == "sft":
            # an SFT row is prompt then response: truncating keeps the prompt (no targets) and
            # cuts the response, so early steps would train on few or no tokens
            raise ConfigError("algorithms: seq_length_warmup truncates each row, which cuts the "
                              "responses (the only targets) of data.task=sft rows; drop it for SFT")
        cp = int(getattr(run.dims, "cp", 1))
        if cp > 1 and (self.min_seq_len % (2 * cp) or self.step_size % (2 * cp)):
            # the context-parallel step cuts every row into 2 x cp chunks, at every length
            raise ConfigError(f"algorithms: seq_length_warmup under strategy.cp={cp} needs min_seq_len "
                              f"({self.min_seq_len}) and step_size ({self.step_size}) divisible by "
                              f"2 x cp = {2 * cp}; set both to multiples of {2 * cp}")
        if self.step_size > int(cfg.trainer.seq_len):  # every warmup length would be min_seq_len
            raise ConfigError(f"algorithms: seq_length_warmup.step_size={self.step_size} exceeds "
                              f"trainer.seq_len={cfg.trainer.seq_len}; lower it (e.g. 8)")

    def length(self, step: int, seq_len: int) -> int:
        """The sequence length (tokens) of optimizer step ``step`` (1-based)."""
        if step > self.duration:
            return seq_len
        grown = self.min_seq_len + (seq_len - self.min_seq_len) * (step - 1) / self.duration
        rounded = int(grown) // self.step_size * self.step_size
        return max(self.min_seq_len, min(seq_len, rounded))

    def batch_start(self, state: Any) -> None:
        batch = state.batch
        if isinstance(batch, dict):
            seq_len = batch["input_ids"].shape[1]
            n = self.length(state.step, seq_len)
            state.batch = {k: (v[:, :n] if k in ("input_ids", "labels", "doc_ids", "token_mask") else v)
                           for k, v in batch.items()}
        else:  # windows of seq_len + 1 tokens (inputs and the shifted labels)
            seq_len = batch.shape[1] - 1
            n = self.length(state.step, seq_len)
            state.batch = batch[:, :n + 1]
        state.metrics["train/seq_len"] = n
