"""Fault-tolerant replica groups on torchft (``fault_tolerance:``; the extra ``llmforge[ft]``).

Each replica group is one ordinary llmforge job. Across groups, :class:`ReplicaGroup` (a
Lightning callback acting on llmforge's events) does what torchft prescribes for one step:

1. ``BATCH_START``: ``Manager.start_quorum()`` (synchronous): the groups alive now form a
   quorum through the lighthouse. A group behind the quorum's step (a restarted one) receives
   the live state of a healthy peer through torchft's checkpoint transport (HTTP) and loads it
   here: weights, optimizer, schedule, step counters, tokens seen, RNG. Its batch is then the
   one of the quorum's step (``batch_for_step``), so its data position follows the step.
2. ``AFTER_BACKWARD`` of the last micro-batch: every gradient is summed over the participating
   groups through torchft's managed process group and divided by their number (one flat
   buffer), before clipping, so each group clips and steps the same averaged gradient. With
   FSDP2 inside a group each rank runs its own Manager and sums its gradients' local shards
   (already reduce-scattered in the group) with the same rank of the other groups: HSDP's
   replicate dimension; a rejoining rank receives its shards from the same rank of a peer.
3. ``BEFORE_OPTIMIZER_STEP`` (after every other handler): ``train/loss`` averaged over the
   participants, then ``Manager.should_commit()``; a step the quorum does not commit (a peer
   died during it, too few replicas, an error) is skipped like any skipped step of llmforge:
   no update, the batch counted as consumed. ``ft/participants`` and ``ft/committed`` go into
   the step's record.

The semantics (global batch while a group is missing, what a rejoined group reads, what is
protected) are in docs/fault_tolerance.md.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
from datetime import timedelta
from typing import Any, Callable, Optional

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from llmforge.errors import ConfigError, LLMForgeError
from llmforge.parallel.lightning_private import optimizer_step_progress

__all__ = ["QuorumLost", "ReplicaGroup", "import_torchft"]


class QuorumLost(LLMForgeError):
    """No quorum of replica groups formed within ``fault_tolerance.quorum_timeout_s`` (the
    process's first: ``first_quorum_timeout_s``; the lighthouse is gone, or fewer than
    ``min_replicas`` groups are alive). Exit code 75 (EX_TEMPFAIL: try again later, e.g. requeue)."""

    exit_code = 75


def _drop_nccl_notice(record: logging.LogRecord) -> bool:
    # torchft warns at every new quorum that NCCL's flight recorder cannot be reset: not a
    # CPU/gloo concern, and noise in every replica group's log
    return "flight recorder" not in record.getMessage()


def import_torchft() -> Any:
    """The ``torchft`` module.

    Raises:
        ConfigError: torchft is not installed (``pip install 'llmforge[ft]'``)."""
    # torchft's Rust side logs every quorum and commit at INFO; warnings and errors still show
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft.manager").addFilter(_drop_nccl_notice)
    try:  # an optional dependency, imported when a run asks for it
        return importlib.import_module("torchft")
    except ImportError as exc:
        raise ConfigError("fault_tolerance.enabled needs torchft: pip install 'llmforge[ft]' "
                          f"(torchft==0.2.0); importing it failed: {exc}") from exc


class ReplicaGroup(Callback):
    """This job's membership in a fault-tolerant run (see the module docstring).

    Args:
        ft: the ``fault_tolerance:`` section (``replica_id``, ``min_replicas``, ``lighthouse``,
            ``timeout_s``, ``quorum_timeout_s``).
        batch_for_step: ``step (1-based) -> batch`` this group reads at that step (its shard of
            the global batch), used after a rejoin, when the loader's own position is behind.
        save: saves a checkpoint of the current step and returns its folder; called before
            :class:`QuorumLost` ends the run.

    Attributes:
        manager: the ``torchft.Manager`` (from fit start).
        rejoined_at: the step a restarted group received from a peer, or ``None``.
    """

    name = "fault_tolerance"
    order = 10_000  # the last BEFORE_OPTIMIZER_STEP handler: the commit sees every skip vote

    def __init__(self, ft: Any, batch_for_step: Callable[[int], Any],
                 save: Optional[Callable[[], Any]] = None) -> None:
        self.ft = ft
        self.batch_for_step = batch_for_step
        self.save = save
        self.manager: Any = None
        self.store: Any = None
        self.module: Any = None
        self.trainer: Any = None
        self.rejoined_at: Optional[int] = None
        self.loader_behind = False  # after a rejoin the loader's batches are not this step's
        self.resumed: Optional[dict[str, int]] = None  # torchft's state from a disk checkpoint
        self.quorums = 0  # formed in this process: the first may wait for groups still starting

    # ---------------------------------------------------------------- set-up
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        torchft = import_torchft()

        ft = self.ft
        self.trainer, self.module = trainer, pl_module
        timeout = timedelta(seconds=float(ft.timeout_s))
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # FSDP2 inside the group: one Manager per rank, on the store of the group's torchrun
            # (MASTER_ADDR/MASTER_PORT); rank r of every group meets in torchft's managed group
            rank, world = dist.get_rank(), dist.get_world_size()
            where: dict[str, Any] = {"store_addr": os.environ["MASTER_ADDR"],
                                     "store_port": int(os.environ["MASTER_PORT"])}
        else:  # one process: its store must exist before its Manager (torchrun would give one)
            rank, world = 0, 1
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timeout)
            where = {"store_addr": "127.0.0.1", "store_port": self.store.port}
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout), load_state_dict=self.load_peer_state,
            state_dict=self.peer_state, min_replica_size=int(ft.min_replicas),
            use_async_quorum=False,  # heal before the forward: the step runs on the peer's state
            timeout=timeout, quorum_timeout=timedelta(seconds=float(ft.quorum_timeout_s)),
            connect_timeout=timeout, rank=rank, world_size=world, **where,
            lighthouse_addr=str(ft.lighthouse),
            replica_id=f"llmforge_{int(ft.replica_id)}",
            init_sync=False)  # every group initializes the same weights from run.seed
        if self.resumed:  # a disk checkpoint loaded at fit start
            self.manager.load_state_dict(self.resumed)

    # torchft's own step (committed steps) travels in llmforge's checkpoints, as torchft asks
    # of periodic checkpoints: groups restarted from disk together then agree on who is behind
    def state_dict(self) -> dict[str, Any]:
        return {"torchft": dict(self.manager.state_dict())} if self.manager is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resumed = state_dict.get("torchft")
        if self.manager is not None and self.resumed:
            self.manager.load_state_dict(self.resumed)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.shutdown()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------- state sent to a peer
    def peer_state(self) -> dict[str, Any]:
        """What a rejoining group receives (references; torchft serves them until the next
        commit): weights, optimizer, schedule, step, tokens seen, RNG."""
        m, t = self.module, self.trainer
        # FSDP2: this rank's shards as plain tensors (a DTensor pickles its mesh); the peer's
        # rank of the same group rank holds the same shards
        return {"model": _local(m.model.state_dict()), "optimizer": _local(t.optimizers[0].state_dict()),
                "scheduler": t.lr_scheduler_configs[0].scheduler.state_dict(),
                "step": int(t.global_step), "tokens_seen": int(m.tokens_seen),
                "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                        "python": random.getstate()}}

    def load_peer_state(self, sd: dict[str, Any]) -> None:
        """Load :meth:`peer_state` of a healthy peer (torchft calls it while healing)."""
        m, t = self.module, self.trainer
        with torch.no_grad():
            for key, value in m.model.state_dict().items():
                _as_local(value).copy_(sd["model"][key])
        optimizer = t.optimizers[0]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.load_state_dict(_sharded_like(sd["optimizer"], params))
        t.lr_scheduler_configs[0].scheduler.load_state_dict(sd["scheduler"])
        progress = optimizer_step_progress(t)  # global_step is derived from it
        progress.ready = progress.completed = int(sd["step"])
        m.tokens_seen = int(sd["tokens_seen"])
        torch.set_rng_state(sd["rng"]["torch"])
        np.random.set_state(sd["rng"]["numpy"])
        random.setstate(sd["rng"]["python"])
        self.rejoined_at = int(sd["step"])
        self.loader_behind = True

    # ------------------------------------------------------------- events
    def batch_start(self, state: Any) -> None:
        key = "quorum_timeout_s" if self.quorums else "first_quorum_timeout_s"
        wait_s = float(getattr(self.ft, key))
        try:
            self.manager.start_quorum(timeout=timedelta(seconds=wait_s))
        except Exception as exc:  # torchft raises a plain RuntimeError/TimeoutError
            saved = self.save() if self.save is not None else None
            where = f"saved the checkpoint of step {state.step - 1} in {saved}" if saved else "nothing saved"
            # a first quorum waits for groups still starting; a later one lost the lighthouse or peers
            todo = ("start the other groups or raise fault_tolerance.first_quorum_timeout_s, check the "
                    "lighthouse, then restart this group" if not self.quorums else
                    "restart the lighthouse, then the groups")
            raise QuorumLost(f"no quorum of replica groups within fault_tolerance.{key}="
                             f"{wait_s} s before step {state.step} (lighthouse "
                             f"{self.ft.lighthouse}: {str(exc).splitlines()[0][:200]}); {where}; "
                             f"exit code 75 ({todo} with checkpoint.resume=auto)") from exc
        self.quorums += 1
        if self.loader_behind:  # the state (and the step) came from a peer
            state.step = self.trainer.global_step + 1
            state.batch = self.batch_for_step(state.step)

    @torch.no_grad()
    def after_backward(self, state: Any) -> None:
        if state.micro_batch != state.n_micro - 1:
            return
        # every trainable parameter, in one order on all groups: a gradient one group lacks (a
        # parameter its batch did not reach) is zeros, so the buffers line up
        # FSDP2: each gradient's local shard (already reduce-scattered inside the group), the
        # same shard on rank r of every group: HSDP's replicate all-reduce
        params = [p for p in state.module.model.parameters() if p.requires_grad]
        grads = [_as_local(p.grad) if p.grad is not None else torch.zeros_like(_as_local(p)) for p in params]
        n = max(1, self.manager.num_participants())
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self._sum(flat)
            flat /= n
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        for p, g in zip(params, grads):  # a parameter without a gradient takes the average
            if p.grad is None:
                p.grad = (DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())
                          if isinstance(p, DTensor) else g)

    def before_optimizer_step(self, state: Any) -> None:
        m = self.manager
        n = max(1, m.num_participants())
        loss = state.metrics.get("train/loss")
        if isinstance(loss, torch.Tensor):
            state.metrics["train/loss"] = self._sum(loss.detach().clone().reshape(1))[0] / n
        if state.skip_step:  # another plugin dropped this update: the group votes no
            m.report_error(RuntimeError(f"step {state.step} skipped by a plugin"))
        committed = m.should_commit()
        state.skip_step = not committed
        optimizer = state.optimizer
        if optimizer is not None:  # after a rejoin the module read lr before the state came
            state.metrics["train/lr"] = optimizer.param_groups[0]["lr"]
        state.module.step_tokens *= n  # the module counted this group's tokens only
        state.metrics["train/tokens_seen"] = state.module.tokens_seen + state.module.step_tokens
        state.metrics["ft/participants"] = n
        state.metrics["ft/committed"] = int(committed)

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed in place over the quorum's groups (on a failed collective torchft
        records the error and the commit votes no)."""
        work = self.manager.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM)
        work.wait()
        return t


