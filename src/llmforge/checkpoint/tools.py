"""``llmforge checkpoint inspect PATH`` and ``llmforge checkpoint consolidate PATH OUT``.

Both read DCP's metadata and files directly, without building the model: ``inspect`` lists
step, tokens, world size, mesh and every tensor (shape, dtype, bytes); ``consolidate`` gathers
the model's tensors into one safetensors file for inference (keys without the ``model.``
prefix, full unsharded shapes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmforge.checkpoint.dcp import read_json
from llmforge.checkpoint.layout import COMPLETE, latest_checkpoint
from llmforge.checkpoint.safe_load import SafeReader, safe_load
from llmforge.errors import ConfigError
from llmforge.paths import all_or_nothing, resolve_dotdot


def resolve(path: str | Path) -> Path:
    """A complete checkpoint folder, or the newest one of a run directory.

    Raises:
        ConfigError: neither exists.
    """
    p = Path(path)
    if (p / COMPLETE).exists():
        return p
    for root in (p / "checkpoints", p):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    if p.name.startswith(".tmp-") or (p / ".metadata").exists():
        raise ConfigError(f"{p}: an incomplete checkpoint (no {COMPLETE} marker); it is never loaded")
    raise ConfigError(f"{p}: not a checkpoint or a run directory with a complete checkpoint")


def tensor_entries(ckpt: Path) -> dict[str, Any]:
    """``{key: TensorStorageMetadata}`` from the DCP metadata (keys like ``model.norm.weight``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = SafeReader(str(ckpt)).read_metadata()
    return {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _nbytes(md: Any) -> int:
    return int(torch.Size(md.size).numel()) * torch.empty((), dtype=md.properties.dtype).element_size()


def inspect_checkpoint(path: str | Path) -> str:
    """A human-readable summary of a checkpoint."""
    ckpt = resolve(path)
    meta = read_json(ckpt, "meta.json")
    entries = tensor_entries(ckpt)
    lines = [f"checkpoint   {ckpt}",
             f"step         {meta.get('step')}",
             f"tokens       {meta.get('tokens_seen', 0):,}",
             f"world size   {meta.get('world_size')} (mesh {meta.get('mesh')})",
             f"llmforge     {meta.get('llmforge_version')}  config hash {meta.get('config_hash')}",
             ""]
    groups: dict[str, list[int]] = {}
    for key, md in sorted(entries.items()):
        groups.setdefault(key.split(".", 1)[0], []).append(_nbytes(md))
    for group, sizes in groups.items():
        lines.append(f"{group:12s} {len(sizes)} tensors, {sum(sizes) / 2**20:,.1f} MiB")
    lines.append("")
    for key, md in sorted(entries.items()):
        if key.startswith("model."):
            lines.append(f"  {key[6:]:48s} {str(tuple(md.size)):20s} {str(md.properties.dtype)[6:]}")
    return "\n".join(lines)


def consolidate(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the model's full tensors to one safetensors file; returns its path. ``out``: the
    ``.safetensors`` file, or a folder (``model.safetensors`` in it).

    Raises:
        ConfigError: the file exists and ``overwrite`` is false (checked before the checkpoint
            is read).
        WriteError: the file could not be written (e.g. a full disk); no part of it is left."""
    from safetensors.torch import save_file

    target = resolve_dotdot(out)  # 'new/../m.safetensors' without new/: the file 'm.safetensors'
    file = target if target.suffix == ".safetensors" else target / "model.safetensors"
    if file.exists() and not overwrite:
        raise ConfigError(f"{file} already exists; choose another file or pass --overwrite to replace it")
    ckpt = resolve(path)
    entries = {k: v for k, v in tensor_entries(ckpt).items() if k.startswith("model.")}
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in entries.items()}
    safe_load(state, str(ckpt))
    meta = read_json(ckpt, "meta.json")
    with all_or_nothing(target):
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file({k[6:]: v.contiguous() for k, v in state.items()}, str(file),
                  metadata={"step": str(meta.get("step")), "source": str(ckpt)})
    return file
