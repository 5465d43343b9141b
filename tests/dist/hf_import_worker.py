"""Run under torchrun (2 processes, gloo): import an HF checkpoint into an FSDP2-sharded model
(``model.init_from: hf:PATH``) and measure this process's anonymous memory while it happens.

Writes ``<out>/rank<R>.json``: ``growth_bytes`` (peak RssAnon during ``configure_model`` minus
RssAnon before it, sampled every 0.5 ms), ``local_param_bytes`` (this rank's shard) and the
init method. tests/test_hf.py reads them.
"""

import gc
import json
import sys
import threading
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from llmforge.checkpoint.init_from import apply_hf_shape
from llmforge.config.schema import TrainConfig
from llmforge.config.validate import plan_batch
from llmforge.parallel.mesh import ParallelDims, build_mesh
from llmforge.parallel.transforms import strategy_transforms
from llmforge.training.module import LLMModule


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(hf_path: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.init_from = f"hf:{hf_path}"
    apply_hf_shape(cfg)
    cfg.model.max_seq_len = 64
    cfg.trainer.merge_with({"micro_batch_size": 1, "global_batch_size": world, "seq_len": 16})
    cfg.strategy.name = "fsdp2"
    dims = ParallelDims.from_config(cfg, world)
    mod = LLMModule(cfg, plan_batch(cfg, world), pipeline=strategy_transforms(cfg, dims))
    mod.mesh_override = build_mesh(dims, "cpu")
    gc.collect()
    sys.setswitchinterval(0.0005)
    base = rss_anon()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.0005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    mod.configure_model()
    peak[0] = max(peak[0], rss_anon())
    done.set()
    t.join()
    local = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
                else p.numel() * p.element_size() for p in mod.model.parameters())
    checksum = float(sum(p.full_tensor().double().sum() for p in mod.model.parameters()))
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"growth_bytes": peak[0] - base, "local_param_bytes": local,
                   "init_method": mod.init_method, "checksum": checksum}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
