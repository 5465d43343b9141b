"""Run under torchrun (gloo): real training steps measured by the same code and tracker as the
simulation (:func:`llmforge.planning.simulate.simulate` with ``fake=False``), one layout after
another on the same processes (one launch, not one per layout). Arguments: OUT CONFIG LAYOUTS
[key=value ...]; LAYOUTS is a JSON list of ``[dp_shard, tp, ac, mbs, cp]`` whose degrees make up
the world size. Rank 0 writes ``<out>``: a JSON list, per layout, of the measurement (peak bytes,
breakdown, FLOPs).

Each layout's step runs twice and the lower peak is reported: the real run's peak once came out
0.5 MB (12 %) above its usual 4.19 MB in a full suite (TP 2; not reproduced in nine runs under
load), a transient that a fake process group, whose collectives complete at once, cannot have."""

import json
import sys

import torch.distributed as dist

from llmforge.config import load_config
from llmforge.planning.layout import Layout
from llmforge.planning.simulate import simulate


def main(out, config, layouts, *overrides):
    dist.init_process_group("gloo")
    measured = []
    for dp_shard, tp, ac, mbs, cp in json.loads(layouts):
        cfg = load_config(config, [*overrides, f"strategy.cp={cp}"])
        layout = Layout(1, dp_shard, tp, ac, mbs, cp=cp)
        measured.append(min((simulate(cfg, layout, fake=False) for _ in range(2)),
                            key=lambda s: s.peak_bytes).as_dict())
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(measured, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
