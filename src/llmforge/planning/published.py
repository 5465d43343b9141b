"""Published measured training runs as data: the ground truth the step-time model
(:mod:`llmforge.planning.step_model`) is calibrated on (:mod:`llmforge.planning.calibration`).

Every row is a number read in its source (``SOURCES``: repository file at a commit, its date);
the setting is the one the source states, and where it states nothing, the default of the
configuration file the source names (``Run.notes`` says which). No number here is estimated.

GPU kinds: ``H100-96GB-500W`` is the power-limited H100 of Meta's Grand Teton hosts that
torchtitan's benchmarks ran on (96 GB HBM2e, 500 W; "the actual peak TFLOPs number is between
SXM and NVL, and we don't know its exact value"), and torchao's float8 benchmark (its roofline's
H100 is "Meta's H100 variant", 2.4 TB/s); the others are rows of
:data:`llmforge.planning.gpus.GPU_KINDS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Shape and Setting lived here until 2026-12-07: still importable from here, for code that did
from llmforge.planning.setting import CP_MODES, PRECISIONS, Setting, Shape  # noqa: F401


@dataclass(frozen=True)
class Source:
    title: str
    where: str
    date: str


@dataclass(frozen=True)
class Run:
    """A measured run: its setting, tokens/s per GPU as published, where it is read."""

    setting: Setting
    tokens_per_second_per_gpu: float
    source: str
    table: str
    label: str
    notes: str = ""
    memory_gib: Optional[float] = None  # peak memory as published (torchtitan: max over ranks)


LLAMA3_8B = Shape("llama3.1-8b", 32, 4096, 14336, 32, 8, 128256)
LLAMA3_70B = Shape("llama3.1-70b", 80, 8192, 28672, 64, 8, 128256)
LLAMA3_405B = Shape("llama3.1-405b", 126, 16384, 53248, 128, 8, 128256)
# OLMo-core's olmo_{1,7,13}B = llama2_{1,7,13}B shapes (d_model, n_layers, n_heads; FFN
# 8d/3 rounded up to 256), its llama3_8B the Llama 3.1 8B shape; dolma2 tokenizer 100,278
# padded to 100,352
OLMO_1B = Shape("olmo-1b", 18, 2048, 5632, 16, 16, 100352)
OLMO_7B = Shape("olmo-7b", 32, 4096, 11008, 32, 32, 100352)
OLMO_13B = Shape("olmo-13b", 40, 5120, 13824, 40, 40, 100352)
OLMO_LLAMA_8B = Shape("llama3.1-8b-dolma2", 32, 4096, 14336, 32, 8, 100352)

SOURCES: dict[str, Source] = {
    "torchtitan-2024-12": Source(
        "torchtitan benchmarks, Llama 3.1 8B/70B/405B on 8-512 H100 (Tables 1-6)",
        "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md "
        "(torchtitan 9dec370; seq_len, AC, float8 defaults: train_configs/llama3_*.toml there)",
        "2024-12-26"),
    "torchtitan-2024-08-405b": Source(
        "torchtitan performance, Llama 3.1 405B with FSDP 16 x TP 8 on 128 H100 (95 GB, lower TDP)",
        "github.com/pytorch/torchtitan docs/performance.md at 3faaa1a0d (the corrected numbers of "
        "#556; seq_len, compile, float8 all-gather: train_configs/llama3_405b.toml at 9515a140b, "
        "the preset of the table's last row)",
        "2024-08-23"),
    "torchtitan-asynctp-2025-06": Source(
        "torchtitan async TP benchmarks, Llama 3.1 8B on 64 and 70B on 256 H100",
        "github.com/pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md "
        "(torchtitan 820504e; seq_len, float8 all-gather defaults: "
        "torchtitan/models/llama3/train_configs/llama3_*.toml there)",
        "2025-06-14"),
    "trainy-h200-2025-06": Source(
        "Trainy on WhiteFiber, Llama 3.1 8B on 32 and 64 H200 (torchtitan)",
        "github.com/pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md "
        "(torchtitan e7c0cae; seq_len, AC: torchtitan/models/llama3/train_configs/llama3_8b.toml)",
        "2025-06-13"),
    "torchao-float8-2025-03": Source(
        "torchao float8 training benchmarks, Llama 3 8B on 8 H100 (torchtitan, bf16 / tensorwise / rowwise)",
        "github.com/pytorch/ao torchao/float8/README.md at 8c81863 (\"Training benchmarks\": 8 H100, "
        "batch size 1, sequence length 8192, torch.compile, FSDP2, per-op SAC; the recipes' flags: "
        "benchmarks/float8/training/float8_training_benchmark.sh there; the H100 is Meta's 2.4 TB/s "
        "variant: torchao/testing/training/roofline_utils.py's H100 entry)",
        "2025-03-12"),
    "olmo-core-2024-11": Source(
        "OLMo-core throughput table, OLMo 1B/7B/13B and Llama 8B on H100",
        "github.com/allenai/OLMo-core README.md at e27ba74 (micro and global batch sizes, compile: "
        "src/scripts/train/{OLMo-1B,OLMo-7B,Llama-8B,OLMo-13B}.py there; 8 GPUs: the launch "
        "default num_nodes=1, num_gpus=8 of src/olmo_core/internal/experiment.py; dolma2 "
        "tokenizer; float8: Float8Config defaults, dynamic tensorwise with FSDP float8 "
        "all-gather). It supersedes the table of 8c03ca8 (2024-09-26), whose 1B rows (44,000 and "
        "51,000 tokens/s) ran a micro-batch of 4 sequences where this one runs 8",
        "2024-11-05"),
}


def _tt(shape: Shape, world: int, tps: float, table: str, label: str, *, dp_shard: int, lbs: int,
        seq: int = 8192, src: str = "torchtitan-2024-12", gpu: str = "H100-96GB-500W",
        notes: str = "", mem: Optional[float] = None, **kw) -> Run:
    """A torchtitan row: ``lbs`` is the local (per data-parallel rank) batch; with pipeline
    stages it is split into ``pp`` micro-batches (torchtitan's default then)."""
    pp = kw.get("pp", 1)
    mbs = lbs // pp if pp > 1 else lbs
    # torchtitan's TP with tensorwise float8 all-gathers in float8 (its docs/float8.md: "float8
    # all-gather ... for TP (by default for Float8Linear)"; rowwise recipes gather in bf16)
    kw.setdefault("fp8_tp_all_gather", kw.get("precision") == "fp8_tensorwise" and kw.get("tp", 1) > 1)
    s = Setting(shape, gpu, world, dp_shard, lbs * dp_shard, mbs, seq, **kw)
    return Run(s, tps, src, table, label, notes, mem)


_T1 = dict(ac="selective")
_FP8 = dict(compile=True, precision="fp8_tensorwise")
_405 = dict(tp=8, pp=8, ac="full", async_tp=True, fp8_all_gather=True, **_FP8)

RUNS: list[Run] = [
    # torchtitan 2024-12, Table 1: 8B, 8 GPUs, local batch 2, selective (op) AC
    _tt(LLAMA3_8B, 8, 5762, "Table 1", "8B fsdp8", dp_shard=8, lbs=2, mem=82.4, **_T1),
    _tt(LLAMA3_8B, 8, 6667, "Table 1", "8B fsdp8 compile", dp_shard=8, lbs=2, mem=77.0, compile=True, **_T1),
    _tt(LLAMA3_8B, 8, 8532, "Table 1", "8B fsdp8 compile fp8", dp_shard=8, lbs=2, mem=76.8, **_FP8, **_T1),
    # Table 2: 8B, 8 GPUs, FSDP + CP + compile + float8, local batch 1, full AC
    *[_tt(LLAMA3_8B, 8, tps, "Table 2", f"8B fsdp{8 // cp} cp{cp} seq{seq // 1024}k", dp_shard=8 // cp,
          lbs=1, seq=seq, cp=cp, ac="full", mem=mem, cp_mode="ring", **_FP8)
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))],
    # Table 3: 8B, 128 GPUs, local batch 2, selective AC
    _tt(LLAMA3_8B, 128, 5605, "Table 3", "8B fsdp128", dp_shard=128, lbs=2, mem=67.0, **_T1),
    _tt(LLAMA3_8B, 128, 6514, "Table 3", "8B fsdp128 compile", dp_shard=128, lbs=2, mem=62.0, compile=True, **_T1),
    _tt(LLAMA3_8B, 128, 8380, "Table 3", "8B fsdp128 compile fp8", dp_shard=128, lbs=2, mem=61.8, **_FP8, **_T1),
    # Table 4: 70B, 256 GPUs, FSDP 32 TP 8, compile, float8, local batch 16, full AC
    _tt(LLAMA3_70B, 256, 829, "Table 4", "70B fsdp32 tp8 fp8", dp_shard=32, lbs=16, mem=71.9, tp=8, ac="full", **_FP8),
    _tt(LLAMA3_70B, 256, 876, "Table 4", "70B fsdp32 tp8 fp8 asyncTP", dp_shard=32, lbs=16, mem=67.6, tp=8,
        ac="full", async_tp=True, **_FP8),
    # Table 5: 405B, 512 GPUs, FSDP 8 TP 8 PP 8, local batch 32, full AC; 8 micro-batches
    # (torchtitan's default: the pp degree), interleaved: 2 stages per rank (its default split)
    _tt(LLAMA3_405B, 512, 100, "Table 5", "405B fsdp8 tp8 pp8 1f1b", dp_shard=8, lbs=32, mem=82.5, **_405),
    _tt(LLAMA3_405B, 512, 128, "Table 5", "405B fsdp8 tp8 pp8 interleaved", dp_shard=8, lbs=32, mem=72.7,
        schedule="interleaved_1f1b", stages_per_rank=2, **_405),
    # Table 6: 405B, 512 GPUs, TP 8 PP 8 + FSDP x CP, 1F1B, local batch 8, full AC
    *[_tt(LLAMA3_405B, 512, tps, "Table 6", f"405B fsdp{8 // cp} cp{cp} tp8 pp8 seq{seq // 1024}k",
          dp_shard=8 // cp, lbs=8, seq=seq, cp=cp, mem=mem, cp_mode="ring", **_405)
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))],
]

