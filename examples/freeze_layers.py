"""Research example: layer freezing, then unfreezing (progressive training) with a plain plugin.

``FreezeLayers`` keeps the parameters whose names start with one of ``prefixes`` (e.g. the
token embeddings, ``tok_embeddings``, or the first blocks, ``layers.0.``) unchanged for the
first ``steps`` optimizer steps: at ``BEFORE_OPTIMIZER_STEP`` it sets their gradients to
``None``, so AdamW skips them altogether (no update, no weight decay, and no optimizer state
until their first real step). From step ``steps + 1`` on they train like the rest.

``state.step`` at ``BEFORE_OPTIMIZER_STEP`` is the step being taken, 1-based: ``steps: 3``
freezes steps 1, 2 and 3. A checkpoint saved while they are frozen holds no optimizer state
for them, and resumes exactly (docs/research.md); the plugin keeps no state of its own (the
step number decides). Run it from the repository root::

    PYTHONPATH=. llmforge train examples/freeze_layers.yaml

The gradient norm (``train/grad_norm``) and its clipping are computed before
``BEFORE_OPTIMIZER_STEP``, so they still include the frozen gradients.
"""

from __future__ import annotations

from typing import Any, Sequence

from llmforge.algorithms import Algorithm
from llmforge.errors import ConfigError


class FreezeLayers(Algorithm):
    """Freeze the parameters named ``prefix...`` for the first ``steps`` optimizer steps.

    Args:
        prefixes: parameter-name prefixes (``model.named_parameters()`` names, e.g.
            ``tok_embeddings`` or ``layers.0.``); a name matches when it starts with one.
        steps: how many steps (1-based: steps ``1 .. steps``) they stay frozen; ``>= 0``.

    Raises:
        ConfigError: ``prefixes`` empty, or ``steps`` negative.
    """

    name = "freeze_layers"

    def __init__(self, prefixes: Sequence[str] = ("tok_embeddings",), steps: int = 10) -> None:
        if isinstance(prefixes, str):
            prefixes = [prefixes]
        if not prefixes or int(steps) < 0:
            raise ConfigError(f"algorithms: {self.name} needs prefixes (e.g. [tok_embeddings]) and "
                              f"steps >= 0; got prefixes={list(prefixes)!r}, steps={steps!r}")
        self.prefixes, self.steps = tuple(str(p) for p in prefixes), int(steps)

    def frozen(self, name: str) -> bool:
        return name.startswith(self.prefixes)

    def before_optimizer_step(self, state: Any) -> None:
        frozen = state.step <= self.steps
        state.metrics["train/frozen"] = float(frozen)
        if frozen:
            for name, p in state.model.named_parameters():  # a pipeline rank: its stages' only
                if self.frozen(name):
                    p.grad = None  # the optimizer skips a parameter without a gradient
