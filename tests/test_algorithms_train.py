"""Algorithms in training: same losses as eager (compile, activation checkpointing, both; one
process in-process, FSDP2 on 2 processes: `llmforge train` in one torchrun launch), float8 close
to bf16, FP8 all-gather equal to FP8 without it, and YAML order without effect on the losses.

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
from conftest import DEMO, TINY_OVERRIDES
from helpers.dist import torchrun, worker

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


# gloo has no float8 collectives ("Invalid scalar type"; NCCL has): this test-only callback makes
# torchao's float8 all-gather send the same bytes as uint8 on the real gloo group, waiting at
# once, and counts the gathers by float8 dtype
GATHERED = {}


def _gather_bytes(aten_op, args, kwargs=None):
    import torch
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    t = args[0]
    data = t._data.contiguous()
    out = torch.ops._c10d_functional.wait_tensor(aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {})))
    GATHERED[str(data.dtype)] = GATHERED.get(str(data.dtype), 0) + 1
    return Float8TrainingTensor(out.view(data.dtype), t._scale, t._orig_dtype, t._linear_mm_config,
                                t._gemm_input_role)


class GlooFloat8(Callback):
    def __init__(self, out):
        import torch
        from torchao.float8 import float8_ops

        self.out = out
        GATHERED.clear()
        for op in (torch.ops.c10d_functional.all_gather_into_tensor.default,
                   torch.ops._c10d_functional.all_gather_into_tensor.default):
            float8_ops.FLOAT8_OPS_TABLE[op] = _gather_bytes

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                json.dump(GATHERED, f)
'''


def losses(records):
    return [r["train/loss"] for r in records if "train/loss" in r]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# every FSDP2 run of this file, in ONE 2-process torchrun launch (tests/dist/train_worker.py runs
# them in sequence from the launch's folder: f8probe.py is importable there); compile
# last, so the runs before it start without dynamo state, as in a fresh process
_TP = ["strategy.tp=2", "callbacks=[{name: f8probe.GlooFloat8, out: gathered_{name}.json}]"]
FSDP2_RUNS = {
    "fsdp2_fp8": ["algorithms=[{name: float8}]"],
    # tensor parallel over both ranks: float8's TP all-gathers in FP8 (its default) or in bf16
    "tp2_fp8": ["algorithms=[{name: float8}]", *_TP],
    "tp2_fp8_bf16_gathers": ["algorithms=[{name: float8, enable_tp_float8_all_gather: false}]", *_TP],
    "fsdp2_fp8_all_gather": ["algorithms=[{name: float8, enable_fsdp_float8_all_gather: true}]",
                             "callbacks=[{name: f8probe.Probe, out: types.json}]", "checkpoint.save_final=true"],
    "fsdp2_compile_ac": ["algorithms=[{name: compile, compile_loss: true}, "
                         "{name: activation_checkpointing, mode: selective, selective: op}]",
                         "checkpoint.save_final=true"],
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The runs' folder and each rank's report (exit code, stdout, stderr) by run name; the
    one-process eager reference runs in this process."""
    from llmforge.cli import main

    out = tmp_path_factory.mktemp("algos")
    (out / "f8probe.py").write_text(textwrap.dedent(PROBE))
    base = ["train", DEMO, *COMMON, f"run.output_dir={out}", "checkpoint.save_final=false"]
    assert main([*base, "run.name=eager", "checkpoint.save_final=true"]) == 0
    runs = {name: [*base, f"run.name={name}", "strategy.name=fsdp2", *(e.replace("{name}", name) for e in extra)]
            for name, extra in FSDP2_RUNS.items()}
    (out / "runs.json").write_text(json.dumps(runs))
    proc = torchrun(worker("train_worker.py"), str(out), str(out / "runs.json"), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_compile_and_checkpointing_under_fsdp2_same_losses_as_eager(cli_runs):
    from llmforge.checkpoint.run_dir import load_for_inference

    out, reports = cli_runs
    ref, got = records(out / "eager"), records(out / "fsdp2_compile_ac")
    assert len(losses(ref)) == 5
    assert losses(got) == pytest.approx(losses(ref), abs=1e-5)
    # the checkpoint has the plain model's keys (no wrapper or compile prefixes)
    ref_w = load_for_inference(out / "eager")[0].state_dict()
    got_w = load_for_inference(out / "fsdp2_compile_ac")[0].state_dict()
    assert list(got_w) == list(ref_w)
    for k in ref_w:
        torch.testing.assert_close(got_w[k], ref_w[k], atol=1e-4, rtol=0, msg=k)
    # compile time: one line on rank 0 (none on rank 1), one metric in the records
    stdout = [rank["fsdp2_compile_ac"]["stdout"] for rank in reports]
    assert [s.count("compile: ") for s in stdout] == [1, 0]
    assert "s of compilation in the first step" in stdout[0]
    logged = [r["time/compile_seconds"] for r in got if "time/compile_seconds" in r]
    assert len(logged) == 1 and logged[0] > 0


@pytest.mark.slow
def test_fp8_all_gather_under_fsdp2_same_losses_and_float8_shards(cli_runs):
    out, reports = cli_runs
    plain, gathered = records(out / "fsdp2_fp8"), records(out / "fsdp2_fp8_all_gather")
    assert losses(gathered) == pytest.approx(losses(plain), abs=1e-4)
    # the checkpoint holds plain tensors: it loads without torchao's classes (weights_only)
    from llmforge.checkpoint.run_dir import load_for_inference

    model = load_for_inference(out / "fsdp2_fp8_all_gather")[0]
    assert type(model.layers[0].attention.wq.weight.data) is torch.Tensor
    stdout = reports[0]["fsdp2_fp8_all_gather"]["stdout"]
    assert "float8: 14 Linear layers in FP8 (tensorwise, FP8 all-gather), 1 kept" in stdout
    types = json.loads((out / "types.json").read_text())
    assert types["layers.0.attention.wq.weight"] == ["DTensor", "WeightWithDynamicFloat8CastTensor"]
    assert types["layers.1.feed_forward.w2.weight"][1] == "WeightWithDynamicFloat8CastTensor"
    assert types["output.weight"] == ["DTensor", "Tensor"]  # kept in high precision


@pytest.mark.slow
def test_float8_tensor_parallel_gathers_in_fp8_with_the_same_losses(cli_runs):
    """TP 2 with float8 (tensorwise): the sequence-parallel all-gathers of the block inputs (e4m3)
    and of the output gradients (e5m2) move float8, as torchtitan's; the cast before the gather
    uses the whole tensor's scale, so the losses equal those of bf16 gathers."""
    out, reports = cli_runs
    fp8, bf16 = records(out / "tp2_fp8"), records(out / "tp2_fp8_bf16_gathers")
    assert len(losses(fp8)) == 5 and losses(fp8) == pytest.approx(losses(bf16), abs=1e-6)
    # per block and micro-batch: attention's and the feed-forward's inputs, wo's and w2's output
    # gradients; 2 blocks x 4 micro-batches (8 sequences of 2 on one data-parallel rank) x 5 steps
    assert json.loads((out / "gathered_tp2_fp8.json").read_text()) == {
        "torch.float8_e4m3fn": 2 * 2 * 4 * 5, "torch.float8_e5m2": 2 * 2 * 4 * 5}
    assert json.loads((out / "gathered_tp2_fp8_bf16_gathers.json").read_text()) == {}
    assert "(tensorwise, FP8 TP all-gather)" in reports[0]["tp2_fp8"]["stdout"]
    assert "(tensorwise), 1 kept" in reports[0]["tp2_fp8_bf16_gathers"]["stdout"]
