"""torch.compile on the CPU: median training-step time, eager vs compiled per block vs whole model.

    python benchmarks/compile_cpu.py            # the demo model (yamls/demo_cpu.yaml), a few minutes
    python benchmarks/compile_cpu.py --smoke    # tiny shapes, keeps the script runnable (tests)

    python benchmarks/compile_cpu.py --first-step-only   # only the time-to-first-step table

Each variant builds the same model (same seed), applies llmforge's ``compile`` algorithm (or
nothing), and runs ``--steps`` AdamW steps (forward, cross-entropy, backward, step) on fixed random
tokens of the demo's batch shape (micro-batch 8 x seq 256, fp32). The first step is timed on its
own: its excess over the median of the other steps is the compile time, reported separately; the
median excludes it. Losses of all variants are compared to eager (same numbers expected within
~1e-5). Prints a markdown table and writes it to ``benchmarks/results/compile_cpu-<date>.md``.

Then the time to first step (issue 50) of the default ``compile``, ``float8`` (tensorwise) +
``activation_checkpointing`` (full) + ``compile``, and the same with ``per_block: true``, side by
side: each in a fresh subprocess with an empty inductor cache (what a user's first run pays),
two steps; the table gives the first step (compilation included), the second, the number of
C++ kernels inductor compiled (independent of the machine's load, unlike the seconds), and the
recompiles and graph breaks dynamo counted. Written to ``compile_cpu-first-step-<date>.md``.
Where the slow path's time goes (issue 50): no recompile and no graph break; nearly all of it is
inductor's C++ kernels, one g++ run of seconds each (tens at a load of 8-12 on 2 cores): float8
adds the amax / scale / cast kernels of every Linear's inputs, weights and output gradients, and
full checkpointing recomputes the forward inside the backward graph (demo: 47 kernels against
26). The complex-valued RoPE ran eager between the kernels (51 complex-op fallbacks in the demo's
backward); under compile it is real-valued now.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

VARIANTS = {"eager": None, "compile per block": {"per_block": True},
            "compile whole model": {"per_block": False}}


def build_model(smoke: bool):
    import torch

    from llmforge import registry
    from llmforge.config import load_config

    # smoke: the shapes of tests/algo_harness.py, so inductor's cache serves both in the suite
    over = (["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
             "model.multiple_of=32", "tokenizer.vocab_size=256", "variables.seq_len=32",
             "trainer.micro_batch_size=2", "trainer.global_batch_size=4"] if smoke else [])
    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml", over)
    torch.manual_seed(cfg.run.seed)
    model = registry.models.get(cfg.model.name)(cfg.model)
    return model, cfg


FIRST_STEP = {
    "compile": [{"name": "compile"}],
    "float8 + full AC + compile": [{"name": "float8"}, {"name": "activation_checkpointing"},
                                   {"name": "compile"}],
    "float8 + full AC + compile per_block": [{"name": "float8"}, {"name": "activation_checkpointing"},
                                             {"name": "compile", "per_block": True}],
}


def first_step_child(name: str, smoke: bool) -> int:
    """One :data:`FIRST_STEP` variant, two steps; prints ``RESULT first second``."""
    import torch
    import torch.nn.functional as F

    from llmforge.algorithms import ActivationCheckpointing, Compile, Float8

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the smoke run calls this after other variants
    start = time.perf_counter()
    model, cfg = build_model(smoke)
    for entry in FIRST_STEP[name]:  # the pipeline's stage order: float8, checkpointing, compile
        kw = {k: v for k, v in entry.items() if k != "name"}
        if smoke and entry["name"] == "compile":
            kw["backend"] = "eager"  # the smoke run checks the script, not inductor's C++
        algo = {"float8": Float8, "activation_checkpointing": ActivationCheckpointing,
                "compile": Compile}[entry["name"]](**kw)
        model = algo.apply(model, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batch, seq = cfg.trainer.micro_batch_size, cfg.trainer.seq_len
    data = torch.randint(0, model.vocab_size, (batch, seq + 1), generator=g)
    times = []
    for _ in range(2):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
    counters = torch._dynamo.utils.counters
    print(f"RESULT {times[0]:.2f} {times[1]:.3f} {sum(counters['recompiles'].values())} "
          f"{sum(counters['graph_break'].values())}", flush=True)
    return 0


def first_step_table(smoke: bool) -> list[str]:
    """Markdown rows: each :data:`FIRST_STEP` variant in its own process and inductor cache
    (``smoke``: only the float8 one, in this process with dynamo's ``eager`` backend, to keep
    the suite short)."""
    import contextlib
    import io
    import subprocess

    lines = ["| variant | first step (s) | second step (s) | C++ kernels compiled | recompiles "
             "| graph breaks |", "| --- | --- | --- | --- | --- | --- |"]
    for name in (["float8 + full AC + compile"] if smoke else FIRST_STEP):
        if smoke:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = first_step_child(name, smoke)
            proc = subprocess.CompletedProcess([], code, out.getvalue(), "")
            kernels = 0
        else:
            proc, kernels = first_step_process(name)
        got = [ln.split()[1:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not got:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            lines.append(f"| {name} | failed (exit {proc.returncode}: {tail}) | | | | |")
            continue
        first, second, recompiles, breaks = got[0]
        lines.append(f"| {name} | {float(first):.1f} | {float(second):.3f} | {kernels} | "
                     f"{recompiles} | {breaks} |")
        print(lines[-1], flush=True)
    return lines


def first_step_process(name: str):
    """Run :func:`first_step_child` for ``name`` in a fresh process with an empty inductor
    cache; returns the ``CompletedProcess`` and the number of C++ kernels compiled."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="llmforge-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        proc = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                              capture_output=True, text=True)
        return proc, sum(1 for _ in Path(cache).rglob("*.cpp"))


