"""Algorithms in training: same losses as eager (compile, activation checkpointing, both; one
process in-process, FSDP2 on 2 processes through the CLI), float8 close to bf16, FP8 all-gather
equal to FP8 without it, and YAML order without effect on the losses.

Compilation dominates the time: each distinct graph compiles once per process, and inductor's
on-disk FX graph cache makes identical graphs in later processes cheap, so the shapes are kept
equal across tests where possible (dim 64, 2 blocks, seq 32, micro-batch 2).
"""

import json
import textwrap
from pathlib import Path

import pytest
import torch

from algo_harness import train_losses
from conftest import DEMO, REPO, TINY_OVERRIDES, run_cli

AC_MODES = {
    "full": {"name": "activation_checkpointing"},
    "layer": {"name": "activation_checkpointing", "mode": "selective", "selective": "layer", "every": 2},
    "op": {"name": "activation_checkpointing", "mode": "selective", "selective": "op"},
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def eager_losses():
    return train_losses([])


@pytest.mark.parametrize("mode", sorted(AC_MODES))
def test_activation_checkpointing_same_losses_as_eager(eager_losses, mode):
    assert train_losses([AC_MODES[mode]]) == pytest.approx(eager_losses, abs=1e-5)


@pytest.mark.slow
def test_compile_and_compile_with_checkpointing_same_losses_as_eager(eager_losses):
    assert train_losses([{"name": "compile"}]) == pytest.approx(eager_losses, abs=1e-5)
    torch._dynamo.reset()
    got = train_losses([AC_MODES["op"], {"name": "compile"}])
    assert got == pytest.approx(eager_losses, abs=1e-5)


@pytest.mark.slow
def test_yaml_order_does_not_change_the_losses():
    entries = [{"name": "compile"}, {"name": "float8"}, AC_MODES["full"]]
    a = train_losses(entries, steps=3)
    torch._dynamo.reset()
    b = train_losses(list(reversed(entries)), steps=3)
    assert a == b


@pytest.mark.slow
def test_float8_losses_within_2_percent_of_bf16():
    bf16 = train_losses([], steps=10, dtype=torch.bfloat16)
    fp8 = train_losses([{"name": "float8"}], steps=10, dtype=torch.bfloat16)
    assert bf16[-1] < bf16[0] - 0.5  # it learns: the comparison means something
    for step, (a, b) in enumerate(zip(fp8, bf16)):
        assert abs(a - b) <= 0.02 * b, (step, a, b)


# --------------------------------------------------------------------- multi-process, CLI
COMMON = [*TINY_OVERRIDES, "variables.seq_len=32", "trainer.global_batch_size=8",
          "trainer.micro_batch_size=2", "trainer.max_steps=5", "trainer.log_every=1",
          "trainer.eval_every=0", "data.val_fraction=0", "data.max_documents=2"]

PROBE = '''
import json
from lightning.pytorch.callbacks import Callback


class Probe(Callback):
    """Writes the type of every parameter's local shard (rank 0, end of training)."""

    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            types = {n: [type(p).__name__, type(getattr(p, "_local_tensor", p)).__name__]
                     for n, p in pl_module.model.named_parameters()}
            with open(self.out, "w") as f:
                json.dump(types, f)
'''


def cli_run(out: Path, name: str, *extra: str, nproc: int = 1, save: bool = False):
    args = ["train", DEMO, *COMMON, *extra, f"run.output_dir={out}", f"run.name={name}",
            f"checkpoint.save_final={str(save).lower()}"]
    if nproc > 1:
        args += ["--nproc", str(nproc), "strategy.name=fsdp2"]
    proc = run_cli(*args, cwd=out, timeout=900)
    assert proc.returncode == 0, (name, proc.stderr[-4000:])
    records = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    return proc, records


def losses(records):
    return [r["train/loss"] for r in records if "train/loss" in r]


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("algos")
    (out / "f8probe.py").write_text(textwrap.dedent(PROBE))
    return out


@pytest.mark.slow
def test_compile_and_checkpointing_under_fsdp2_same_losses_as_eager(cli_dir):
    from llmforge.checkpoint.run_dir import load_for_inference

    _, ref = cli_run(cli_dir, "eager", save=True)
    algos = ("algorithms=[{name: compile, compile_loss: true}, "
             "{name: activation_checkpointing, mode: selective, selective: op}]")
    proc, got = cli_run(cli_dir, "fsdp2_compile_ac", algos, nproc=2, save=True)
    assert len(losses(ref)) == 5
    assert losses(got) == pytest.approx(losses(ref), abs=1e-5)
    # the checkpoint has the plain model's keys (no wrapper or compile prefixes)
    ref_w = load_for_inference(cli_dir / "eager")[0].state_dict()
    got_w = load_for_inference(cli_dir / "fsdp2_compile_ac")[0].state_dict()
    assert list(got_w) == list(ref_w)
    for k in ref_w:
        torch.testing.assert_close(got_w[k], ref_w[k], atol=1e-4, rtol=0, msg=k)
    # compile time: one line on rank 0, one metric in the records
    assert proc.stdout.count("compile: ") == 1 and "s of compilation in the first step" in proc.stdout
    logged = [r["time/compile_seconds"] for r in got if "time/compile_seconds" in r]
    assert len(logged) == 1 and logged[0] > 0


@pytest.mark.slow
def test_fp8_all_gather_under_fsdp2_same_losses_and_float8_shards(cli_dir):
    _, plain = cli_run(cli_dir, "fsdp2_fp8", "algorithms=[{name: float8}]", nproc=2)
    probe = cli_dir / "types.json"
    proc, gathered = cli_run(
        cli_dir, "fsdp2_fp8_all_gather",
        "algorithms=[{name: float8, enable_fsdp_float8_all_gather: true}]",
        f"callbacks=[{{name: f8probe.Probe, out: '{probe}'}}]", nproc=2, save=True)
    assert losses(gathered) == pytest.approx(losses(plain), abs=1e-4)
    # the checkpoint holds plain tensors: it loads without torchao's classes (weights_only)
    from llmforge.checkpoint.run_dir import load_for_inference

    model = load_for_inference(cli_dir / "fsdp2_fp8_all_gather")[0]
    assert type(model.layers[0].attention.wq.weight.data) is torch.Tensor
    assert "float8: 14 Linear layers in FP8 (tensorwise, FP8 all-gather), 1 kept" in proc.stdout
    types = json.loads(probe.read_text())
    assert types["layers.0.attention.wq.weight"] == ["DTensor", "WeightWithDynamicFloat8CastTensor"]
    assert types["layers.1.feed_forward.w2.weight"][1] == "WeightWithDynamicFloat8CastTensor"
    assert types["output.weight"] == ["DTensor", "Tensor"]  # kept in high precision

