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

import dataclasses
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.futures import Future

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.paths import is_special_file

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


def check_regular(path: str | os.PathLike) -> None:
    """A checkpoint file that exists must be a regular file (or a link to one): opening a named
    pipe blocks for ever, a device reads without end.

    Raises:
        CheckpointReadError: naming the file.
    """
    if is_special_file(path):
        raise CheckpointReadError(f"{path} is not a regular file (a named pipe, device or folder); "
                                  "the checkpoint is damaged: use an older one (checkpoint.resume=PATH)")


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
    check_regular(source)
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
            IndexError, KeyError, OverflowError) as exc:
        raise CheckpointReadError(f"{source} cannot be read ({type(exc).__name__}: {exc}); the "
                                  "checkpoint is truncated or corrupt") from exc
    except (MemoryError, RecursionError) as exc:  # a damaged length or nesting in the pickle
        raise CheckpointReadError(f"{source} cannot be read ({type(exc).__name__}: it asks for more "
                                  "memory or nesting than any checkpoint's metadata); the checkpoint "
                                  "is corrupt") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not DCP "
                                    "metadata; refused to load it")
    return metadata


def check_shards(folder: str | os.PathLike, metadata: Any) -> None:
    """Every data file the metadata points into lies inside ``folder``, exists and is long enough
    (a truncated shard, e.g. a copy cut short, fails here with its name instead of deep inside
    ``torch.load``), and no tensor claims more bytes than its shards hold (a damaged size would
    have the loader allocate them). Storage paths are normalized to plain strings in place, so
    DCP reads exactly the files checked here.

    Raises:
        CheckpointReadError: a storage path that is not a relative path inside ``folder``; a
            shard that is missing or shorter than its entries' ``offset + length``; a tensor
            larger than its stored bytes.
    """
    source = os.path.join(folder, ".metadata")
    need: dict[str, int] = {}
    stored: dict[str, int] = {}
    transformed: set[str] = set()
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        rel = _inside(folder, getattr(info, "relative_path", None), source)
        info.relative_path = rel
        try:
            offset, length = int(info.offset), int(info.length)
        except (TypeError, ValueError):
            offset = length = -1
        if offset < 0 or length < 0:
            raise CheckpointReadError(f"{source}: the entry of {getattr(index, 'fqn', index)!r} has "
                                      "no valid offset and length; the checkpoint is damaged")
        need[rel] = max(need.get(rel, 0), offset + length)
        fqn = getattr(index, "fqn", None)
        stored[fqn] = stored.get(fqn, 0) + length
        if getattr(info, "transform_descriptors", None):
            transformed.add(fqn)
    for rel, size in sorted(need.items()):
        file = os.path.join(folder, rel)
        _no_link_out(folder, file)
        have = os.path.getsize(file) if os.path.isfile(file) else None
        if have is None or have < size:
            what = "is missing" if have is None else f"is truncated ({have:,} of {size:,} bytes)"
            raise CheckpointReadError(f"{file} {what}; the checkpoint is damaged: use an older "
                                      "one (checkpoint.resume=PATH) or copy it again")
    for fqn, md in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        size = getattr(md, "size", None)
        if size is None:  # bytes entries: their length is checked above
            continue
        need_bytes = _tensor_bytes(md, source, fqn)
        # stored uncompressed (torch.save per chunk); storage transforms (compression) may shrink
        # it, but not by more than this
        limit = stored.get(fqn, 0) * (_MAX_COMPRESSION if fqn in transformed else 1)
        if need_bytes > limit:
            raise CheckpointReadError(
                f"{source}: tensor {fqn!r} claims shape {tuple(size)} ({need_bytes:,} bytes) but its "
                f"shards hold {stored.get(fqn, 0):,} bytes; the metadata is damaged")


_MAX_COMPRESSION = 1000


def _no_link_out(folder: str | os.PathLike, file: str) -> None:
    """``file`` (a path inside ``folder`` by name) also lies inside it once symbolic links are
    resolved: a shard linked to another file would be read, and its size told, as the
    checkpoint's.

    Raises:
        CheckpointReadError: it resolves outside ``folder``."""
    real, root = os.path.realpath(file), os.path.realpath(folder)
    if os.path.commonpath([real, root]) != root:
        raise CheckpointReadError(f"{file} is a symbolic link out of the checkpoint folder {folder}; "
                                  "refused (a checkpoint reads only its own files): copy the file "
                                  "into the folder if it belongs there")


def _inside(folder: str | os.PathLike, rel: Any, source: str) -> str:
    """``rel`` as a plain relative path that stays inside ``folder``.

    Raises:
        CheckpointReadError: not a string or path, absolute, or leading out (``..``)."""
    if isinstance(rel, os.PathLike):
        rel = os.fspath(rel)
    if not isinstance(rel, str) or not rel:
        raise CheckpointReadError(f"{source}: a storage path is {rel!r}, not a file name; the "
                                  "metadata is damaged")
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep) or "\0" in rel:
        raise CheckpointReadError(f"{source}: storage path {rel!r} leads outside the checkpoint "
                                  f"folder {folder}; refused (a checkpoint reads only its own files)")
    return norm


