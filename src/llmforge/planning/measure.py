"""What the simulation measures, beside the memory tracker: collective payloads per mesh dim
(:class:`ByteCounter`), the step's peak per phase (:class:`PhasePeaks`), the split of a tracker
snapshot into the five reported categories, and the FLOP formulas of the CPU attention kernel."""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _RefType, _UpdateType, _WeakRefInfo
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

# FlopCounterMode has formulas for the GPU attention kernels only: the CPU one does the same work
CPU_SDPA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v)}



class _NoModules:
    """Stands in for ``FlopCounterMode``'s module tracker: the step's total is all we read."""

    parents = frozenset({"Global"})

    def __enter__(self) -> "_NoModules":
        return self

    def __exit__(self, *args: Any) -> None:
        return None


class StepFlopCounter(FlopCounterMode):
    """``FlopCounterMode`` (with :data:`CPU_SDPA_FLOPS`) that counts the total only.

    Its module tracker hooks every module's outputs with ``register_multi_grad_hook``, even in
    the recompute forward that activation checkpointing runs inside backward; each such hook
    is a reference cycle through the recomputed graph, which then holds the recomputed
    activations until Python's garbage collector runs. The memory tracker counted them, so the
    measured backward peak grew by a block's activations per block and changed with gc timing.
    """

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=CPU_SDPA_FLOPS)
        self.mod_tracker = _NoModules()


CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")

# the trackers' reference types -> the five categories of the report
_CATEGORY_OF = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters",
    "Buffer": "parameters", "Gradient": "gradients", "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients", "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Temp": "temporaries", "All Gather": "temporaries",
    "Reduce Scatter": "temporaries", "Inputs": "temporaries", "Other": "temporaries",
}


_SHARDED = {"Sharded Param", "Sharded Grad", "OptState", "Optstate", "Parameter", "Gradient"}


class _NoHook:
    def remove(self) -> None:
        pass


class _EveryStorage:
    """Track every storage of a tensor: torch 2.13's ``MemTracker._track`` returns at the first
    storage of a tensor it already tracks, inside its loop over the *set* of the tensor's
    storages, so a wrapper subclass's new storage went uncounted whenever the set, ordered by
    the storages' addresses, yielded an old one first (a float8 tensor's fresh data behind its
    tracked scale): the simulated peak of float8 TP changed from one process to the next and
    not with address randomization off. This loop skips the tracked storage and goes on."""

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        for st in get_untyped_storages(t):
            winfo, _ = self._WINFO.get(st, (None, None))
            if winfo is not None:
                if winfo.size != st.size():
                    old_mem_consumed = winfo.mem_consumed
                    winfo.update_mem_consumed(st)
                    self._update_snap(_UpdateType.SIZE, winfo, old_mem_consumed=old_mem_consumed)
                continue
            winfo, w_st = _WeakRefInfo.create_winfo(st, t.device, reftype, self._delete_callback)
            self._WINFO[st] = (winfo, w_st)
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.ADD, winfo)


class _ActivePeaks:
    """The tracker's peaks updated from the modules that are running: torch 2.13's
    ``MemTracker._update_peak_stats`` walks the stats of every module it has seen (a weak
    dictionary: a dereference and a ``hasattr`` per module) after every operator, to find the few
    whose forward or backward is under way; that walk was a quarter of a plan's time. Here the
    stats are indexed by name once per change of the dictionary, and the update is torch's."""

    _by_fqn: dict
    _indexed: Optional[int] = None  # the dictionary's size when indexed; None: index again

    def _running_stats(self) -> list:
        tracked = self.memory_tracking  # entries are only added, collected, or all cleared
        if len(tracked) != self._indexed:
            self._by_fqn = defaultdict(list)
            for stats in tracked.values():
                self._by_fqn[stats.mod_fqn].append(stats)
            self._indexed = len(tracked)
        return [s for fqn in self._mod_tracker.parents for s in self._by_fqn.get(fqn, ())]

    def reset_mod_stats(self) -> None:
        self._indexed = None  # cleared, then refilled to the same size with new stats
        super().reset_mod_stats()

    def _update_peak_stats(self, peak_state: Any) -> None:
        snap = self._curr_mem_snap
        for stats in self._running_stats():
            if peak_state in stats.snapshots:
                for dev, dev_snap in snap.items():
                    if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                        stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                        stats.snapshots[peak_state][-1][dev] = copy.deepcopy(dev_snap)
        for dev, dev_snap in snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)


