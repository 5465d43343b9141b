"""Run under torchrun (gloo): pipeline parallelism against a one-process reference.

Every rank trains the same tiny fp32 Llama (dim 32, 4 blocks (8 on 4 ranks), vocab 64, seq 16) for STEPS AdamW
steps, with gradient clipping, once in one process (the reference, computed on every rank) and
once per layout in ``LAYOUTS[world size]`` over all ranks (with the layout's algorithms'
model transforms, e.g. activation checkpointing, compile); writes ``<out>/rank<R>.json`` with
each layout's losses, gradient norms and the reference's. tests/test_pipeline.py reads them.
"""

import json
import sys
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llmforge.algorithms.loading import build_algorithms
from llmforge.config.schema import TrainConfig
from llmforge.config.validate import plan_batch
from llmforge.parallel.mesh import ParallelDims, build_mesh
from llmforge.parallel.transforms import strategy_transforms
from llmforge.training.module import LLMModule
from llmforge.training.optim import build_optimizer

STEPS = 6
LAYOUTS = {
    2: {"1f1b": {"strategy.pp": 2},
        "gpipe": {"strategy.pp": 2, "pipeline.schedule": "gpipe"},
        "interleaved_1f1b": {"strategy.pp": 2, "pipeline.schedule": "interleaved_1f1b",
                             "pipeline.stages_per_rank": 2},
        "zbv": {"strategy.pp": 2, "pipeline.schedule": "zbv"},
        "dualpipev": {"strategy.pp": 2, "pipeline.schedule": "dualpipev"},
        "lighter_ends_m2": {"strategy.pp": 2, "pipeline.split": "lighter_ends", "pipeline.microbatches": 2},
        # per-stage model transforms: activation checkpointing and compile of each block
        # (aot_eager: dynamo + AOTAutograd without inductor's minute of C++ compiling)
        "ac_full": {"strategy.pp": 2, "algorithms": [{"name": "activation_checkpointing"}]},
        "compile_aot_eager": {"strategy.pp": 2, "algorithms": [{"name": "compile", "backend": "aot_eager"}]}},
    4: {"pp4_1f1b": {"strategy.pp": 4},
        "pp4_interleaved": {"strategy.pp": 4, "pipeline.schedule": "interleaved_1f1b"},
        "fsdp2_x_pp2": {"strategy.pp": 2, "strategy.name": "fsdp2"},
        "tp2_x_pp2": {"strategy.pp": 2, "strategy.tp": 2}},
}


def make_cfg(overrides, n_layers):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                          "multiple_of": 16, "max_seq_len": 16})
    cfg.trainer.merge_with({"micro_batch_size": 2, "global_batch_size": 8, "seq_len": 16,
                            "gradient_clip_val": 0.5})
    cfg.optimizer.merge_with({"lr": 1e-2, "eps": 1e-6})
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def train(mod, cfg, batches, dp_rank, dp):
    opt = build_optimizer(mod.model, cfg.optimizer)
    losses, norms = [], []
    rows = len(batches[0]) // dp
    for batch in batches:
        loss, n = mod.forward_backward(batch[dp_rank * rows:(dp_rank + 1) * rows])
        norms.append(float(mod.clip_gradients_(opt)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(mod.dp_all_reduce(loss) / n))
    return losses, norms


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (8, 17)) for _ in range(STEPS)]
    n_layers = 4 if world == 2 else 8  # pp 4 x 2 virtual stages: 8 blocks
    cfg = make_cfg({}, n_layers)
    ref = LLMModule(cfg, plan_batch(cfg, 1))
    ref.configure_model()
    report = {"reference": train(ref, cfg, batches, 0, 1), "seconds": {}}
    for name, overrides in LAYOUTS[world].items():
        start = time.perf_counter()
        cfg = make_cfg(overrides, n_layers)
        dims = ParallelDims.from_config(cfg, world)
        cfg.trainer.devices = world  # the algorithms' checks read the world size here
        algos = [t for t in (a.transform() for a in build_algorithms(cfg)) if t is not None]
        mod = LLMModule(cfg, plan_batch(cfg, world), pipeline=algos + strategy_transforms(cfg, dims))
        mod.mesh_override = build_mesh(dims, "cpu")
        mod.configure_model()
        dp = mod.mesh["dp"]
        report[name] = train(mod, cfg, batches, dp.get_local_rank(), dp.size())
        report[name + "_keys"] = sorted(mod.model.state_dict())
        report["seconds"][name] = time.perf_counter() - start
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
