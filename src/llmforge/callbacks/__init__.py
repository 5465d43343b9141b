"""Ready callbacks (Lightning's own interface): speed, progress, checkpointing.

A callback entry in YAML is ``{name: REGISTERED_NAME_OR_IMPORT_PATH, **kwargs}``; the class is
called with the kwargs.
"""

from llmforge.callbacks.checkpointing import Checkpointer
from llmforge.callbacks.progress import RichProgress
from llmforge.callbacks.speed import SpeedMonitor
from llmforge.registry import callbacks

callbacks.register("speed_monitor", SpeedMonitor)
callbacks.register("rich_progress", RichProgress)

__all__ = ["Checkpointer", "RichProgress", "SpeedMonitor"]
