"""Muon for the hidden matrices, AdamW for the rest, as one optimizer (``optimizer.name: muon``).

Muon (Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
https://kellerjordan.github.io/posts/muon/) replaces a matrix's momentum by its nearest
semi-orthogonal matrix, computed with a quintic Newton-Schulz iteration. Following Liu et al.,
"Muon is Scalable for LLM Training" (Moonlight, 2025, arXiv:2502.16982, section 2.2), the update of
an ``A x B`` matrix is scaled by ``0.2 * sqrt(max(A, B))`` so that its RMS matches AdamW's (about
0.2), which lets Muon reuse AdamW's learning rate and weight decay; that is torch's
``adjust_lr_fn="match_rms_adamw"``.

Which parameters: the 2-D weights inside the model's repeated blocks (``model.blocks()``: attention
and MLP projections) go to Muon; embeddings, the output projection, norms and biases go to AdamW
(Moonlight and Keller Jordan do the same: the input/output layers are not "hidden"). A block's
parameter with more than two dimensions is a stack of matrices on its leading dimensions (a
mixture of experts' ``[E, out, in]`` weights, the spec's ``experts`` contract, and their low-rank
adapters): each matrix takes Muon on its own (a batched Newton-Schulz over the stack, as the
3-D-aware Muon implementations do, e.g. Dion's and Moonlight's for MoE experts), with the scale
of its own ``out x in`` shape. Expert parallelism and FSDP2 shard such a stack on dim 0 only, so a
rank's local shard holds whole matrices and orthogonalizes them without any communication.

Plain tensors (one process, DDP) are stepped by ``torch.optim.Muon`` and ``torch.optim.AdamW``
themselves when the orthogonalization runs in bf16 (torch.optim.Muon's only dtype). In float32
(``optimizer.muon_ns_dtype``; the default of fp32 runs) every Muon matrix takes
:meth:`MuonAdamW._own_muon_step`, the same update with a float32 Newton-Schulz: bf16 rounds the
iteration's products to 8 bits, so layouts whose gradients differ by reduction order (~1e-7, tensor
parallel) flip roundings and drift apart by ~3e-5 in the loss within 6 steps; float32 keeps them
within 1e-6. What torch.optim.Muon lacks is sharded parameters: under FSDP2 or tensor parallel a
matrix is a DTensor whose local shard is not a matrix one can orthogonalize, so
:meth:`MuonAdamW._own_muon_step` gathers the full momentum, orthogonalizes it and keeps the
local shard. On a one-dimensional mesh the matrices are dealt round-robin over the ranks: each rank
orthogonalizes only its share and broadcasts the result (the Dion / DistMuon idea; the all-gather
plus broadcast moves about twice the bytes of a gather-to-owner plus scatter, which a later version
can save).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

# Keller Jordan's quintic coefficients (torch.optim.Muon's defaults)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients: Sequence[float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Approximate ``U V^T`` of ``g = U S V^T`` by a quintic Newton-Schulz iteration.

    The same arithmetic as torch.optim.Muon (bf16, the wide side last, ``addmm`` in the same
    order), so a sharded step gives what one process gives. Source: Keller Jordan's Muon
    (https://github.com/KellerJordan/Muon, ``zeropower_via_newtonschulz5``).

    Args:
        g: ``(A, B)`` matrix, or a stack ``(..., A, B)`` of them, each orthogonalized on its own
            (batched matmuls; each matrix scaled by its own norm). A plain tensor: gather a
            DTensor first, or pass a stack's local shard of whole matrices.
        steps: iterations (5 in the sources).
        coefficients: ``(a, b, c)`` of ``X <- a X + (b M + c M^2) X`` with ``M = X X^T``.
        eps: floor of the Frobenius norm used to scale ``g`` into the iteration's domain.
        dtype: compute dtype (bf16 as in the sources; float32 for reference checks).

    Returns:
        A tensor of ``g``'s shape in ``dtype`` whose matrices have singular values near 1
        (roughly in [0.7, 1.2]).

    Raises:
        ValueError: ``g`` has fewer than 2 dimensions.
    """
    if g.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:  # iterate on the (short x long) side: the Gram matrix is the smaller one
        x = x.mT
    if g.ndim == 2:
        x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
        return x.T if tall else x
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])  # one batch dimension for baddbmm
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.reshape(shape)
    return x.mT if tall else x


