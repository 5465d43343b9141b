"""Ready callbacks (Lightning's own interface): speed, progress, checkpointing, monitors.

A callback entry in YAML is ``{name: REGISTERED_NAME_OR_IMPORT_PATH, **kwargs}``; the class is
called with the kwargs. Registered names: ``speed_monitor`` (always on; an entry configures
it), ``memory_monitor``, ``lr_monitor``, ``nan_guard``, ``early_stopping``,
``generate_samples``, ``profiler``, ``memory_snapshot``, ``eval_harness``, ``rich_progress``. See
``docs/callbacks.md`` for every key.
"""

from llmforge.callbacks.checkpointing import Checkpointer
from llmforge.callbacks.early_stopping import EarlyStopping
from llmforge.callbacks.eval_harness import EvalHarness
from llmforge.callbacks.gc import GarbageCollection
from llmforge.callbacks.lr_monitor import LearningRateMonitor
from llmforge.callbacks.memory import MemoryMonitor
from llmforge.callbacks.memory_snapshot import MemorySnapshot
from llmforge.callbacks.nan_guard import NaNGuard
from llmforge.callbacks.profiler import Profiler
from llmforge.callbacks.progress import RichProgress
from llmforge.callbacks.samples import GenerateSamples
from llmforge.callbacks.speed import SpeedMonitor
from llmforge.registry import callbacks

callbacks.register("speed_monitor", SpeedMonitor)
callbacks.register("rich_progress", RichProgress)
callbacks.register("memory_monitor", MemoryMonitor)
callbacks.register("lr_monitor", LearningRateMonitor)
callbacks.register("nan_guard", NaNGuard)
callbacks.register("early_stopping", EarlyStopping)
callbacks.register("generate_samples", GenerateSamples)
callbacks.register("profiler", Profiler)
callbacks.register("memory_snapshot", MemorySnapshot)
callbacks.register("eval_harness", EvalHarness)

__all__ = ["Checkpointer", "EarlyStopping", "EvalHarness", "GarbageCollection", "GenerateSamples", "LearningRateMonitor",
           "MemoryMonitor", "MemorySnapshot", "NaNGuard", "Profiler", "RichProgress",
           "SpeedMonitor"]