def _as_local(t: Any) -> Any:
    """This rank's shard of a DTensor (its storage), or ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _local(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples) with every DTensor replaced by this rank's shard."""
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return _as_local(tree)


def _sharded_like(optim_sd: dict[str, Any], params: list) -> dict[str, Any]:
    """An optimizer state dict of local shards (:func:`_local`) made loadable by this rank's
    optimizer: each state tensor shaped like its DTensor parameter's shard becomes a DTensor
    on that parameter's mesh and placements (state ids index ``params`` in param-group order)."""
    state = {}
    for idx, entry in optim_sd["state"].items():
        p = params[int(idx)]
        if isinstance(p, DTensor):
            entry = {k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                         if isinstance(v, torch.Tensor) and v.shape == p.to_local().shape else v)
                     for k, v in entry.items()}
        state[idx] = entry
    return {**optim_sd, "state": state}


BUCKET_ELEMENTS = 1 << 25
"""Gradient elements per all-reduce across groups (128 MiB in fp32): one flat copy of at most
this size lives beside the gradients."""


def _buckets(params: list) -> list[list]:
    """``params`` cut into runs of one dtype and at most :data:`BUCKET_ELEMENTS` elements (a
    larger parameter is a bucket of its own), in order."""
    out: list[list] = []
    size = 0
    for p in params:
        if not out or p.dtype != out[-1][0].dtype or size + p.numel() > BUCKET_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out
