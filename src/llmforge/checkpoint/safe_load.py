"""Loading DCP checkpoints without running code from them.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and the default load
planner reads non-tensor entries (e.g. optimizer hyper-parameters) with
``torch.load(weights_only=False)``: a crafted checkpoint could run code. :class:`SafeReader`
unpickles the metadata with an allow-list of exact ``(module, name)`` pairs — DCP's own metadata
classes and torch's dtype/layout/size types, :data:`SAFE_GLOBALS` — and never resolves dotted
names (attribute walks); :class:`SafeLoadPlanner` reads non-tensor entries with
``torch.load(weights_only=True)``. Anything else raises :class:`UnsafeCheckpointError` (exit 2)
before any of it is run. Tensor data files are read by DCP with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from llmforge.errors import LLMForgeError

# Exact (module, name) pairs a DCP ``.metadata`` pickle refers to (collected from checkpoints of
# models, optimizers and plain extra state with torch 2.6-2.13). Never module prefixes: pickle
# protocol 4 resolves a dotted name by walking attributes, so ``torch.distributed.checkpoint.
# filesystem`` + ``os.system`` reached any importable function.
_DCP = "torch.distributed.checkpoint."
SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [(_DCP + "metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                      "TensorStorageMetadata", "BytesStorageMetadata",
                                      "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [(_DCP + "filesystem", n) for n in ("_StorageInfo", "_StoragePrefix", "SerializationFormat")]
    + [("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "str",
                                 "bytes", "bool", "complex", "slice")]
    + [("collections", "OrderedDict"), ("torch.serialization", "_get_layout"), ("torch", "Size"),
       ("torch", "device")]
    + [("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")]
)


class UnsafeCheckpointError(LLMForgeError):
    """A checkpoint file refers to code outside the allow-list; nothing of it was run. Exit code 2."""

    exit_code = 2


class CheckpointReadError(LLMForgeError):
    """A checkpoint file is missing, truncated or corrupt. Exit code 2."""

    exit_code = 2


def _torch_enum_value(name: str) -> bool:
    """``torch.<name>`` is a dtype, layout or memory format (plain values, no code)."""
    return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class _Unpickler(pickle.Unpickler):
    """Resolves only exact allow-listed globals; dotted names (attribute walks) never."""

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in SAFE_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and _torch_enum_value(name):
                return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refers to {module}.{name}, which a checkpoint never needs; refused to "
            "load it (unpickling it could run code). Use checkpoints only from sources you trust")


def load_metadata(path: str | os.PathLike, fs: Any = None) -> Any:
    """Unpickle a DCP ``.metadata`` file with the allow-list.

    Raises:
        UnsafeCheckpointError: it refers to anything outside :data:`SAFE_GLOBALS` (or is not a
            pickle of DCP metadata at all).
        CheckpointReadError: it is missing, truncated or unreadable.
    """
    source = str(path)
    try:
        stream = fs.create_stream(path, "rb") if fs is not None else open(path, "rb")
        with stream as f:
            metadata = _Unpickler(f, source).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointReadError(f"{source} is missing: not a complete torch.distributed."
                                  "checkpoint folder (was the save interrupted?)") from exc
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as exc:
        raise CheckpointReadError(f"{source} cannot be read ({type(exc).__name__}: {exc}); the "
                                  "checkpoint is truncated or corrupt") from exc
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not DCP "
                                    "metadata; refused to load it")
    return metadata


def check_shards(folder: str | os.PathLike, metadata: Any) -> None:
    """Every data file the metadata points into exists and is long enough (a truncated shard,
    e.g. a copy cut short, fails here with its name instead of deep inside ``torch.load``).

    Raises:
        CheckpointReadError: a shard is missing or shorter than its entries' ``offset + length``.
    """
    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if isinstance(rel, str):
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        file = os.path.join(folder, rel)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated ({have:,} of {size:,} bytes)"
            raise CheckpointReadError(f"{file} {what}; the checkpoint is damaged: use an older "
                                      "one (checkpoint.resume=PATH) or copy it again")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allow-list and whose shards are
    checked against it (:func:`check_shards`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self.fs.concat_path(self.path, ".metadata")
        metadata = load_metadata(path, self.fs)
        check_shards(str(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Reads non-tensor entries with ``torch.load(weights_only=True)`` (torch's own allow-list)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element as set_path

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            if "global" not in str(exc).lower():  # damaged bytes ("Unsupported operand"), no class
                raise CheckpointReadError(f"entry {read_item.dest_index.fqn!r} is corrupt "
                                          f"({exc}); use an older checkpoint") from exc
            raise UnsafeCheckpointError(
                f"entry {read_item.dest_index.fqn!r} is not plain data; refused to load it "
                "(unpickling it could run code)") from exc
        if self.flatten_state_dict:
            set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict, path: str) -> None:
    """``dcp.load(state, ...)`` with :class:`SafeReader` and :class:`SafeLoadPlanner`.

    Raises:
        UnsafeCheckpointError: the metadata or a non-tensor entry refers to code outside the
            allow-lists (nothing of it is run); the message names the file or entry.
        CheckpointReadError: ``.metadata`` is missing, truncated or corrupt.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeReader(path)
    reader.read_metadata()  # fail here, with our own error, before DCP wraps it
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (UnsafeCheckpointError, CheckpointReadError) as exc:
        raise type(exc)(f"{path}: {exc}") from exc
    except CheckpointException as exc:
        text = str(exc)
        if "is corrupt (" in text:
            raise CheckpointReadError(f"{path}: a non-tensor entry of the checkpoint is corrupt; "
                                      "use an older checkpoint or copy it again") from exc
        if "refused to load" in text or "Weights only load failed" in text or "Unsupported global" in text:
            raise UnsafeCheckpointError(
                f"{path}: a non-tensor entry of the checkpoint is not plain data; refused to "
                "load it (unpickling it could run code)") from exc
        if any(w in text for w in _CORRUPT):  # bytes changed in place: sizes fit, content not
            raise CheckpointReadError(f"{path}: a data file of the checkpoint is corrupt "
                                      f"({text.strip().splitlines()[-1][:200]}); use an older "
                                      "checkpoint or copy it again") from exc
        raise


# what torch.load / zipfile / pickle say about damaged bytes (shape errors say none of these)
_CORRUPT = ("PytorchStreamReader failed", "corrupted", "invalid load key", "unexpected EOF",
            "Ran out of input", "CRC", "truncated")