def match_rms_adamw_scale(shape: Sequence[int]) -> float:
    """Moonlight's update scale ``0.2 * sqrt(max(A, B))`` for an ``A x B`` matrix, or for each
    matrix of a ``(..., A, B)`` stack (Liu et al. 2025, eq. 4): an orthogonal update has RMS
    ``1/sqrt(max(A, B))``, AdamW's is about 0.2."""
    return 0.2 * max(shape[-2], shape[-1]) ** 0.5


def split_matrices(p: torch.Tensor) -> Optional[str]:
    """Why Muon cannot orthogonalize the stack ``p`` (``ndim >= 3``) shard by shard, or None:
    a DTensor placement that shards one of the two matrix dimensions (expert tensor
    parallelism) leaves no whole matrix on a rank."""
    if not isinstance(p, DTensor):
        return None
    for placement in p.placements:
        dim = getattr(placement, "dim", None)
        if dim is not None and dim % p.ndim >= p.ndim - 2:
            return f"its placements {tuple(p.placements)} split the matrices (dim {dim % p.ndim})"
    return None


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two kinds of parameter groups: Muon groups and AdamW groups.

    Each group keeps its own ``lr`` (the schedule scales every group's by the same factor) and
    ``weight_decay``. The state dict is an ordinary ``torch.optim.Optimizer`` state dict (Muon
    groups hold ``momentum_buffer``, AdamW groups ``step``, ``exp_avg``, ``exp_avg_sq``), so
    torch.distributed.checkpoint saves and reshards it like AdamW's.

    Args:
        muon_groups: param groups (dicts with ``params``, ``lr``, ``weight_decay``, ``name``): a
            group of 2-D tensors, or a group of stacks of matrices (``ndim >= 3``, e.g. experts
            ``[E, out, in]``; each matrix orthogonalized on its own, always by
            :meth:`_own_muon_step`: torch.optim.Muon takes 2-D tensors only). The groups of
            2-D tensors come first in ``param_groups``, then the stacks', then AdamW's.
        adamw_groups: param groups for AdamW.
        momentum, nesterov, ns_steps: Muon's settings (torch.optim.Muon's meaning).
        ns_dtype: Newton-Schulz compute dtype, ``torch.bfloat16`` (torch.optim.Muon's) or
            ``torch.float32`` (layout-independent to ~1e-6; what fp32 runs use).
        betas, eps: AdamW's settings.

    Raises:
        ValueError: a Muon parameter has fewer than 2 dimensions, a group mixes matrices and
            stacks, a stack is sharded across one of its matrix dimensions
            (:func:`split_matrices`), or both group lists are empty.
    """

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]], *,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 ns_dtype: torch.dtype = torch.bfloat16) -> None:
        if not muon_groups and not adamw_groups:
            raise ValueError("MuonAdamW: no parameter to optimize")
        # the inner optimizers own the update rules; this one owns the groups (the same dict
        # objects, so the schedule's lr changes reach both) and the state; stacks of matrices
        # have no inner optimizer (None): this one steps them
        flat, stacks = [], []
        for g in muon_groups:
            dims = {p.ndim > 2 for p in g["params"]}
            if len(dims) > 1 or any(p.ndim < 2 for p in g["params"]):
                raise ValueError(f"MuonAdamW: group '{g.get('name')}' needs only matrices or only stacks "
                                 f"of matrices, got shapes {[tuple(p.shape) for p in g['params']]}")
            for p in g["params"]:
                why = split_matrices(p) if p.ndim > 2 else None
                if why:
                    raise ValueError(f"MuonAdamW: cannot orthogonalize a {tuple(p.shape)} stack: {why}")
            (stacks if dims == {True} else flat).append(g)
        for g in stacks:  # torch.optim.Muon's defaults, which its own groups get from it
            g.update({k: v for k, v in dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                            ns_coefficients=NS_COEFFICIENTS, eps=1e-7,
                                            adjust_lr_fn="match_rms_adamw").items() if k not in g})
        self._inner: list[tuple[Optional[torch.optim.Optimizer], int]] = []
        ordered: list[dict[str, Any]] = []
        if flat:
            muon = torch.optim.Muon(flat, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                    adjust_lr_fn="match_rms_adamw")
            self._inner.append((muon, len(flat)))
            ordered += muon.param_groups
        if stacks:
            self._inner.append((None, len(stacks)))
            ordered += stacks
        if adamw_groups:
            adamw = torch.optim.AdamW(adamw_groups, betas=betas, eps=eps)
            self._inner.append((adamw, len(adamw_groups)))
            ordered += adamw.param_groups
        super().__init__(ordered, {})
        self.ns_dtype = ns_dtype
        self._bind()

    def _bind(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after a load, which
        replaces both objects)."""
        i = 0
        for opt, n in self._inner:
            if opt is not None:
                opt.param_groups = self.param_groups[i:i + n]
                opt.state = self.state
            i += n

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._bind()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Optional[torch.Tensor]:
        """Muon step on the Muon groups, AdamW step on the others; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        i = 0
        for opt, n in self._inner:
            groups = self.param_groups[i:i + n]
            i += n
            if opt is None or (isinstance(opt, torch.optim.Muon) and (self.ns_dtype != torch.bfloat16 or any(
                    isinstance(p, DTensor) for g in groups for p in g["params"]))):
                for group in groups:
                    self._own_muon_step(group)
            else:
                opt.step()
        return loss

    def _own_muon_step(self, group: dict[str, Any]) -> None:
        """torch.optim.Muon's update (same order of operations) in ``self.ns_dtype``, for plain
        tensors and DTensor matrices (FSDP2 and/or TP shards).

        For a DTensor the momentum is elementwise, so it stays on the local shards; the
        Newton-Schulz input is the full matrix (an all-gather), and each rank keeps its shard of
        the result. On a 1-D mesh, matrix ``i`` is orthogonalized by mesh rank ``i % size`` and
        broadcast from it. A stack of matrices (``ndim >= 3``, sharded on its leading dims only)
        is orthogonalized matrix by matrix on each rank's local shard, without communication.
        """
        lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
        params = [p for p in group["params"] if p.grad is not None]
        for i, p in enumerate(params):
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - mom)
            update = grad.lerp(buf, mom) if group["nesterov"] else buf
            if not isinstance(update, DTensor):
                local = newton_schulz(update, group["ns_steps"], group["ns_coefficients"], group["eps"],
                                      self.ns_dtype)
            elif p.ndim > 2:  # whole matrices on every rank (checked at construction)
                ortho = newton_schulz(update.to_local(), group["ns_steps"], group["ns_coefficients"],
                                      group["eps"], self.ns_dtype)
                local = DTensor.from_local(ortho, update.device_mesh, update.placements, run_check=False,
                                           shape=update.shape, stride=update.stride())
            else:
                local = self._sharded_ortho(update, p, i, group)
            p.mul_(1 - lr * wd)
            p.add_(local.to(p.dtype), alpha=-lr * match_rms_adamw_scale(p.shape))

    def _sharded_ortho(self, update: DTensor, p: DTensor, i: int, group: dict[str, Any]) -> DTensor:
        """The orthogonalized full matrix of ``update`` as ``p``'s local shards (``i``: the
        matrix's index in its group, which picks its owner rank on a 1-D mesh)."""
        full = update.full_tensor()
        mesh = p.device_mesh
        if mesh.ndim == 1 and mesh.size() > 1:
            owner = i % mesh.size()
            if mesh.get_local_rank() == owner:  # contiguous: a tall matrix's result is a
                # transposed view, and a collective sends the storage as it lies
                ortho = newton_schulz(full, group["ns_steps"], group["ns_coefficients"],
                                      group["eps"], self.ns_dtype).contiguous()
            else:
                ortho = torch.empty(full.shape, dtype=self.ns_dtype, device=full.device)
            pg = mesh.get_group()
            dist.broadcast(ortho, src=dist.get_global_rank(pg, owner), group=pg)
        else:  # a multi-dimensional mesh: every rank orthogonalizes every matrix
            ortho = newton_schulz(full, group["ns_steps"], group["ns_coefficients"], group["eps"],
                                  self.ns_dtype)
        return distribute_tensor(ortho, mesh, p.placements, src_data_rank=None)
