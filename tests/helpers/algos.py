"""Test algorithms (named in YAML by import path): inject a loss spike, drop one step's update."""

from llmforge.algorithms import Algorithm


class SpikeAt(Algorithm):
    """Multiply the training loss of optimizer step ``step`` by ``factor`` (a spike in both the
    loss and the gradient norm)."""

    name = "spike_at"

    def __init__(self, step: int, factor: float = 1000.0) -> None:
        self.step, self.factor = int(step), float(factor)

    def after_loss(self, state):
        if state.training and state.step == self.step:
            state.loss = state.loss * self.factor


class SkipAt(Algorithm):
    """Drop the update of optimizer step ``step`` (as if its batch had never been trained on)."""

    name = "skip_at"

    def __init__(self, step: int) -> None:
        self.step = int(step)

    def before_optimizer_step(self, state):
        if state.step == self.step:
            state.skip_step = True