# torchtitan 2024-08, 405B on 128 H100 (16 Grand Teton-like hosts), FSDP 16 x TP 8, local batch 2,
# full AC, compiled (the preset); "None": no float8, no async TP
_T405 = dict(src="torchtitan-2024-08-405b", dp_shard=16, tp=8, lbs=2, ac="full", compile=True)
RUNS += [
    _tt(LLAMA3_405B, 128, 109, "Llama 3.1", "405B fsdp16 tp8", **_T405,
        notes="compile as the config file of the table's last row sets it; the table says 'None' of "
              "the optimizations (float8, async TP)"),
    _tt(LLAMA3_405B, 128, 177, "Llama 3.1", "405B fsdp16 tp8 fp8", precision="fp8_tensorwise",
        fp8_all_gather=True, **_T405),
    _tt(LLAMA3_405B, 128, 185, "Llama 3.1", "405B fsdp16 tp8 fp8 asyncTP", precision="fp8_tensorwise",
        fp8_all_gather=True, async_tp=True, **_T405)]

_ASYNC = "torchtitan-asynctp-2025-06"
for _prec, _v, _a in (("bf16", 597.3, 652.4), ("fp8_tensorwise", 809.8, 942.4), ("fp8_rowwise", 599.6, 624.8)):
    for _async, _tps in ((False, _v), (True, _a)):
        RUNS.append(_tt(LLAMA3_70B, 256, _tps, "70B table", f"70B fsdp32 tp8 {_prec}{' asyncTP' * _async}",
                        dp_shard=32, lbs=16, tp=8, ac="full", compile=True, precision=_prec,
                        async_tp=_async, src=_ASYNC))
