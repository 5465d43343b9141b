"""``profiler``: a ``torch.profiler`` trace of a window of optimizer steps, for Chrome/Perfetto.

YAML::

    callbacks:
      - name: profiler
        start_step: 5          # the first profiled optimizer step (skip warm-up/compile steps)
        steps: 3               # how many steps to profile
        record_shapes: false
        profile_memory: false
        with_stack: false

Writes ``<run_dir>/profiler/trace_rank<R>_steps<A>-<B>.json`` (open in https://ui.perfetto.dev
or chrome://tracing). CPU activity is always recorded, CUDA kernels when training on a GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from llmforge.callbacks._util import run_dir, say
from llmforge.errors import ConfigError


class Profiler(Callback):
    """Profiles optimizer steps ``start_step .. start_step + steps - 1`` (1-based).

    Args:
        start_step: the first profiled step (>= 1).
        steps: number of profiled steps (>= 1).
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``.
        dir: folder inside the run directory.

    Raises:
        ConfigError: ``start_step`` or ``steps`` < 1.

    Attributes:
        trace_path: the written trace, once the window is over.
    """

    def __init__(self, start_step: int = 5, steps: int = 3, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, dir: str = "profiler") -> None:
        if int(start_step) < 1 or int(steps) < 1:
            raise ConfigError(f"callbacks: profiler: start_step and steps must be >= 1; got "
                              f"{start_step!r}, {steps!r}")
        self.start_step, self.steps = int(start_step), int(steps)
        self.options = dict(record_shapes=bool(record_shapes), profile_memory=bool(profile_memory),
                            with_stack=bool(with_stack))
        self.dir = dir
        self._prof: Optional[torch.profiler.profile] = None
        self._first: Optional[int] = None
        self.trace_path: Optional[Any] = None

    def batch_start(self, state: Any) -> None:
        step = state.step  # the step about to run
        if self._prof is None and self.trace_path is None and step >= self.start_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if state.module.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, **self.options)
            self._prof.__enter__()
            self._first = step

    def after_optimizer_step(self, state: Any) -> None:
        if self._prof is not None:
            self._prof.step()
            if state.step >= self.start_step + self.steps - 1:
                self._finish(state.trainer)

    def fit_end(self, state: Any) -> None:
        if self._prof is not None:  # the run ended inside the window
            self._finish(state.trainer)

    def _finish(self, trainer: Any) -> None:
        assert self._prof is not None
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        out = run_dir(trainer) / self.dir
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"trace_rank{trainer.global_rank}_steps{self._first}-{trainer.global_step}.json"
        self._prof.export_chrome_trace(str(path))
        self._prof, self.trace_path = None, path
        say(trainer, f"profiler: trace of steps {self._first}-{trainer.global_step} in {path}")