def run_variant(name: str, kwargs, smoke: bool, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from llmforge.algorithms import Compile

    torch._dynamo.reset()
    model, cfg = build_model(smoke)
    if kwargs is not None:
        model = Compile(**kwargs).apply(model, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batch, seq = cfg.trainer.micro_batch_size, cfg.trainer.seq_len
    data = torch.randint(0, model.vocab_size, (batch, seq + 1), generator=g)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    median = statistics.median(times[1:])
    return {"variant": name, "compile_s": max(0.0, times[0] - median) if kwargs else 0.0,
            "median_step_s": median, "tokens_per_s": batch * seq / median, "losses": losses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 3 steps")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant (default 30)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--first-step-only", action="store_true",
                    help="only the time-to-first-step table (issue 50)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    if args.child:
        return first_step_child(args.child, args.smoke)
    import torch

    steps = args.steps or (3 if args.smoke else 30)
    lines = [f"compile_cpu{' --smoke' if args.smoke else ''}: {dt.date.today().isoformat()}, "
             f"torch {torch.__version__}, {os.cpu_count()} CPUs "
             f"({platform.processor() or platform.machine()}), threads {torch.get_num_threads()}, "
             f"load average {os.getloadavg()[0]:.1f} at the start", ""]
    if not args.first_step_only:
        rows = [run_variant(name, kw, args.smoke, steps) for name, kw in VARIANTS.items()]
        eager = rows[0]
        lines += [f"{steps} steps per variant", "",
                  "| variant | compile (s) | median step (s) | tokens/s | vs eager | max loss diff |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            diff = max(abs(a - b) for a, b in zip(r["losses"], eager["losses"]))
            lines.append(f"| {r['variant']} | {r['compile_s']:.1f} | {r['median_step_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} | {eager['median_step_s'] / r['median_step_s']:.2f}x | "
                         f"{diff:.1e} |")
        lines.append("")
    lines += ["Time to first step (fresh process, empty inductor cache, compilation included):", ""]
    lines += first_step_table(args.smoke)
    lines.append(f"load average {os.getloadavg()[0]:.1f} at the end")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = "smoke" if args.smoke else dt.date.today().isoformat()
    part = "first-step-" if args.first_step_only else ""
    (out / f"compile_cpu-{part}{stamp}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