for _prec, _v, _a in (("bf16", 4378, 4809.4), ("fp8_tensorwise", 5078.1, 5570.1), ("fp8_rowwise", 3708.5, 3914.9)):
    for _async, _tps in ((False, _v), (True, _a)):
        RUNS.append(_tt(LLAMA3_8B, 64, _tps, "8B table", f"8B fsdp8 tp8 {_prec}{' asyncTP' * _async}",
                        dp_shard=8, lbs=12, tp=8, ac="selective", compile=True, precision=_prec,
                        async_tp=_async, src=_ASYNC))

for _nodes, _tps, _mem in ((4, 10938, 47.96), (8, 10753, 46.97)):
    RUNS.append(_tt(LLAMA3_8B, 8 * _nodes, _tps, "results", f"8B fsdp{8 * _nodes} H200 compile fp8",
                    dp_shard=8 * _nodes, lbs=2, mem=_mem, gpu="H200-141GB", src="trainy-h200-2025-06",
                    ac="selective", compile=True, precision="fp8_tensorwise", fp8_all_gather=True,
                    fp8_recompute_weight=True))


for _prec, _tps, _mem in (("bf16", 6150, 47.65), ("fp8_tensorwise", 7689.5, 47.77), ("fp8_rowwise", 6768, 47.79)):
    _ao = dict(fp8_all_gather=True, fp8_recompute_weight=True) if _prec == "fp8_tensorwise" else {}
    RUNS.append(_tt(LLAMA3_8B, 8, _tps, "Training benchmarks", f"8B fsdp8 {_prec}", dp_shard=8, lbs=1, mem=_mem,
                    src="torchao-float8-2025-03", ac="selective", compile=True, precision=_prec,
                    notes="the README says 8xH100; the kind is inferred: torchao's roofline takes its H100 "
                          "as Meta's variant (2.4 TB/s), the Grand Teton part torchtitan's rows ran on", **_ao))


