"""What every built-in decoder family shares (Llama 3, Qwen3): the tied output projection, the
repeated blocks, parameter and FLOP counts. A mixin over ``nn.Module`` for models with
``args`` (``tie_embeddings``, ``n_layers``, ``n_heads``, ``head_dim``), ``tok_embeddings``,
``layers`` and ``output``; no ranks, no trainer."""

from __future__ import annotations

from torch import nn

__all__ = ["DecoderLM"]


class DecoderLM:
    """Mixin: ``class MyModel(DecoderLM, nn.Module)``.

    Tied embeddings: ``output.weight`` *is* ``tok_embeddings.weight`` (one Parameter). Module
    conversions such as ``to_empty`` from the meta device create new Parameter objects per module
    and would break the tie, so :meth:`_apply` (behind ``to``/``to_empty``/``cuda``) re-ties; the
    model's ``init_weights`` calls :meth:`_tie` too. The state dict holds both keys (one tensor).
    """

    def _tie(self) -> None:
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self._tie()
        return out

    def blocks(self) -> list[nn.Module]:
        """The repeated transformer blocks (units for FSDP2, activation checkpointing, compile)."""
        return list(self.layers)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, each shared Parameter counted once (tied weights once).

        ``exclude_embeddings``: leave out ``tok_embeddings.weight`` (a lookup table, not a
        matmul). For a tied model this also removes the output projection, as it is the same
        tensor. Global counts for DTensor (sharded) parameters.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for MFU.

        ``6 * N + 12 * L * H * hd * seq_len`` — PaLM (Chowdhery et al. 2022), appendix B, as
        in torchtitan's ``get_num_flop_per_token``/``get_nparams_and_flops``: ``6N`` counts the
        matmuls over the ``N`` parameters (2 FLOPs per multiply-add, x3 for forward + backward);
        the second term counts the attention score/value matmuls over a ``seq_len`` context
        (2 matmuls forward + 4 backward, 2 FLOPs each; no discount for the causal mask and no
        recompute). ``N`` = all parameters except the input embedding table (torchtitan's
        choice). Unlike torchtitan, a *tied* output projection is counted in ``N`` (it is
        still a matmul); for untied models the result equals torchtitan's.
        """
        n = self.num_params(exclude_embeddings=True)
        if self.args.tie_embeddings:
            n += self.output.weight.numel()
        a = self.args
        return float(6 * n + 12 * a.n_layers * a.n_heads * a.head_dim * int(seq_len))
