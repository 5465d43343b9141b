"""Run under torchrun (gloo) on 4 processes: Muon+AdamW on a sharded model against one process.

Each rank trains the same tiny model on the same batches unsharded, then in three layouts of the 4
ranks (DTensor shards: gather, orthogonalize, keep the shard; on a 1-D mesh the matrices are dealt
round-robin over the ranks): ``fsdp4`` (FSDP2 over 4), ``hsdp`` (FSDP2 shards over 2 ranks,
replicated twice) and ``tp2`` (tensor parallel 2 x FSDP2 2). Writes ``<out>/rank<R>.json`` with the
loss curves and each parameter's largest difference. The fsdp4 run's model and optimizer are saved
with DCP after ``STEPS`` steps (``<out>/ckpt``); tests/test_muon.py reads the reports and resumes
that checkpoint in one process against the reference's steps ``STEPS + 1 ..``. All runs are fp32,
so Muon's Newton-Schulz runs in float32 (``optimizer.muon_ns_dtype`` null).
"""

import json
import sys

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llmforge.checkpoint.dcp import save_checkpoint
from llmforge.config.schema import TrainConfig
from llmforge.config.validate import plan_batch
from llmforge.parallel.mesh import ParallelDims, build_mesh
from llmforge.training import muon
from llmforge.parallel.transforms import strategy_transforms
from llmforge.training.module import LLMModule
from llmforge.training.optim import build_optimizer

STEPS = 10
MORE = 2  # steps the reference trains past STEPS (the 1-process resume of the 2-process checkpoint)
CALLS = []


def counting_newton_schulz(g, *args, _ns=muon.newton_schulz):
    CALLS.append(tuple(g.shape))
    return _ns(g, *args)


def make_cfg():
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                          "multiple_of": 16, "max_seq_len": 16})
    cfg.trainer.merge_with({"micro_batch_size": 1, "global_batch_size": 4, "seq_len": 16})
    cfg.strategy.name = "fsdp2"
    # lr high enough that Muon moves the weights visibly in a few steps; eps 1e-6 as in
    # tests/test_parallel.py (AdamW's 1e-8 amplifies reduction-order noise on rare embedding rows)
    cfg.optimizer.merge_with({"name": "muon", "lr": 1e-2, "eps": 1e-6})
    return cfg


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def make_batches():
    """The batches of every run: ``STEPS + MORE`` pairs of ``LongTensor[4, 16]`` (tokens, labels)."""
    torch.manual_seed(0)
    return [(torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))) for _ in range(STEPS + MORE)]


def train(mod, batches, rows, opt=None):
    opt = opt or build_optimizer(mod.model, mod.cfg.optimizer)
    out = []
    for tokens, labels in batches:
        loss, n = mod.forward_backward({"input_ids": tokens[rows], "labels": labels[rows]})
        loss = loss.detach().clone()
        if rows != slice(None):  # n is already the count over all ranks
            dist.all_reduce(loss, group=mod.mesh_override["dp"].get_group())
        out.append((loss / n).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out, opt


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    all_batches = make_batches()
    batches = all_batches[:STEPS]
    cfg = make_cfg()
    ref = LLMModule(cfg, plan_batch(cfg, 1))
    ref.configure_model()
    ref_losses, ref_opt = train(ref, batches, slice(None))

    report = {}
    muon.newton_schulz = counting_newton_schulz  # count the orthogonalizations this rank does
    for name, rep, tp in (("fsdp4", 1, 1), ("hsdp", 2, 1), ("tp2", 1, 2)):
        cfg = make_cfg()
        cfg.strategy.merge_with({"dp_replicate": rep, "tp": tp})
        dims = ParallelDims.from_config(cfg, world)
        mod = LLMModule(cfg, plan_batch(cfg, world), pipeline=strategy_transforms(cfg, dims))
        mod.mesh_override = mesh = build_mesh(dims, "cpu")
        mod.configure_model()
        per = 4 // dims.dp  # tensor parallel ranks see the same rows
        dp_rank = mesh["dp"].get_local_rank()
        rows = slice(per * dp_rank, per * dp_rank + per)
        CALLS.clear()
        losses, opt = train(mod, batches, rows)
        if name == "fsdp4":  # every rank writes its shards
            save_checkpoint(f"{out}/ckpt", STEPS, mod.model, opt, {"step": STEPS}, {})
        report[name] = {"losses": losses, "newton_schulz_calls": len(CALLS), "weight_diff": {
            n: (full(p) - q).abs().max().item()
            for (n, p), q in zip(mod.model.named_parameters(), ref.model.parameters())}}
    # the same one-process curve for both
    report["ref_losses"] = ref_losses
    report["ref_more"] = train(ref, all_batches[STEPS:], slice(None), ref_opt)[0]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