def _olmo(shape: Shape, tps: float, mbs: int, gbs: int, fp8: bool) -> Run:
    s = Setting(shape, "H100-SXM-80GB", 8, 8, gbs, mbs, 4096, compile=True,
                precision="fp8_tensorwise" if fp8 else "bf16", fp8_all_gather=fp8)
    return Run(s, tps, "olmo-core-2024-11", "Throughput table",
               f"{shape.name.replace('-dolma2', '')} fsdp8 {'fp8' if fp8 else 'bf16'}",
               "8 GPUs is the launch default; the README says 'a cluster with NVIDIA H100 GPUs'")


# (shape, micro-batch, global batch in sequences of 4,096 tokens, bf16 and float8 tokens/s)
for _shape, _mbs, _gbs, _bf16, _fp8 in ((OLMO_1B, 8, 1024, 55000, 65000), (OLMO_7B, 2, 1024, 10000, 13000),
                                        (OLMO_LLAMA_8B, 2, 1024, 9500, 12500), (OLMO_13B, 1, 2048, 4600, 5500)):
    RUNS += [_olmo(_shape, _bf16, _mbs, _gbs, False), _olmo(_shape, _fp8, _mbs, _gbs, True)]


def run_labelled(label: str, source: str = "torchtitan-2024-12") -> Run:
    """The row of ``source`` with ``label``.

    Raises:
        KeyError: no such row.
    """
    for r in RUNS:
        if r.label == label and r.source == source:
            return r
    raise KeyError(f"no published run '{label}' in {source}")


PUBLISHED_LAYOUTS: dict[tuple[str, int], Run] = {
    ("llama3.1-8b", 8): run_labelled("8B fsdp8 compile"),
    ("llama3.1-70b", 256): run_labelled("70B fsdp32 tp8 fp8"),
    ("llama3.1-405b", 512): run_labelled("405B fsdp8 tp8 pp8 interleaved"),
    ("llama3.1-405b", 128): run_labelled("405B fsdp16 tp8 fp8", "torchtitan-2024-08-405b")}
