"""Reading a Hugging Face folder's weights back, shared by the families' parity tests."""

from __future__ import annotations


def safetensors_of(folder):
    """Every tensor of every ``*.safetensors`` file in ``folder`` (sharded exports too), by key."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
