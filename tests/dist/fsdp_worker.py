"""Run under torchrun (2 processes, gloo): FSDP2 reductions against a one-process reference,
and docs/algorithms/README.md's DTensor example (GradNoise) on the FSDP2 gradients.

Writes ``<out>/rank<R>.json`` with the measured differences; tests/test_parallel_math.py reads
them. Each rank gets a different number of target tokens (masked labels).
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests.helpers.docs_examples import grad_noise

from llmforge.config.schema import TrainConfig
from llmforge.config.validate import plan_batch
from llmforge.parallel.mesh import ParallelDims, build_mesh
from llmforge.parallel.transforms import strategy_transforms
from llmforge.models.memory_estimate import estimate_memory
from llmforge.training.module import LLMModule


def make_cfg(tie: bool, clip):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                          "multiple_of": 16, "max_seq_len": 16, "tie_embeddings": tie})
    cfg.trainer.merge_with({"micro_batch_size": 2, "global_batch_size": 4, "seq_len": 8,
                            "gradient_clip_val": clip})
    cfg.strategy.name = "fsdp2"
    return cfg


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_noise_report(model) -> dict:
    """The docs' GradNoise on ``model``'s sharded gradients and on a replicated DTensor: what it
    added per element, and a checksum per kind (equal across ranks only for the replica)."""
    doc = grad_noise()
    replica = torch.nn.Linear(16, 8, bias=False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    replica.weight = torch.nn.Parameter(distribute_tensor(replica.weight.detach(), mesh, [Replicate()]))
    replica.weight.grad = distribute_tensor(torch.zeros(8, 16), mesh, [Replicate()])
    params = dict(model.named_parameters())
    before = {n: p.grad.to_local().clone() for n, p in params.items()}
    try:  # what the docs say a plain tensor mixed in does (the crash); zeros: no change
        first = next(iter(params.values()))
        first.grad.add_(torch.zeros(first.shape))
        mixed_error = None
    except Exception as exc:
        mixed_error = str(exc)
    for module in (model, replica):
        doc.GradNoise(std=0.01).before_optimizer_step(SimpleNamespace(model=module, step=3))
    added = torch.cat([(p.grad.to_local() - before[n]).flatten() for n, p in params.items()])
    return {"all_dtensor": all(isinstance(p.grad, DTensor) for p in params.values()),
            "mixed_error": mixed_error, "noise_std": added.std().item(), "noise_mean": added.mean().item(),
            "shard_checksum": added.sum().item(), "replica_checksum": replica.weight.grad.to_local().sum().item(),
            "replica_std": replica.weight.grad.to_local().std().item()}


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 8))
    labels = torch.randint(0, 64, (4, 8))
    labels[0, :6] = -100  # rank 0 holds rows 0-1: 10 targets; rank 1 rows 2-3: 16 targets
    labels[1, :] = -100
    report = {}
    for tie in (False, True):
        cfg = make_cfg(tie, None)
        ref = LLMModule(cfg, plan_batch(cfg, 1))
        ref.configure_model()
        ref.forward_backward({"input_ids": tokens, "labels": labels})
        ref_norm = ref.clip_gradients_(torch.optim.SGD(ref.model.parameters(), lr=0.1)).item()

        dims = ParallelDims.from_config(cfg, world)
        mod = LLMModule(cfg, plan_batch(cfg, world), pipeline=strategy_transforms(cfg, dims))
        mod.mesh_override = build_mesh(dims, "cpu")
        mod.configure_model()
        rows = slice(2 * rank, 2 * rank + 2)
        loss, n = mod.forward_backward({"input_ids": tokens[rows], "labels": labels[rows]})
        grad_diff = max((full(p.grad) - q.grad).abs().max().item()
                        for p, q in zip(mod.model.parameters(), ref.model.parameters()))
        ref_grad_max = max(q.grad.abs().max().item() for q in ref.model.parameters())
        weight_diff = max((full(p) - q).abs().max().item()
                          for p, q in zip(mod.model.parameters(), ref.model.parameters()))
        norm = mod.clip_gradients_(torch.optim.SGD(mod.model.parameters(), lr=0.1)).item()

        # clip to half the norm, then one AdamW step on both
        for m in (ref, mod):
            m.cfg.trainer.gradient_clip_val = ref_norm / 2
        opt_ref = torch.optim.AdamW(ref.model.parameters(), lr=1e-2)
        opt_mod = torch.optim.AdamW(mod.model.parameters(), lr=1e-2)
        ref.clip_gradients_(opt_ref)
        mod.clip_gradients_(opt_mod)
        opt_ref.step()
        opt_mod.step()
        update_diff = max((full(p) - q).abs().max().item()
                          for p, q in zip(mod.model.parameters(), ref.model.parameters()))
        local_bytes = sum(p.to_local().numel() * p.element_size() for p in mod.model.parameters())
        full_bytes = sum(q.numel() * q.element_size() for q in ref.model.parameters())
        max_rows = max(q.shape[0] for q in ref.model.parameters())
        est = estimate_memory(ref.model.num_params(), "fp32", cfg.strategy, world).params_bytes
        report["tied" if tie else "untied"] = {
            "ref_grad_max": ref_grad_max, "n_targets": n.item(), "loss_sum_local": loss.item(), "grad_diff": grad_diff,
            "init_weight_diff": weight_diff, "norm": norm, "ref_norm": ref_norm,
            "update_diff_after_half_clip": update_diff, "local_param_bytes": local_bytes,
            "full_param_bytes": full_bytes, "estimated_param_bytes": est,
            "row_bytes_slack": max_rows * 32 * 4 * len(list(ref.model.parameters())),
            "still_tied": (mod.model.output.weight is mod.model.tok_embeddings.weight) if tie else None,
        }
        if not tie:  # after the measurements above: the noise changes the gradients
            report["grad_noise"] = grad_noise_report(mod.model)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