"""The layout torchtitan published as its recipe for each (model, GPU count): 8B on 8 (FSDP 8,
compiled), 70B on 256 (FSDP 32 x TP 8), 405B on 512 (FSDP 8 x TP 8 x PP 8, interleaved), and
405B on 128 (FSDP 16 x TP 8, float8: its 2024-08 ``llama3_405b.toml``, "a preset for 128 H100
GPUs", without the async TP llmforge does not run, as the 70B's is the row without it)."""


LONG_CONTEXT_LAYOUTS: tuple[Run, ...] = tuple(r for r in RUNS if r.table in ("Table 2", "Table 6") and r.setting.cp > 1)
"""torchtitan's context-parallel rows (:func:`published_layout` finds them by length): 8B on 8 H100 with
FSDP x CP 2 / 4 / 8 at 64K / 128K / 256K tokens, 405B on 512 with TP 8 x PP 8 x CP."""


def same_model(a: Shape, b: Shape) -> bool:
    """Whether ``a`` and ``b`` are one model: depth, widths, heads, head width, vocabulary and
    tied embeddings equal (the names may differ: an llmforge preset and a published shape)."""
    def key(s: Shape) -> tuple:
        return s.n_layers, s.dim, s.ffn_dim, s.n_heads, s.n_kv_heads, s.head_dim, s.vocab_size, s.tie_embeddings

    return key(a) == key(b)


def published_layout(shape: Shape, world: int, seq_len: int) -> Optional[Run]:
    """The published recipe (:data:`PUBLISHED_LAYOUTS`, :data:`LONG_CONTEXT_LAYOUTS`) for the
    model of ``shape`` on ``world`` GPUs at ``seq_len`` tokens per sequence, or ``None``: its
    measured tokens/s measures that model at that length only, so a config with another depth,
    width, vocabulary or sequence length gets none."""
    for run in (*LONG_CONTEXT_LAYOUTS, *PUBLISHED_LAYOUTS.values()):
        s = run.setting
        if s.world == world and s.seq_len == seq_len and same_model(s.shape, shape):
            return run
    return None


NEAR_SIZE = 2.0
"""A published run informs a layout of a model whose parameter count is within this factor of
its own (:func:`unmeasured_degrees`)."""


def unmeasured_degrees(shape: Shape, tp: int, pp: int, cp: int, dp_replicate: int = 1) -> str:
    """``""`` when a published run of a model within :data:`NEAR_SIZE` x of ``shape``'s
    parameters used these ``tp``, ``pp`` and ``cp`` degrees (and replicas: ``dp_replicate``,
    which no published run uses); else one sentence saying that the step-time model
    extrapolates there, and which degrees such runs did use (none: no published run of that
    size at all). The held-out error is measured on published layouts only, so a prediction at
    degrees no run of that size used is less certain than it states."""
    near = [r.setting for r in RUNS if shape.params / NEAR_SIZE <= r.setting.shape.params <= shape.params * NEAR_SIZE]
    if any((s.tp, s.pp, s.cp, s.dp_replicate) == (tp, pp, cp, dp_replicate) for s in near):
        return ""
    n = shape.params
    size = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"
    if not near:
        return f"no published run of a model within {NEAR_SIZE:g}x of its {size} parameters: extrapolated"
    cps: dict[tuple[int, int], list[int]] = {}
    for t, p, c in sorted({(s.tp, s.pp, s.cp) for s in near}):
        cps.setdefault((t, p), []).append(c)

    def degrees(t: int, p: int, c: list[int]) -> str:
        return f"tp {t} x pp {p}" + (f" x cp {'/'.join(map(str, c))}" if c != [1] else "")

    said = "; ".join(degrees(t, p, c) for (t, p), c in cps.items())
    replicas = f"dp_replicate {dp_replicate} x " if dp_replicate > 1 else ""
    return (f"no published run of a model within {NEAR_SIZE:g}x of its {size} parameters used "
            f"{replicas}{degrees(tp, pp, [cp])} (they used {said}{', none with replicas' * bool(replicas)}): "
            "extrapolated, "
            "less certain than the model's held-out error")
