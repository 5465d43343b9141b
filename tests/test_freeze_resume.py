"""Layer freezing (examples/freeze_layers.py) and resume: a checkpoint saved while some
parameters never had a gradient (so AdamW holds no state for them) resumes bit-exact, on 1
process, FSDP2 x 2 and pp=2; as does one saved after they were unfrozen.

Each layout trains 5 steps uninterrupted with the embeddings frozen for steps 1-2 and saves at
steps 2 (frozen) and 4 (unfrozen: their AdamW step count is 2, the others' 4); a run resumed
from each checkpoint then gives the uninterrupted run's losses and final weights exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_OVERRIDES
from helpers.dist import torchrun, worker

EXAMPLE = str(REPO / "examples" / "freeze_layers.yaml")  # FreezeLayers on tok_embeddings
BASE = [*TINY_OVERRIDES, "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
        "trainer.max_steps=5", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.eval_batches=1", "data.max_documents=6", "algorithms.0.steps=2"]
LAYOUTS = {"one": [], "fsdp2": ["strategy.name=fsdp2"], "pp2": ["strategy.pp=2"]}


def runs(out: Path, layout: str) -> dict[str, list[str]]:
    """The uninterrupted run (saves at 2 and 4) and the two resumed from its checkpoints."""
    base = ["train", EXAMPLE, *BASE, *LAYOUTS[layout], f"run.output_dir={out}"]
    ckpts = out / f"{layout}_ref" / "checkpoints"
    return {f"{layout}_ref": [*base, f"run.name={layout}_ref", "checkpoint.save_every=2"],
            **{f"{layout}_from{s}": [*base, f"run.name={layout}_from{s}",
                                     f"checkpoint.resume={ckpts / f'step_{s:08d}'}"] for s in (2, 4)}}


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r}


def assert_resumed_exactly(out: Path, layout: str) -> None:
    from llmforge.checkpoint.run_dir import load_for_inference
    from llmforge.checkpoint.safe_load import load_metadata

    ref = out / f"{layout}_ref"
    saved = {s: set(load_metadata(ref / "checkpoints" / f"step_{s:08d}" / ".metadata").state_dict_metadata)
             for s in (2, 4)}
    emb = "optim.state.tok_embeddings.weight.exp_avg"
    assert emb not in saved[2] and "optim.state.output.weight.exp_avg" in saved[2]
    assert emb in saved[4]
    weights_ref = load_for_inference(ref, trust_code=True)[0].state_dict()
    assert sorted(losses(ref)) == [1, 2, 3, 4, 5]
    for s in (2, 4):
        resumed = out / f"{layout}_from{s}"
        got, want = losses(resumed), losses(ref)
        assert sorted(got) == list(range(s + 1, 6))
        assert all(got[t] == want[t] for t in got), (layout, s, got, want)
        weights = load_for_inference(resumed, trust_code=True)[0].state_dict()
        assert all(torch.equal(weights[k], weights_ref[k]) for k in weights_ref), (layout, s)
    # frozen at steps 1-2 only (the 1-based state.step of before_optimizer_step)
    recs = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/frozen"] for r in recs if "train/frozen" in r] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_frozen_then_unfrozen_checkpoints_resume_exactly_one_process(tmp_path, monkeypatch):
    from llmforge.cli import main

    monkeypatch.syspath_prepend(str(REPO))  # examples/ as PYTHONPATH=. finds it
    for name, argv in runs(tmp_path, "one").items():
        assert main(argv) == 0, name
    assert_resumed_exactly(tmp_path, "one")


@pytest.mark.slow
def test_frozen_then_unfrozen_checkpoints_resume_exactly_fsdp2_and_pp2(tmp_path):
    """Both 2-process layouts in ONE torchrun launch (tests/dist/train_worker.py)."""
    all_runs = {**runs(tmp_path, "fsdp2"), **runs(tmp_path, "pp2")}
    (tmp_path / "runs.json").write_text(json.dumps(all_runs))
    proc = torchrun(worker("train_worker.py"), str(tmp_path), str(tmp_path / "runs.json"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for layout in ("fsdp2", "pp2"):
        assert_resumed_exactly(tmp_path, layout)


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "per_parameter"])
def test_optimizer_state_absent_at_save_stays_absent(tmp_path, flat):
    """The checkpoint functions alone, both optimizer layouts (per-parameter: pipeline stages):
    a parameter AdamW never stepped loads without state and its first step equals the
    uninterrupted one's."""
    from torch import nn

    from llmforge.checkpoint.dcp import load_training_state, save_checkpoint

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(model, opt, frozen):
        model(torch.ones(3, 4)).square().sum().backward()
        for p in (model[0].parameters() if frozen else ()):
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)

    model, opt = build()
    step(model, opt, frozen=True)
    save_checkpoint(tmp_path, 1, model, opt, {"step": 1}, {}, flatten_optimizer=flat)
    step(model, opt, frozen=False)
    again, opt2 = build()
    load_training_state(tmp_path / "step_00000001", again, opt2)
    assert [len(opt2.state[p]) for p in again.parameters()] == [0, 0, 3, 3]
    assert opt2.state[again[1].weight]["step"].item() == 1
    step(again, opt2, frozen=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert opt2.state[again[0].weight]["step"].item() == 1
