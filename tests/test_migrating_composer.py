"""docs/migrating_from_composer.md: the Composer algorithm ported to llmforge runs as written."""

import json

import torch

from conftest import DEMO, run_main
from helpers.docs_examples import confidence_penalty_source


def test_ported_confidence_penalty_subtracts_the_entropy_and_trains(tmp_path, tiny_overrides, monkeypatch):
    package = tmp_path / "lab" / "my_lab"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "confidence_penalty.py").write_text(confidence_penalty_source())
    monkeypatch.syspath_prepend(str(tmp_path / "lab"))
    from my_lab.confidence_penalty import ConfidencePenalty

    from llmforge.events import State

    algo = ConfidencePenalty(beta=0.5)
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 2], [0, 4, -100]])
    st = State(outputs=logits, labels=labels, loss=torch.tensor(10.0), training=True)
    algo.batch_start(st)
    algo.after_loss(st)
    p = logits.softmax(-1)
    entropy = -(p * p.log()).sum(-1)[labels != -100].sum()  # by hand: summed over 4 targets
    torch.testing.assert_close(st.loss, 10.0 - 0.5 * entropy)
    st.training, st.loss = False, torch.tensor(1.0)
    algo.after_loss(st)
    assert st.loss.item() == 1.0  # evaluation is left alone

    r = run_main("train", DEMO, *tiny_overrides, "trainer.max_steps=2", "trainer.eval_every=0",
                 "trainer.log_every=1", "run.name=cp",
                 "algorithms=[{name: my_lab.confidence_penalty.ConfidencePenalty, beta: 0.1}]")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (tmp_path / "runs" / "cp" / "metrics.jsonl").read_text().splitlines()]
    entropies = [x["train/entropy"] for x in rows if "train/loss" in x]
    # a fresh model's predictions are near uniform over the 1024 ids: entropy near log(1024)
    assert len(entropies) == 2 and all(5.0 < e <= torch.log(torch.tensor(1024.0)).item() + 1e-4 for e in entropies)
