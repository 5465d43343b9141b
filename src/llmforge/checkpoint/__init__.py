"""Checkpoints: sharded save/load through torch.distributed.checkpoint, atomic and complete."""

from llmforge.checkpoint.dcp import (COMPLETE, latest_checkpoint, list_checkpoints, load_model_weights,
                                     prune_checkpoints, read_json, save_checkpoint, step_name)

__all__ = ["COMPLETE", "latest_checkpoint", "list_checkpoints", "load_model_weights",
           "prune_checkpoints", "read_json", "save_checkpoint", "step_name"]