def _tensor_bytes(md: Any, source: str, fqn: str) -> int:
    """The bytes a tensor's metadata asks for (its size times its element size).

    Raises:
        CheckpointReadError: a size that is not a list of non-negative integers."""
    try:
        dims = [int(d) for d in md.size]
        element = torch.empty((), dtype=md.properties.dtype).element_size()
    except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointReadError(f"{source}: tensor {fqn!r} has no valid size and dtype "
                                  f"({exc}); the metadata is damaged") from None
    if any(d < 0 for d in dims):
        raise CheckpointReadError(f"{source}: tensor {fqn!r} has a negative size {tuple(dims)}; the "
                                  "metadata is damaged")
    n = element
    for d in dims:
        n *= d
    return n


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with an allow-list and checked against
    the folder (:func:`check_shards`), and whose read errors name the data file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self.fs.concat_path(self.path, ".metadata")
        _no_link_out(str(self.path), str(path))
        metadata = load_metadata(path, self.fs)
        check_shards(str(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's reads, one data file at a time, so that an error names its file."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            file = os.path.join(str(self.path), rel)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except LLMForgeError as exc:
                raise type(exc)(f"{file}: {exc}") from exc
            except pickle.UnpicklingError as exc:
                if "global" in str(exc).lower():  # torch's weights_only allow-list said no
                    raise UnsafeCheckpointError(
                        f"{file}: a tensor entry is not plain data; refused to load it "
                        "(unpickling it could run code)") from exc
                raise CheckpointReadError(f"{file} is corrupt ({str(exc)[:200]}); the checkpoint "
                                          "is damaged: use an older one or copy it again") from exc
            except Exception as exc:  # torch.load / zipfile / pickle on damaged bytes
                last = (str(exc).strip().splitlines() or [""])[-1][:200]
                raise CheckpointReadError(f"{file} is corrupt ({type(exc).__name__}: {last}); the "
                                          "checkpoint is damaged: use an older one or copy it "
                                          "again") from exc
        fut: Future = Future()
        fut.set_result(None)
        return fut


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


class CheckpointShapeError(LLMForgeError):
    """A checkpoint's tensor has another shape than the model's (another model size or
    architecture). Exit code 2. ``name``, ``saved`` and ``expected`` say which and how."""

    exit_code = 2

    def __init__(self, message: str, name: str = "", saved: tuple = (), expected: tuple = ()) -> None:
        super().__init__(message)
        self.name, self.saved, self.expected = name, saved, expected

    def __reduce__(self) -> Any:  # DCP pickles each rank's error to gather it
        return (type(self), (str(self), self.name, self.saved, self.expected))


def check_shapes(state: dict, metadata: Any, path: str) -> None:
    """Every tensor of ``state`` (``{"model": {name: tensor}, ...}``, one level of sections as
    DCP flattens them) that the checkpoint holds has the checkpoint's shape.

    Raises:
        CheckpointShapeError: the first that differs, with both shapes.
    """
    saved = getattr(metadata, "state_dict_metadata", None) or {}
    for section, entries in state.items():
        if not isinstance(entries, dict):
            continue
        for name, value in entries.items():
            md = saved.get(f"{section}.{name}")
            shape = getattr(md, "size", None)
            if shape is None or not isinstance(value, torch.Tensor):
                continue
            if tuple(shape) != tuple(value.shape):
                raise CheckpointShapeError(
                    f"{path}: parameter {name} has shape {tuple(shape)} in the checkpoint, but this "
                    f"model's is {tuple(value.shape)}; it was saved by a model of another size or "
                    "architecture", name, tuple(shape), tuple(value.shape))


def check_model_shapes(model: Any, path: str) -> None:
    """Before anything is loaded: each model tensor of the checkpoint at ``path`` that ``model``
    (built on the meta device; no weights read) has is of the checkpoint's shape.

    Raises:
        CheckpointShapeError: the first that differs, with both shapes.
        CheckpointReadError: ``.metadata`` is missing or damaged (the file named).
    """
    check_shapes({"model": model.state_dict()}, SafeReader(path).read_metadata(), path)


def resume_shape_error(exc: CheckpointShapeError) -> ConfigError:
    """The error a resume into a model of another shape exits with (exit 2): no setting makes
    those weights load, so it says to go back or start anew."""
    return ConfigError(f"checkpoint.resume: {exc}; resume with the settings it was saved with, or "
                       "start a new run")


def safe_load(state: dict, path: str) -> None:
    """``dcp.load(state, ...)`` with :class:`SafeReader` and :class:`SafeLoadPlanner`.

    Every error is one of llmforge's, naming the file (exit code 2): DCP's own
    ``CheckpointException`` derives from ``BaseException`` and would escape the CLI's handling.

    Raises:
        UnsafeCheckpointError: the metadata or a non-tensor entry refers to code outside the
            allow-lists (nothing of it is run); the message names the file or entry.
        CheckpointReadError: ``.metadata`` or a data file is missing, truncated, corrupt or points
            outside the folder; an entry of ``state`` is not in the checkpoint.
        CheckpointShapeError: a tensor's shape differs from the checkpoint's (names it, both
            shapes).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeReader(path)
    metadata = reader.read_metadata()  # fail here, with our own error, before DCP wraps it
    check_shapes(state, metadata, path)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    except (UnsafeCheckpointError, CheckpointReadError, CheckpointShapeError):
        raise
    except CheckpointException as exc:
        causes = [pair[0] for pair in exc.failures.values() if isinstance(pair, tuple) and pair]
        for cause in causes:
            if isinstance(cause, LLMForgeError):
                raise cause from exc
        text = "\n".join(str(c) for c in causes) or str(exc)
        if "Weights only load failed" in text or "Unsupported global" in text:
            raise UnsafeCheckpointError(
                f"{path}: a non-tensor entry of the checkpoint is not plain data; refused to "
                "load it (unpickling it could run code)") from exc
        last = (text.strip().splitlines() or [type(exc).__name__])[-1][:300]
        raise CheckpointReadError(f"{path}: cannot be loaded into this model ({last}); use a "
                                  "checkpoint saved with the same settings") from exc
