"""lm-evaluation-harness on llmforge models: the adapter's log-likelihoods against a direct
computation, ``llmforge eval`` on a local task writing scores to the run directory, and the
``eval_harness`` callback logging them during training."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import DEMO, TINY_OVERRIDES, run_main

pytest.importorskip("lm_eval")


TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

DOCS = [
    {"question": "ROMEO. What light through yonder window", "choices": [" breaks", " zebra"], "answer": 0},
    {"question": "To be, or not to", "choices": [" be", " quantum"], "answer": 0},
    {"question": "My lord, I", "choices": [" xylophone", " will"], "answer": 1},
    {"question": "Good morrow,", "choices": [" sir", " kilowatt"], "answer": 0},
]


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "tiny_mc.yaml").write_text(TASK.format(data=data))
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("harness")
    proc = run_main("train", DEMO, *TINY_OVERRIDES, f"run.output_dir={out}", "run.name=h",
                   "trainer.max_steps=6", "trainer.eval_every=0", "data.max_documents=20",
                   cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "h", write_task(out / "tasks")


def test_adapter_loglikelihood_matches_a_direct_computation(trained):
    from llmforge.evaluation.harness import make_lm
    from llmforge.checkpoint.run_dir import load_for_inference

    model, tok, _ = load_for_inference(trained[0])
    lm = make_lm(model, tok, batch_size=3)
    pairs = [("To be, or not to", " be"), ("ROMEO.", " What light"), ("My lord", ",")]
    got = lm.loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        whole, c = tok.encode(ctx + cont), tok.encode(ctx)
        with torch.no_grad():
            lp = F.log_softmax(model(torch.tensor([whole[:-1]])).float(), -1)[0]
        target = torch.tensor(whole[len(c):])
        want = lp[len(c) - 1:].gather(-1, target[:, None]).sum().item()
        assert logp == pytest.approx(want, abs=1e-4)
        assert greedy == bool((lp[len(c) - 1:].argmax(-1) == target).all())
    # rolling log-likelihood of a text = sum over its tokens after BOS
    text = "To be, or not to be, that is the question."
    [rolling] = lm.loglikelihood_rolling([SimpleNamespace(args=(text,))], disable_tqdm=True)
    ids = [tok.bos_id] + tok.encode(text)
    with torch.no_grad():
        lp = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0]
    assert rolling == pytest.approx(lp.gather(-1, torch.tensor(ids[1:])[:, None]).sum().item(), abs=1e-4)
    # generation stops at the stop string
    [gen] = lm.generate_until([SimpleNamespace(args=("ROMEO.", {"until": ["\n"], "max_gen_toks": 8}))])
    assert isinstance(gen, str) and "\n" not in gen


def test_llmforge_eval_runs_a_local_task_and_writes_the_score(trained):
    run_dir, tasks = trained
    proc = run_main("eval", str(run_dir), "--tasks", "tiny_mc", "--include-path", str(tasks),
                   "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiny_mc/acc " in proc.stdout
    [line] = [json.loads(x) for x in (run_dir / "eval_harness.jsonl").read_text().splitlines()]
    assert line["step"] == 6 and line["tasks"] == ["tiny_mc"]
    acc = line["scores"]["tiny_mc/acc"]
    assert acc in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 documents
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 6, **{f"eval/harness/{k}": v for k, v in line["scores"].items()}}

    bad = run_main("eval", str(run_dir), "--tasks", "tiny_mcq", "--include-path", str(tasks))
    assert bad.returncode == 2 and "unknown lm-eval task(s): 'tiny_mcq' (did you mean tiny_mc" in bad.stderr
    assert "Traceback" not in bad.stderr
    # a task whose template does not render: exit 2, naming the task folder
    broken = tasks.parent / "broken"
    broken.mkdir()
    (broken / "tiny_bad.yaml").write_text((tasks / "tiny_mc.yaml").read_text().replace(
        "task: tiny_mc", "task: tiny_bad").replace("{{question}}", "{{question | nosuchfilter}}"))
    bad = run_main("eval", str(run_dir), "--tasks", "tiny_bad", "--include-path", str(broken / "tiny_bad.yaml"))
    assert bad.returncode == 2 and "could not run tiny_bad (task YAMLs in" in bad.stderr, bad.stderr[-2000:]
    assert "nosuchfilter" in bad.stderr and "Traceback" not in bad.stderr
    # a hub task with the hub offline (the suite sets HF_DATASETS_OFFLINE=1): exit 2, not 1
    bad = run_main("eval", str(run_dir), "--tasks", "hellaswag", "--limit", "1")
    assert bad.returncode == 2 and "could not fetch the data of hellaswag" in bad.stderr, bad.stderr[-2000:]
    for args, words in [(["--limit", "1.5"], "--limit must be a whole count"),
                        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "foo"], "--device")]:
        bad = run_main("eval", str(run_dir), "--tasks", "tiny_mc", *args)
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr[-2000:]


def test_scores_leave_out_bookkeeping_entries():
    from llmforge.evaluation.harness import flatten_results

    res = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "sample_len": 4,
                             "acc_norm,none": float("nan")}}}
    assert flatten_results(res) == {"t/acc": 0.5, "t/acc_stderr": 0.1}


def test_eval_harness_callback_logs_scores_during_training(tmp_path, trained):
    tasks = trained[1]
    proc = run_main("train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path}", "run.name=cb",
                   "trainer.max_steps=4", "trainer.eval_every=0", "trainer.log_every=2",
                   "data.max_documents=20", "checkpoint.save_final=false",
                   f"callbacks=[{{name: eval_harness, tasks: [tiny_mc], every: 2, "
                   f"include_path: ['{tasks}']}}]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "cb" / "metrics.jsonl").read_text().splitlines()]
    scored = [r["step"] for r in records if "eval/harness/tiny_mc/acc" in r]
    assert scored == [2, 4]
    lines = [json.loads(x) for x in (tmp_path / "cb" / "eval_harness.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4]
    assert all(math.isfinite(x["scores"]["tiny_mc/acc_norm"]) for x in lines)
