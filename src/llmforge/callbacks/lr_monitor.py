"""``lr_monitor``: the learning rate (and optionally Adam's beta1) of every parameter group.

YAML::

    callbacks:
      - name: lr_monitor
        log_momentum: false   # also train/beta1/<group>

Metrics, on logging steps: ``train/lr/<group>`` for each optimizer parameter group, named by
the group's ``name`` (``decay``, ``no_decay`` for the built-in AdamW) or its index. The values
are those used by the step's update (read just before ``optimizer.step()``); ``train/lr`` (the
first group) is always logged by the module.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


class LearningRateMonitor(Callback):
    """Adds per-parameter-group learning rates to the record of each logging step.

    Args:
        log_momentum: also log ``train/beta1/<group>`` (Adam's ``betas[0]`` or SGD's momentum).
    """

    def __init__(self, log_momentum: bool = False) -> None:
        self.log_momentum = bool(log_momentum)

    def before_optimizer_step(self, state: Any) -> None:
        """Event ``BEFORE_OPTIMIZER_STEP``: the values the step's update uses, into the record
        of a logging step."""
        if not state.module.is_log_step(state.step):
            return
        values = {}
        for i, group in enumerate(state.optimizer.param_groups):
            name = str(group.get("name", i))
            values[f"train/lr/{name}"] = float(group["lr"])
            if self.log_momentum:
                beta = group["betas"][0] if "betas" in group else group.get("momentum")
                if beta is not None:
                    values[f"train/beta1/{name}"] = float(beta)
        state.metrics.update(values)
