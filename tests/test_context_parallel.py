"""Context parallelism (``strategy.cp``, issue 44) on real gloo processes: the same training as one
process, resume across cp, SIGKILL + resume, and the bad input that stops a run with exit 2.

The one-process reference and the cp=1 resumption run in this process; every cp run is
``llmforge train`` from its command line. The 2-process runs share ONE torchrun launch
(tests/dist/train_worker.py runs them in sequence), the 4-process runs another. Packed SFT rows
under cp=2 are in test_sft.py's 2-process launch; the event contract in test_step_events.py.
"""

import json
from pathlib import Path

import pytest
from torch import nn

from conftest import DEMO, run_main
from helpers.dist import torchrun, worker
from llmforge.config.loader import load_config
from llmforge.errors import ConfigError
from llmforge.parallel.context_parallel import check_context_parallel, gathered_index, load_balanced_index
from llmforge.parallel.mesh import ParallelDims
from llmforge.plugin import meta_model
from test_resume import BASE, assert_bit_exact, kill_at, losses, train, train_here

SAVE = "checkpoint.save_every=4"
CP2 = ["strategy.cp=2", SAVE]
AC = "algorithms=[{name: activation_checkpointing}]"  # recomputes the collectives in backward


def evals(run_dir: Path) -> list[float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/loss"] for r in recs if "eval/loss" in r]


def launch(out: Path, runs: dict[str, list[str]], nproc: int) -> None:
    """``llmforge train DEMO BASE... ARGS`` for every run, in one torchrun launch of ``nproc``."""
    argv = {name: ["train", DEMO, *BASE, f"run.output_dir={out}", f"run.name={name}", *extra]
            for name, extra in runs.items()}
    (out / "runs.json").write_text(json.dumps(argv))
    proc = torchrun(worker("train_worker.py"), str(out), str(out / "runs.json"), nproc=nproc, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """One process (``ref``), then ONE 2-process launch: cp=2 all_gather (``ag``, saving every 4
    steps), cp=2 ulysses with activation checkpointing (``uly``), cp=2 with chunked cross-entropy (``cce``: it acts on each
    rank's slice) and cp=2 resuming ref's step-4 checkpoint (``from1``); then
    ag's step-4 checkpoint resumed at cp=1 in this process (``to1``)."""
    out = tmp_path_factory.mktemp("cp")
    assert train_here(out, "ref", SAVE).returncode == 0
    launch(out, {"ag": CP2, "uly": [*CP2, "context_parallel.mode=ulysses", AC],
                 "cce": ["strategy.cp=2", "algorithms=[{name: chunked_cross_entropy, chunk_size: 16}]"],
                 "from1": [*CP2, f"checkpoint.resume={out / 'ref/checkpoints/step_00000004'}"]}, 2)
    resumed = train_here(out, "to1", f"checkpoint.resume={out / 'ag/checkpoints/step_00000004'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out


@pytest.mark.slow
def test_cp2_equals_one_process_and_resumes_across_cp(cp_runs):
    """8 steps of cp=2 in both modes (and with chunked cross-entropy): losses and eval losses
    within 1e-5 of one process; a cp=2 checkpoint continues at cp=1 and a cp=1 one at cp=2 with
    the reference's losses."""
    ref = losses(cp_runs / "ref")
    assert sorted(ref) == list(range(1, 9)) and len(evals(cp_runs / "ref")) == 2  # steps 0 and 8
    for name in ("ag", "uly", "cce"):
        got = losses(cp_runs / name)
        assert sorted(got) == sorted(ref), name
        for s in ref:
            assert got[s] == pytest.approx(ref[s], abs=1e-5), (name, s)
        assert evals(cp_runs / name) == pytest.approx(evals(cp_runs / "ref"), abs=1e-5), name
    for name in ("to1", "from1"):
        got = losses(cp_runs / name)
        assert sorted(got) == [5, 6, 7, 8], name
        for s in got:
            assert got[s] == pytest.approx(ref[s], abs=1e-5), (name, s)


@pytest.mark.slow
def test_sigkill_during_cp2_then_resume_is_bit_exact(cp_runs):
    killed = train(cp_runs, "k", *CP2, kill_at(6), nproc=2)
    assert killed.returncode != 0
    resumed = train(cp_runs, "k", *CP2, "checkpoint.resume=auto", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bit_exact(cp_runs / "ag", cp_runs / "k", from_step=5)


@pytest.mark.slow
def test_cp_composes_with_fsdp2_tp_and_pp_on_four_processes(cp_runs):
    """ONE 4-process launch: FSDP2 x CP (dp_shard 2 x cp 2), CP x TP (cp 2 x tp 2, both modes;
    ulysses splits the 2 query heads of a tp rank), ulysses at cp=4 (2 kv heads: repeated to
    the 4 query heads), CP x PP (cp 2 x pp 2, the slices through the 1F1B schedule): 8 steps
    within 1e-5 of one process."""
    out = cp_runs / "four"
    out.mkdir()
    runs = {"fsdp_cp": ["strategy.cp=2"], "cp_tp": ["strategy.cp=2", "strategy.tp=2"],
            "cp_tp_uly": ["strategy.cp=2", "strategy.tp=2", "context_parallel.mode=ulysses"],
            "cp4_uly": ["strategy.cp=4", "context_parallel.mode=ulysses"],
            "cp_pp": ["strategy.cp=2", "strategy.pp=2"]}
    launch(out, runs, 4)
    ref = losses(cp_runs / "ref")
    for name in runs:
        got = losses(out / name)
        assert sorted(got) == sorted(ref), name
        for s in ref:
            assert got[s] == pytest.approx(ref[s], abs=1e-5), (name, s)


def test_load_balanced_slices():
    """Rank r of cp holds chunks r and 2cp-1-r of 2cp; the slices cover the row once."""
    assert load_balanced_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_index(24, 3).tolist()) == list(range(24))
    with pytest.raises(ValueError):
        load_balanced_index(18, 2, 0)


@pytest.mark.parametrize("extra, needle", [
    (["strategy.cp=3", "--nproc", "3"], "strategy.cp=3 cuts every sequence into 2 x cp = 6 chunks"),
    (["strategy.cp=2", "variables.seq_len=62", "--nproc", "2"], "must divide trainer.seq_len=62"),
    (["strategy.cp=4", "model.dim=96", "model.n_heads=6", "context_parallel.mode=ulysses",
      "--nproc", "4"], "context_parallel.mode=ulysses splits the 6 query heads over strategy.cp=4"),
    (["strategy.cp=2", "strategy.name=ddp", "--nproc", "2"], "strategy.name=ddp cannot"),
    (["strategy.cp=2", "context_parallel.mode=ring", "--nproc", "2"], "context_parallel.mode"),
    (["strategy.cp=2", "strategy.pp=2", "data.task=sft", "--nproc", "4"],
     "strategy.cp=2 with strategy.pp=2 takes rows without documents"),
    (["strategy.cp=2", "algorithms=[{name: seq_length_warmup, min_seq_len: 6, step_size: 8}]",
      "--nproc", "2"], "seq_length_warmup under strategy.cp=2 needs min_seq_len (6)"),
])
def test_bad_context_parallel_settings_exit_2_naming_the_key(tmp_path, extra, needle):
    out = run_main("train", DEMO, *BASE, f"run.output_dir={tmp_path}", *extra)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert not any(tmp_path.iterdir())


def test_cp_refuses_a_model_whose_attention_cannot_take_a_slice():
    cfg = load_config(DEMO, [*BASE, "strategy.cp=2"])
    dims = ParallelDims(1, 1, 1, 2, cp=2)

    class Opaque(nn.Module):  # attention of its own: no GQAttention hook, no positions
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

    with pytest.raises(ConfigError) as err:
        check_context_parallel(cfg, dims, Opaque())
    assert err.value.exit_code == 2 and "strategy.cp=2" in str(err.value) \
        and "cannot take a slice of the sequence" in str(err.value)
    check_context_parallel(cfg, dims, meta_model(cfg))  # llama3 takes one


@pytest.mark.slow
def test_cp2_moe_logs_the_aux_loss_of_whole_rows(tmp_path):
    """A Qwen3-MoE at cp=2 logged train/aux_loss summed over dp only, divided by the whole
    rows' targets: half the one-process value (0.100 against 0.200). Summed over the slices, it
    is the one-process value within the load-balancing loss's per-slice difference."""
    from conftest import REPO

    moe = str(REPO / "yamls" / "demo_cpu_qwen3_moe.yaml")
    args = ["train", moe, "model.preset=null", "model.dim=64", "model.hidden_dim=128", "model.n_layers=2",
            "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16", "model.num_experts=4",
            "model.num_experts_per_tok=2", "model.moe_intermediate_size=32", "tokenizer.vocab_size=1024",
            "tokenizer.train_max_bytes=2000000", "variables.seq_len=64", "trainer.global_batch_size=16",
            "trainer.micro_batch_size=8", "trainer.progress_bar=false", "data.num_workers=0",
            "scheduler.warmup_steps=1", "trainer.max_steps=1", "trainer.eval_every=0",
            "data.max_documents=6", f"run.output_dir={tmp_path}"]
    assert run_main(*args, "run.name=ref", cwd=REPO).returncode == 0
    (tmp_path / "runs.json").write_text(json.dumps({"cp": [*args, "run.name=cp", "strategy.cp=2"]}))
    proc = torchrun(worker("train_worker.py"), str(tmp_path), str(tmp_path / "runs.json"), nproc=2,
                    timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    aux = {name: [json.loads(x)["train/aux_loss"]
                  for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                  if "train/aux_loss" in x] for name in ("ref", "cp")}
    assert len(aux["ref"]) == len(aux["cp"]) == 1 and aux["ref"][0] > 0.1, aux
    assert aux["cp"][0] == pytest.approx(aux["ref"][0], rel=1e-3), aux
