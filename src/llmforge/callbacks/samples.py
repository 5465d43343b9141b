"""``generate_samples``: sample text from fixed prompts every N steps, to watch a run learn.

YAML::

    callbacks:
      - name: generate_samples
        prompts: ["ROMEO.", "To be, or not"]
        every: 100            # optimizer steps (and when training ends)
        max_new_tokens: 48
        temperature: 0.8      # 0 = greedy
        top_k: 50
        seed: 0

Each sample is a line ``{"step", "prompt", "sample"}`` in ``<run_dir>/samples.jsonl`` and a
row of the text table ``samples`` in every logger that has ``log_text(key, columns, data,
step)`` (W&B table, TensorBoard text, Comet text samples, console). Sampling uses
:func:`llmforge.models.sampling.generate` with the data module's tokenizer, its own seeded
generator (the training RNG is not touched) and restores the model's training mode.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.callbacks._util import run_dir
from llmforge.errors import ConfigError
from llmforge.models.sampling import generate


class GenerateSamples(Callback):
    """Generates a continuation of each prompt every ``every`` steps and logs it as text.

    Args:
        prompts: texts to continue (at least one).
        every: steps between samples (>= 1); samples are also drawn when training ends.
        max_new_tokens: tokens to generate per prompt.
        temperature: sampling temperature; ``0`` = greedy.
        top_k: sample among the ``top_k`` likeliest tokens; ``None`` = all.
        seed: seed of the sampling generator (the same at every step, so samples differ only
            because the model changed).
        filename: the file in the run directory.

    Raises:
        ConfigError: no prompts, or ``every``/``max_new_tokens`` < 1.
    """

    def __init__(self, prompts: list[str], every: int = 100, max_new_tokens: int = 48,
                 temperature: float = 0.8, top_k: Optional[int] = 50, seed: int = 0,
                 filename: str = "samples.jsonl") -> None:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        if not prompts:
            raise ConfigError("callbacks: generate_samples: give at least one prompt in prompts: [...]")
        if int(every) < 1 or int(max_new_tokens) < 1:
            raise ConfigError("callbacks: generate_samples: every and max_new_tokens must be >= 1")
        self.prompts = [str(p) for p in prompts]
        self.every, self.max_new_tokens = int(every), int(max_new_tokens)
        self.temperature, self.top_k, self.seed = float(temperature), top_k, int(seed)
        self.filename = filename
        self._last_step: Optional[int] = None

    def sample(self, trainer: Any, pl_module: Any) -> list[dict[str, Any]]:
        """One sample per prompt from the current model: ``[{"step", "prompt", "sample"}]``."""
        tokenizer = trainer.datamodule.tokenizer
        device = pl_module.device
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(self.seed)
        rows = []
        for prompt in self.prompts:
            ids = tokenizer.encode(prompt, bos=True)
            new = generate(pl_module.model, ids, self.max_new_tokens, temperature=self.temperature,
                           top_k=self.top_k, eos_id=tokenizer.eos_id, generator=gen)
            rows.append({"step": trainer.global_step, "prompt": prompt, "sample": tokenizer.decode(new)})
        return rows

    def write(self, trainer: Any, pl_module: Any) -> None:
        step = trainer.global_step
        if self._last_step == step:
            return
        self._last_step = step
        rows = self.sample(trainer, pl_module)
        if not trainer.is_global_zero:
            return
        with open(run_dir(trainer) / self.filename, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        data = [[r["step"], r["prompt"], r["sample"]] for r in rows]
        for logger in trainer.loggers:
            if callable(getattr(logger, "log_text", None)):
                logger.log_text(key="samples", columns=["step", "prompt", "sample"], data=data, step=step)

    def after_optimizer_step(self, state: Any) -> None:
        if state.step % self.every == 0:
            self.write(state.trainer, state.module)

    def fit_end(self, state: Any) -> None:
        self.write(state.trainer, state.module)  # the final model (no-op if this step was just sampled)
