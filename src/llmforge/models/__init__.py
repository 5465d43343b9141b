"""Model families and the model factory contract.

Model families
--------------
One folder per family (``llama3/``, ``qwen3/``, ``qwen3_moe/``): its ``model:`` YAML keys and presets, the
model, its tensor-parallel plan and its Hugging Face adapter, bundled by a
:class:`~llmforge.models.spec.ModelSpec` and registered below by name — adding a family is one
folder plus one line here (docs/models.md). Third-party packages register specs (or bare
factories) through the ``llmforge.models`` entry-point group; research code with
``registry.models.register``.

Model factory contract
----------------------
A spec's ``build`` (or a bare factory registered in :data:`llmforge.registry.models`, or named
by import path in ``model.name``) is called as ``factory(cfg)`` with the ``model:`` config
section and returns an ``nn.Module`` with:

* ``forward(tokens: LongTensor[B, T]) -> logits: Tensor[B, T, V]`` (next-token logits);
* ``blocks() -> list[nn.Module]``: the repeated blocks that FSDP2, activation checkpointing
  and ``torch.compile`` wrap one by one (or the spec's ``blocks``);
* ``init_weights()``: (re)initializes every parameter and buffer in place, so that a model
  built under ``with torch.device("meta"):`` then ``to_empty(device=...)`` is fully valid
  after it (deterministic given torch's seed);
* ``flops_per_token(seq_len) -> float``: training FLOPs per token (forward + backward);
* ``num_params() -> int``: parameter count, shared weights once;
* attribute ``vocab_size`` (embedding rows; must cover the tokenizer);
* optionally ``aux_losses() -> dict[str, Tensor]``: auxiliary losses of the last forward
  (scalar tensors, a mean per token with their weight applied, e.g. a router's load-balancing
  loss). The trainer reads them after every forward into ``state.aux_losses``, adds them to
  the optimized loss in training (never to ``eval/loss``) and logs ``train/aux_loss`` and
  ``train/aux/<name>`` (:mod:`llmforge.events`);
* optionally ``aux_carry() -> Tensor`` (1-D float32), with ``aux_losses(carry)``: what the
  auxiliary losses need from the last forward as one tensor that adds up over pipeline
  stages (e.g. a router's per-expert counts and probability sums, differentiable where the
  losses are). Under ``strategy.pp > 1`` each stage sends its sum on with the hidden states and
  the last stage computes ``aux_losses(carry)`` from the whole model's sum (its gradients flow
  back through the schedule); a model with ``aux_losses`` but no ``aux_carry`` is refused
  under ``pp > 1``;
* optionally ``aux_metrics() -> dict[str, Tensor | float]``: monitoring values of the last
  forward (e.g. ``moe/load_max_mean/layer_0``), logged as means over the step's forwards
  and data-parallel ranks (under ``pp > 1`` each stage's for its own layers, and with
  ``aux_carry`` the last stage's ``aux_metrics(carry)`` for what needs all the layers; a key
  several stages give is their mean).
* optionally ``after_optimizer_step(all_reduce)``: called on every rank after each optimizer
  step that was taken, with a function summing a tensor over the data-parallel ranks (e.g. a
  router's loss-free balancing bias, moved by the step's expert load).

The factory must work when called under ``with torch.device("meta"):`` (no data-dependent
work, no host copies of parameters). This package imports no torch until a model is built
(the Llama 3 model is :mod:`llmforge.models.llama3.model`, its presets
:mod:`llmforge.models.llama3.config`).
"""

from __future__ import annotations

from llmforge.models.llama3 import LLAMA3
from llmforge.models.qwen3 import QWEN3
from llmforge.models.qwen3_moe import QWEN3_MOE
from llmforge.models.spec import MemoryShape, ModelSpec, factory_kind, get_spec
from llmforge.registry import models

__all__ = ["LLAMA3", "QWEN3", "QWEN3_MOE", "ModelSpec", "MemoryShape", "get_spec"]

models.register("llama3", LLAMA3)
models.register("qwen3", QWEN3)
models.register("qwen3_moe", QWEN3_MOE)
models.expect(factory_kind)  # model.name by import path: checked before it is called
