"""Algorithm plugins and the model pipeline (see :mod:`llmforge.plugin`), acting on
the training events of :mod:`llmforge.events`.

Built-ins (registered in :data:`llmforge.registry.algorithms`): ``float8`` (stage convert),
``activation_checkpointing`` (activation_checkpointing), ``compile`` (compile), ``lora``
(convert, after float8), ``chunked_cross_entropy`` (convert, after lora), and the event-only
``z_loss``, ``seq_length_warmup``, ``batch_size_warmup``, ``ema``, ``loss_spike_guard``. The pipeline order and why,
the events and how to write an algorithm: ``docs/algorithms/README.md``.
"""

from llmforge.algorithms.batch_size_warmup import BatchSizeWarmup
from llmforge.algorithms.activation_checkpointing import ActivationCheckpointing
from llmforge.algorithms.chunked_cross_entropy import ChunkedCrossEntropy
from llmforge.algorithms.compile import Compile
from llmforge.algorithms.ema import EMA
from llmforge.algorithms.float8 import Float8
from llmforge.algorithms.lora import LoRA
from llmforge.algorithms.loss_spike_guard import LossSpikeGuard
from llmforge.algorithms.seq_length_warmup import SeqLengthWarmup
from llmforge.algorithms.z_loss import ZLoss
from llmforge.plugin import Algorithm, ModelContext, Stage, Transform, algorithm_kind, run_pipeline
from llmforge.registry import algorithms as _registry

# the list of built-ins: a new algorithm is one file above plus one line here
BUILTINS = {"compile": Compile, "activation_checkpointing": ActivationCheckpointing, "float8": Float8,
            "lora": LoRA, "z_loss": ZLoss, "seq_length_warmup": SeqLengthWarmup, "ema": EMA,
            "loss_spike_guard": LossSpikeGuard, "chunked_cross_entropy": ChunkedCrossEntropy,
            "batch_size_warmup": BatchSizeWarmup}
for _name, _cls in BUILTINS.items():
    _registry.register(_name, _cls)
_registry.expect(algorithm_kind)  # an import path must name an Algorithm subclass

__all__ = ["Algorithm", "ModelContext", "Stage", "Transform", "run_pipeline", "BUILTINS",
           "ActivationCheckpointing", "BatchSizeWarmup", "ChunkedCrossEntropy", "Compile", "EMA", "Float8", "LoRA",
           "LossSpikeGuard", "SeqLengthWarmup", "ZLoss"]
