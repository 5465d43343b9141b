"""Loading DCP checkpoints without running code from them.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and the default load
planner reads non-tensor entries (e.g. optimizer hyper-parameters) with
``torch.load(weights_only=False)``: a crafted checkpoint could run code. :class:`SafeReader`
unpickles the metadata with an allow-list of DCP's own metadata classes and torch's
dtype/layout/size types, and :class:`SafeLoadPlanner` reads non-tensor entries with
``torch.load(weights_only=True)``. Anything else raises :class:`UnsafeCheckpointError`.
"""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from llmforge.errors import LLMForgeError

_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes",
                  "bool", "complex", "slice", "NoneType"}
_SAFE_TORCH = {"Size", "device"}


class UnsafeCheckpointError(LLMForgeError):
    """A checkpoint's metadata refers to a class outside the allow-list. Exit code 1."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_SAFE_MODULE_PREFIXES):
            return super().find_class(module, name)
        if module == "builtins" and name in _SAFE_BUILTINS:
            return getattr(builtins, name)
        if (module, name) in (("collections", "OrderedDict"), ("torch.serialization", "_get_layout"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")):
            return super().find_class(module, name)
        if module == "torch" and (name in _SAFE_TORCH or isinstance(getattr(torch, name, None),
                                                                    (torch.dtype, torch.layout,
                                                                     torch.memory_format))):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which a checkpoint never needs; "
            "refusing to load it (it could run code)")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = _Unpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element as set_path

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict, path: str) -> None:
    """``dcp.load(state, ...)`` with :class:`SafeReader` and :class:`SafeLoadPlanner`.

    Raises:
        UnsafeCheckpointError: the metadata refers to a class outside the allow-list.
        pickle.UnpicklingError: a non-tensor entry is not loadable with ``weights_only``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeReader(path)
    reader.read_metadata()  # fail here, with our own error, before DCP wraps it
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except CheckpointException as exc:
        if "Weights only load failed" in str(exc) or "Unsupported global" in str(exc):
            raise UnsafeCheckpointError(
                f"{path}: a non-tensor entry of the checkpoint is not plain data; refusing to "
                "load it (it could run code)") from exc
        raise
