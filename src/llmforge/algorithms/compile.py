"""``compile``: ``torch.compile`` of the whole model or per transformer block, in place.

YAML::

    algorithms:
      - name: compile
        per_block: auto       # auto: the whole model in one process, each block under DDP/FSDP2/TP
                              # true: each block of model.blocks() (and the final norm); false: the whole model
        fullgraph: true       # a graph break is an error instead of a silent slowdown
        mode: null            # torch.compile mode: default, reduce-overhead, max-autotune, ...
        dynamic: false        # shapes are fixed (seq_len, micro_batch_size): no dynamic shapes
        backend: inductor
        compile_loss: auto    # also compile LLMModule.compute_loss: auto = when the logits are not fp32

Stage ``COMPILE``: after activation checkpointing (the checkpoint wrapper is compiled with its
block, so recomputation is compiled too) and before FSDP2 (torchtitan's order). Compilation is
in place (``nn.Module.compile``), so ``model.blocks()``, module types and state-dict keys are
unchanged (no ``_orig_mod.`` prefix). Identical blocks share one compiled graph.

``per_block: auto`` compiles the whole model when one process trains it without a data- or
tensor-parallel wrapper (one graph: the embedding, the final norm and the output projection fuse
with the blocks and nothing runs eager between blocks; LitGPT's choice) and each block otherwise
(the hooks FSDP2 and DDP put on every block stop a whole-model graph; torchtitan's choice).

The first training step pays the compilation: ``time/compile_seconds`` (first step's wall time
minus the second's, seconds) is printed once on rank 0 and written to the next logged record.

Source: torch.compile tutorial and torchtitan ``apply_compile``
(torchtitan/models/llama3/infra/parallelize.py).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

from torch import nn

from llmforge.errors import ConfigError
from llmforge.models.decoder import RMSNorm
from llmforge.plugin import Algorithm, CheckContext, ModelContext, Stage

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class Compile(Algorithm):
    """torch.compile the whole model or each transformer block, in place.

    Args:
        per_block: ``True`` compiles every module of ``model.blocks()`` and the final norm;
            ``False`` compiles the whole model once (under data parallelism only with
            ``fullgraph: false``, see :meth:`check`); ``"auto"`` (default) is ``False`` in one
            process without a device mesh and ``True`` otherwise (:meth:`compiles_per_block`).
            The demo's compiled step on 2 CPU cores: whole model 1-2 % faster than per block
            (``benchmarks/results/peers-issue30-2026-12-03d.md``).
        fullgraph: refuse graph breaks (``torch.compile(fullgraph=True)``).
        mode: ``torch.compile`` mode (``None`` = default).
        dynamic: dynamic-shape compilation (``False``: shapes are fixed by the config).
        backend: ``torch.compile`` backend (``inductor``; ``aot_eager`` for debugging).
        compile_loss: also compile the module's ``compute_loss``: the fp32 upcast of bf16/fp16
            logits, log-softmax, the target gather and their backward fuse into a few passes
            over the logits. ``"auto"`` (default): only when the run's precision is not 32-bit;
            with float32 logits there is no upcast to fuse, and the eager lean loss
            (:func:`llmforge.training.cross_entropy.cross_entropy_sum`, no ``[b*T, V]``
            temporaries in its backward) was faster: the demo's compiled step, fp32 on the CPU,
            0.98-1.08x (median 1.04) against the compiled loss in four pairs run side by side
            (``benchmarks/results/peers-issue30-2026-12-02d.md``), at 16 MiB more peak memory.

    Raises:
        ConfigError: an unknown ``mode``, a ``per_block`` or ``compile_loss`` that is not a
            boolean or ``"auto"``.
    """

    name = "compile"
    stage = Stage.COMPILE
    summary = "torch.compile the whole model (one process) or each block, in place; logs compile time"

    def __init__(self, per_block: bool | str = "auto", fullgraph: bool = True, mode: Optional[str] = None,
                 dynamic: bool = False, backend: str = "inductor",
                 compile_loss: bool | str = "auto") -> None:
        if not (isinstance(compile_loss, bool) or compile_loss == "auto"):
            raise ConfigError(f"algorithms: compile.compile_loss {compile_loss!r} is not a YAML "
                              "boolean (true, false) or auto")
        if not (isinstance(per_block, bool) or per_block == "auto"):
            raise ConfigError(f"algorithms: compile.per_block {per_block!r} is not a YAML "
                              "boolean (true, false) or auto")
        if mode not in MODES:
            raise ConfigError(f"algorithms: compile.mode '{mode}' is not one of "
                              f"{', '.join(str(m) for m in MODES if m)} (or null)")
        self.per_block, self.fullgraph, self.mode = per_block, bool(fullgraph), mode
        self.dynamic, self.backend, self.compile_loss = bool(dynamic), backend, compile_loss
        self.compile_seconds: Optional[float] = None
        self._pending = False
        self._t0 = 0.0
        self._durations: list[float] = []
        self._loss = False  # whether fit_start compiled the loss (loss_compiled)
        self._whole = False  # whether apply compiled the whole model

    def compile_kwargs(self, fullgraph: Optional[bool] = None) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile``."""
        kw: dict[str, Any] = {"backend": self.backend, "dynamic": self.dynamic,
                              "fullgraph": self.fullgraph if fullgraph is None else fullgraph}
        if self.mode not in (None, "default"):
            kw["mode"] = self.mode
        return kw

    def check(self, run: CheckContext) -> None:
        """A whole-model ``fullgraph`` compile cannot trace through the data-parallel hooks
        that FSDP2 / replicate put on every block (they are ``torch._dynamo.disable``-d).

        Raises:
            ConfigError: ``per_block: false`` and ``fullgraph: true`` under FSDP2 or DDP (names
                ``compile.per_block``, ``compile.fullgraph`` and ``strategy.name``).
        """
        data_parallel = run.world_size > 1 or run.strategy == "fsdp2"
        if self.per_block is False and self.fullgraph and data_parallel:
            raise ConfigError(
                f"algorithms: compile.per_block=false with compile.fullgraph=true cannot trace "
                f"through the hooks that data parallelism (strategy.name={run.strategy}, "
                f"{run.world_size} process(es)) puts on every block; use compile.per_block=true "
                "(torchtitan's choice) or compile.fullgraph=false (a graph break per block)")

    def compiles_per_block(self, ctx: Optional[ModelContext]) -> bool:
        """Whether :meth:`apply` compiles per block: ``per_block``, or for ``"auto"`` whether
        the run has a device mesh, several processes or a ``ddp``/``fsdp2`` strategy (``ctx``
        ``None``, outside a run: one process, so the whole model)."""
        if self.per_block != "auto":
            return bool(self.per_block)
        if ctx is None:
            return False
        strategy = str(getattr(getattr(ctx.cfg, "strategy", None), "name", "auto"))
        world = int(getattr(ctx.dims, "world_size", 1) or 1)
        return ctx.mesh is not None or world > 1 or strategy in ("ddp", "fsdp2")

    def apply(self, model: nn.Module, ctx: Optional[ModelContext]) -> nn.Module:
        """Compile the whole ``model``, or ``model.blocks()`` and the built-in decoders' final
        norm (:class:`llmforge.models.decoder.RMSNorm`), in place (see
        :meth:`compiles_per_block`); returns ``model``.

        Raises:
            ConfigError: ``per_block: true`` on a model without ``blocks()``."""
        kw = self.compile_kwargs()
        self._whole = not self.compiles_per_block(ctx)
        if self._whole:
            model.compile(**kw)
            return model
        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ConfigError("compile.per_block=true needs a model with blocks(); "
                              "set compile.per_block=false to compile the whole model")
        for block in blocks():
            block.compile(**kw)
        # the final norm would run eager between the last block and the output projection
        # (its pow/mean/rsqrt/mul and their backward: ~1 % of the demo's CPU step)
        norm = getattr(model, "norm", None)
        if isinstance(norm, RMSNorm):
            norm.compile(**kw)
        return model

    # ------------------------------------------------------------------ training events
    def loss_compiled(self, precision: str) -> bool:
        """Whether ``compute_loss`` is compiled in a run of Lightning ``precision``
        (``"32-true"``, ``"bf16-mixed"``, ...): ``compile_loss``, or for ``"auto"`` whether
        the logits are narrower than float32 (their upcast fuses into the compiled loss)."""
        if self.compile_loss == "auto":
            return not str(precision).startswith(("32", "64"))
        return bool(self.compile_loss)

    def fit_start(self, state: Any) -> None:
        pl_module = state.module
        self._loss = self.loss_compiled(getattr(state.trainer, "precision", "32-true"))
        if self._loss and not getattr(pl_module, "_llmforge_loss_compiled", False):
            import torch

            pl_module.compute_loss = torch.compile(pl_module.compute_loss,
                                                   **self.compile_kwargs(fullgraph=False))
            pl_module._llmforge_loss_compiled = True
        if state.trainer.is_global_zero:
            # the first forward can take minutes on a CPU: say why nothing moves meanwhile
            print(f"compile: torch.compile ({self.backend}) of {self.target()} runs in the first "
                  "forward; the first step (and an evaluation before it) waits for it",
                  file=sys.stderr, flush=True)

    def target(self) -> str:
        """What :meth:`apply` and :meth:`fit_start` compiled, in words (for the messages)."""
        what = "the whole model" if self._whole else "each block and the final norm"
        return what + (", and the loss" if self._loss else "")

    def batch_start(self, state: Any) -> None:
        self._t0 = time.perf_counter()

    def after_optimizer_step(self, state: Any) -> None:
        trainer, pl_module = state.trainer, state.module
        if len(self._durations) < 2:
            self._durations.append(time.perf_counter() - self._t0)
            if len(self._durations) == 2:
                first, second = self._durations
                self.compile_seconds = max(0.0, first - second)
                self._pending = True
                if trainer.is_global_zero:
                    print(f"compile: {self.compile_seconds:.1f} s of compilation in the first step "
                          f"(torch.compile of {self.target()}, {self.backend}; first step {first:.1f} s, "
                          f"second {second:.2f} s)", flush=True)
        if self._pending and pl_module.is_log_step(state.step):
            state.metrics["time/compile_seconds"] = self.compile_seconds
            self._pending = False