class StepFSDPMemTracker(_ActivePeaks, _EveryStorage, FSDPMemTracker):
    """torch's ``FSDPMemTracker`` counting every storage of a tensor (:class:`_EveryStorage`),
    its peaks updated from the running modules only (:class:`_ActivePeaks`)."""


class FrozenSafeMemTracker(_ActivePeaks, _EveryStorage, MemTracker):
    """``MemTracker`` for models with frozen weights (e.g. adapters on a frozen base): torch
    2.13's tracker registers a gradient hook on every parameter of a module it enters, which
    raises on a parameter that does not require grad. Frozen parameters are counted as
    parameters and get no hook (they get no gradient either)."""

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True
                                         ) -> tuple[int, int]:
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


@dataclass
class Collective:
    """Payload of one kind of collective on one mesh dim over one step.

    ``bytes``: summed tensor bytes (the unsharded size for all-gather and reduce-scatter);
    ``group_size``: ranks in the group."""

    kind: str
    mesh_dim: str
    group_size: int
    count: int = 0
    bytes: float = 0.0


class ByteCounter(TorchDispatchMode):
    """Counts every collective and sums its payload bytes per process group.

    It sees the same ops as ``CommDebugMode`` (the c10d and functional collectives, after
    DTensor has turned its redistributions into them) but keeps no module tracker: in torch
    2.13 CommDebugMode's tracker fails (``IndexError`` in ``ModuleTracker``) when activation
    checkpointing recomputes a tensor-parallel block in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.payload: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower itself into collectives first
        out = func(*args, **(kwargs or {}))
        if isinstance(func, torch._ops.HigherOrderOperator):
            return out
        name = func._overloadpacket.__name__
        kind = next((k for k in ("all_gather", "allgather", "reduce_scatter", "allreduce",
                                 "all_reduce", "all_to_all", "alltoall", "broadcast") if k in name), None)
        if kind is None or func.namespace not in ("c10d", "_c10d_functional"):
            return out
        kind = {"allgather": "all_gather", "allreduce": "all_reduce", "alltoall": "all_to_all"}.get(kind, kind)
        group = None
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, str):
                group = a
            elif isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):  # a c10d op's group
                group = dist.ProcessGroup.unbox(a).group_name
        outs = [t for t in _flat(out) if isinstance(t, torch.Tensor)]
        ins = [t for t in _flat(args) if isinstance(t, torch.Tensor)]
        # the unsharded size: an all-gather's output, a reduce-scatter's input
        sizes = [t.numel() * t.element_size() for t in (outs if kind == "all_gather" else ins)]
        rec = self.payload[(kind, str(group))]
        rec[0] += 1
        rec[1] += float(max(sizes)) if sizes else 0.0
        return out


class MicroBatchCounts:
    """An event plugin: the FLOP and collective totals at the end of the first three
    micro-batches' backward, so that the third micro-batch's share (a middle one's) is the
    difference of the last two."""

    def __init__(self, flops: StepFlopCounter, comm: ByteCounter) -> None:
        self.flops, self.comm = flops, comm
        self.after: list[tuple[float, dict]] = []

    def after_backward(self, state: Any) -> None:
        if len(self.after) < 3:
            self.after.append((float(self.flops.get_total_flops()),
                               {k: tuple(v) for k, v in self.comm.payload.items()}))

    def add_middle(self, times: int) -> float:
        """Add ``times`` middle micro-batches to the byte counter; returns the step's FLOPs
        with them."""
        (f0, p0), (f1, p1) = self.after[1], self.after[2]
        for key, (count, nbytes) in p1.items():
            c0, b0 = p0.get(key, (0, 0.0))
            rec = self.comm.payload[key]
            rec[0] += times * (count - c0)
            rec[1] += times * (nbytes - b0)
        return float(self.flops.get_total_flops()) + times * (f1 - f0)


class PhasePeaks:
    """An event plugin (:mod:`llmforge.events`) that splits the step's peak by phase: at the end
    of each forward, loss and backward it folds the tracker's peak since the last phase into
    that phase's maximum and starts a new one. The depth extrapolation is done per phase, since
    each phase's peak is affine in the block count while the phase holding the overall peak may
    change with depth. (The tracker's global peak has no public reset in torch 2.13: its two
    private fields are cleared.)

    ``blocks`` (the model's repeated blocks, in order): ``block_backward[i]`` is the peak while
    block ``i`` ran its backward, over all micro-batches (the tracker's per-module
    ``Peak-Backward`` snapshots), for :func:`llmforge.planning.depth.simulate_scaled`."""

    def __init__(self, tracker: Any, blocks: Sequence[Any] = ()) -> None:
        self.tracker = tracker
        self.active = False  # set by start(): the warm-up step is not recorded
        self.peaks: dict[str, tuple[float, dict[str, float], float]] = {}
        self.blocks = list(blocks)
        self.block_backward: list[Optional[tuple[float, dict[str, float], float]]] = [None] * len(self.blocks)

    def start(self) -> None:
        self.active = True
        self._reset()

    def _reset(self) -> None:  # the current state is the new peak
        t = self.tracker
        t._peak_mem_snap = copy.deepcopy(t._curr_mem_snap)
        t._peak_mem = {dev: snap["Total"] for dev, snap in t._curr_mem_snap.items()}

    def record(self, phase: str) -> None:
        if not self.active:
            return
        snap = self.tracker.get_tracker_snapshot("peak")
        summary = summarize(next(iter(snap.values())) if snap else {"Total": 0})
        if phase not in self.peaks or summary[0] > self.peaks[phase][0]:
            self.peaks[phase] = summary
        self._reset()

    def after_forward(self, state: Any) -> None:
        self.record("forward")

    def after_loss(self, state: Any) -> None:
        self.record("loss")

    def _record_blocks(self) -> None:
        for i, block in enumerate(self.blocks):
            stats = self.tracker.memory_tracking.get(block)
            # MemTracker's _ModState and FSDPMemTracker's _FSDPModState both name it PEAK_BW
            peaks = [v for k, v in stats.snapshots.items() if k.name == "PEAK_BW"] if stats else []
            for snap in (s for snaps in peaks for s in snaps):
                if snap:
                    summary = summarize(next(iter(snap.values())))
                    if self.block_backward[i] is None or summary[0] > self.block_backward[i][0]:
                        self.block_backward[i] = summary

    def after_backward(self, state: Any) -> None:
        self.record("backward")
        if self.active:
            self._record_blocks()
        if not isinstance(self.tracker, FSDPMemTracker):
            # without FSDP2: torch's MemTracker refuses a second call of the root module in
            # one step; its module stats (not the memory it counts) start again each micro-batch
            self.tracker.reset_mod_stats()


def summarize(snap: dict) -> tuple[float, dict[str, float], float]:
    """``(total, breakdown by CATEGORIES, sharded state)`` of one tracker snapshot."""
    breakdown = dict.fromkeys(CATEGORIES, 0.0)
    sharded = 0.0
    for ref, nbytes in snap.items():
        key = getattr(ref, "value", ref)
        if key != "Total":
            breakdown[_CATEGORY_OF.get(key, "temporaries")] += float(nbytes)
        if key in _SHARDED:
            sharded += float(nbytes)
    return float(snap.get("Total", 0)), breakdown, sharded


def _flat(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    return [x]


def collectives(comm: ByteCounter, mesh: Any) -> list[Collective]:
    names: dict[str, tuple[str, int]] = {}
    if mesh is not None:
        # dims of one rank set share a group: the first name wins (FSDP2's dp_shard before the
        # flattened dp); with context parallelism FSDP2's dp_shard_cp and the attention's cp (one
        # group where dp_shard is 1: FSDP2's name, as its traffic is most of it)
        for dim in ("dp_shard", "dp_replicate", "tp", "dp_shard_cp", "cp", "dp", "dp_cp"):
            try:
                sub = mesh[dim]
            except (KeyError, RuntimeError, ValueError):  # not a dim of this layout's mesh
                continue
            names.setdefault(sub.get_group().group_name, (dim, sub.size()))
    out = []
    for (kind, group), (count, nbytes) in sorted(comm.payload.items()):
        if group not in names:  # a group DTensor or FSDP made for a concatenation of dims
            ranks = sorted(dist.get_process_group_ranks(_c10d._resolve_process_group(group)))
            names[group] = (_dim_of(mesh, ranks), len(ranks))
        dim, size = names[group]
        out.append(Collective(kind=kind, mesh_dim=dim, group_size=size, count=count, bytes=nbytes))
    return out


def _dim_of(mesh: Any, ranks: list) -> str:
    """The mesh dims (joined by ``+``) whose group through rank 0 holds exactly ``ranks``."""
    dims = [d for d in ("dp_replicate", "dp_shard", "tp") if mesh[d].size() > 1]
    for n in range(len(dims), 0, -1):
        for i in range(len(dims) - n + 1):
            sub = mesh[tuple(dims[i:i + n])] if n > 1 else mesh[dims[i]]
            if sorted(sub.mesh.flatten().tolist()) == ranks:
                return "+".join(dims[i:i + n])
    return "world"
