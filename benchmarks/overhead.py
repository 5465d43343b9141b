"""llmforge against a bare PyTorch loop: same model, data, batch, optimizer, precision, steps.

    python benchmarks/overhead.py                 # demo model, 5 interleaved pairs after a warm-up pair
    python benchmarks/overhead.py --small         # a model ~10x smaller (per-step overhead shows first)
    python benchmarks/overhead.py --compile       # llmforge with its `compile` algorithm vs the bare eager loop
    python benchmarks/overhead.py --compile --compile-entry '{name: compile, per_block: false, compile_loss: true}'
    python benchmarks/overhead.py --paired-steps  # one process, a bare step after each llmforge step
    python benchmarks/overhead.py --smoke         # tiny, for the test suite

(a) the bare loop, written here: forward, cross-entropy, backward, clip, AdamW step, zero_grad,
nothing else; (b) ``llmforge`` (``Trainer.fit`` with its default callbacks and the jsonl logger).
Each run is a fresh subprocess (so peak RSS is its own); runs alternate a b a b ...; each
measures tokens/s over the steps after the first ``--warmup`` ones. Prints the median tokens/s
of each, the ratio b/a with its spread (min-max of the per-pair ratios) and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

DEMO = REPO / "yamls" / "demo_cpu.yaml"
SMALL = ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.multiple_of=64"]
SMOKE = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.multiple_of=32", "tokenizer.vocab_size=1024", "variables.seq_len=64"]


def config(overrides: list[str], steps: int, work: Path):
    from llmforge import load_config

    return load_config(DEMO, [*overrides, f"trainer.max_steps={steps}", "trainer.eval_every=0",
                              "trainer.progress_bar=false", "scheduler.warmup_steps=1",
                              f"run.output_dir={work}", "checkpoint.save_final=false",
                              "data.num_workers=0"])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def side_by_side_barrier(timeout_s: float = 1800) -> None:
    """``peers.py --side-by-side``: after its last warm-up step, a run waits here until the run
    beside it has finished its warm-up too (a file each in ``$PEERS_BARRIER``; the parent adds
    one when a run ends early), so that both timed windows start together and neither times its
    steps against the other's compilation. Does nothing when ``$PEERS_BARRIER`` is unset."""
    folder = os.environ.get("PEERS_BARRIER")
    if not folder:
        return
    Path(folder, f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)


class Turns:
    """``peers.py --alternate``: two runs started together take turns, one optimizer step
    each, so that every timed step has the machine to itself and both runs see the same
    machine, step by step (the host's drift of minutes cancels; side by side, the two runs
    share the cache and the memory bus instead). The turn is a byte passed through two FIFOs
    in ``$PEERS_TURNS`` (``turn-0``, ``turn-1``, made by the parent): role
    ``$PEERS_TURN_ROLE`` (0 or 1) reads its own and writes the other's; role 0 takes the first
    timed step. A run's time is the sum of its turns: from getting the turn to the end of its
    step (:meth:`step_end`), all the trainer's work between two step ends included. A blocked
    read costs no CPU. The parent writes a stream of bytes into both FIFOs when either run
    ends, so the other never waits for a run that died; a wait longer than ``timeout_s`` (the
    parent died too) raises. After getting the turn, a run sleeps ``SETTLE_S`` before its clock
    starts: the other run's idle OpenMP threads spin for about 10 ms after its last parallel
    region (libgomp's default wait policy), and the step would share the cores with them.
    Inactive (no waiting, no time) when ``$PEERS_TURNS`` is unset."""

    SETTLE_S = 0.03

    def __init__(self, timeout_s: float = 1800) -> None:
        self.timeout_s = timeout_s
        folder = os.environ.get("PEERS_TURNS")
        self.active = bool(folder)
        self.seconds = 0.0  # the sum of this run's timed turns
        self.turns = 0
        self._start: float | None = None
        if folder:
            self.role = int(os.environ.get("PEERS_TURN_ROLE", "0"))
            # O_RDWR: opening a FIFO does not block waiting for the other end (Linux)
            self._in = os.open(Path(folder, f"turn-{self.role}"), os.O_RDWR)
            self._out = os.open(Path(folder, f"turn-{1 - self.role}"), os.O_RDWR)

    def begin(self) -> None:
        """After the warm-up (and :func:`side_by_side_barrier`): role 1 waits for role 0's
        first timed step; the first timed turn starts."""
        if self.active:
            if self.role == 1:
                self._wait()
            time.sleep(self.SETTLE_S)
            self._start = time.perf_counter()

    def _wait(self) -> None:
        """Block until the turn comes (a byte in this run's FIFO), at most ``timeout_s``.

        Raises:
            TimeoutError: no turn within ``timeout_s`` seconds."""
        ready, _, _ = select.select([self._in], [], [], self.timeout_s)
        if not ready:
            raise TimeoutError(f"no turn from the run beside this one in {self.timeout_s:.0f} s")
        os.read(self._in, 1)

    def after_step(self, step: int, warmup: int, steps: int) -> None:
        """At the end of optimizer step ``step`` (1-based) of ``steps``: after the last warm-up
        step, :func:`side_by_side_barrier` and the first turn (:meth:`begin`); after a timed
        one, :meth:`step_end`. A clock marks the time after this call."""
        if step == warmup:
            side_by_side_barrier()
            self.begin()
        elif step > warmup:
            self.step_end(last=step == steps)

    def timed(self, steps: int) -> float:
        """The seconds of this run's timed turns, after checking that there were ``steps``.

        Raises:
            RuntimeError: a different number of timed turns (the steps did not alternate)."""
        if self.turns != steps:
            raise RuntimeError(f"expected {steps} timed turns, counted {self.turns}")
        return self.seconds

    def step_end(self, last: bool) -> None:
        """At the end of a timed step: count the turn's time, hand the turn over and (but
        after role 1's last step, which nobody follows) wait for it to come back."""
        if not self.active or self._start is None:
            return
        self.seconds += time.perf_counter() - self._start
        self.turns += 1
        os.write(self._out, b"t")
        if not (last and self.role == 1):
            self._wait()
            time.sleep(self.SETTLE_S)
        self._start = time.perf_counter()


def worker_llmforge(overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    from lightning.pytorch.callbacks import Callback

    from llmforge import Trainer

    marks: dict[int, float] = {}
    turns = Turns()

    class Clock(Callback):  # wall time at the end of each step: the same span as the bare loop
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            turns.after_step(trainer.global_step, warmup, steps)
            marks[trainer.global_step] = time.perf_counter()

    trainer = Trainer(config(overrides, steps, work), overwrite=True)
    trainer.setup()
    trainer.lightning.callbacks.append(Clock())
    trainer.lightning.fit(trainer.module, datamodule=trainer.datamodule)
    seconds = turns.timed(steps - warmup) if turns.active else marks[steps] - marks[warmup]
    records = [json.loads(x) for x in (Path(trainer.cfg.run.output_dir) / trainer.cfg.run.name /
                                       "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > warmup and "time/step_seconds" in r]
    data_share = (sum(r["time/data_seconds"] for r in timed) / sum(r["time/step_seconds"] for r in timed)
                  if timed else float("nan"))
    return {"tokens_per_second": (steps - warmup) * trainer.plan.tokens_per_step / seconds,
            "data_share": data_share}


def bare_step(model, opt, batch, mb: int, accum: int, clip: float) -> None:
    """One optimizer step of the bare loop on windows ``batch`` ``[accum * mb, seq_len + 1]``:
    forward, cross-entropy (sum / targets of the step), backward per micro-batch; clip; AdamW
    step; zero_grad. Nothing else."""
    import torch
    import torch.nn.functional as F

    inputs, labels = batch[:, :-1], batch[:, 1:]
    n_targets = labels.numel()
    for i in range(accum):
        logits = model(inputs[i * mb:(i + 1) * mb])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[i * mb:(i + 1) * mb].flatten(),
                               reduction="sum") / n_targets
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker_bare(overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    """The bare loop: data prepared with llmforge's loader code outside the timed steps."""
    import torch

    from llmforge import registry
    from llmforge.config import validate
    from llmforge.data.datamodule import tokenize_documents
    from llmforge.data.packing import PackedWindows, ShardedSampler
    from llmforge.data.shakespeare import cache_root
    from llmforge.data.sources import iter_texts, load_documents
    from llmforge.data.tokenizers import build_tokenizer
    from llmforge.training.optim import build_optimizer

    cfg = config(overrides, steps, work)
    plan = validate(cfg, 1)
    if os.environ.get("BARE_MALLOC_TUNING") == "1":  # --bare-malloc-tuning: llmforge's allocator settings
        from llmforge.host_malloc import tune_host_malloc

        tune_host_malloc()
    torch.manual_seed(cfg.run.seed)
    docs = load_documents(cfg.data, cfg.run.seed)
    tok = build_tokenizer(cfg.tokenizer, lambda: iter_texts(docs.train, cfg.tokenizer.train_max_bytes),
                          cache_dir=cache_root() / "tokenizers", fingerprint=docs.fingerprint)
    windows = PackedWindows(tokenize_documents(docs.train, tok), cfg.trainer.seq_len)
    order = iter(ShardedSampler(len(windows), seed=cfg.run.seed, local_batch=plan.local_batch_size))
    model = registry.models.get(cfg.model.name)(cfg.model)
    model.init_weights()
    opt = build_optimizer(model, cfg.optimizer)
    mb, accum = plan.micro_batch_size, plan.gradient_accumulation_steps
    timed, start = 0, 0.0
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        batch = torch.stack([windows[next(order)] for _ in range(plan.local_batch_size)])
        bare_step(model, opt, batch, mb, accum, cfg.trainer.gradient_clip_val)
        timed += step >= warmup
    seconds = time.perf_counter() - start
    return {"tokens_per_second": timed * plan.tokens_per_step / seconds}


def worker_paired(overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    """Both in one process, step by step: after each llmforge step, a callback runs one step of
    the bare loop on its own copy of the model with the same batch. llmforge's step is the time
    from the end of that bare step to the end of llmforge's next step (Lightning's loop, data,
    callbacks, logging included); machine drift hits both alike, so the per-step ratio is far
    less noisy than ratios of separate runs (but both share caches and the allocator)."""
    from lightning.pytorch.callbacks import Callback

    from llmforge import Trainer, registry
    from llmforge.training.optim import build_optimizer

    trainer = Trainer(config(overrides, steps, work), overwrite=True)
    trainer.setup()
    cfg, plan = trainer.cfg, trainer.plan
    model = registry.models.get(cfg.model.name)(cfg.model)
    model.init_weights()
    opt = build_optimizer(model, cfg.optimizer)
    mb, accum = plan.micro_batch_size, plan.gradient_accumulation_steps
    rows: list[tuple[float, float]] = []

    class BareStep(Callback):
        end: float | None = None

        def on_train_batch_end(self, trainer_, pl_module, outputs, batch, batch_idx):
            start = time.perf_counter()
            bare_step(model, opt, batch, mb, accum, cfg.trainer.gradient_clip_val)
            end = time.perf_counter()
            if self.end is not None and trainer_.global_step > warmup:
                rows.append((start - self.end, end - start))  # (llmforge step, bare step)
            self.end = end

    trainer.lightning.callbacks.insert(0, BareStep())  # first: right at the end of the step
    trainer.lightning.fit(trainer.module, datamodule=trainer.datamodule)
    ratios = sorted(b / a for a, b in rows)
    return {"llmforge_step_s": statistics.median(a for a, _ in rows),
            "bare_step_s": statistics.median(b for _, b in rows), "steps": len(rows),
            "ratio_median": statistics.median(ratios), "ratio_p10": ratios[len(ratios) // 10],
            "ratio_p90": ratios[(9 * len(ratios)) // 10], "ratio_sum": sum(b for _, b in rows) / sum(a for a, _ in rows)}


def run_worker(kind: str, overrides: list[str], steps: int, warmup: int, bare_malloc: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--steps", str(steps), "--warmup", str(warmup),
           "--overrides", json.dumps(overrides)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src"),
                               "BARE_MALLOC_TUNING": "1" if bare_malloc else "0"})
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a model ~10x smaller than the demo")
    ap.add_argument("--compile", action="store_true", help="llmforge with algorithms=[compile]")
    ap.add_argument("--compile-entry", default="{name: compile}",
                    help="the algorithms entry used by --compile (YAML flow mapping)")
    ap.add_argument("--bare-malloc-tuning", action="store_true",
                    help="give the bare loop llmforge's host allocator settings too (trainer.malloc_tuning)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--paired-steps", action="store_true",
                    help="one process, a bare step after every llmforge step: per-step overhead with little noise")
    ap.add_argument("--worker", choices=["bare", "llmforge", "paired"], help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:  # HF datasets is not imported here: llmforge imports it only to read text
        overrides = json.loads(args.overrides)
        with tempfile.TemporaryDirectory() as tmp:
            fn = {"bare": worker_bare, "llmforge": worker_llmforge, "paired": worker_paired}[args.worker]
            out = fn(overrides, args.steps, args.warmup, Path(tmp))
        out["peak_rss_mib"] = peak_rss_mib()
        print(json.dumps(out))
        return 0
    if args.paired_steps and args.bare_malloc_tuning:
        ap.error("--paired-steps runs both sides in one process, which has llmforge's allocator "
                 "settings already; drop --bare-malloc-tuning")
    if not args.smoke and not (args.pairs >= 1 and 1 <= args.warmup < args.steps):
        ap.error(f"need --pairs >= 1 and 1 <= --warmup < --steps; got --pairs {args.pairs} "
                 f"--warmup {args.warmup} --steps {args.steps}")
    overrides = SMOKE if args.smoke else (SMALL if args.small else [])
    if args.smoke:
        args.pairs, args.steps, args.warmup = 1, 4, 1
    llm_overrides = overrides + ([f"algorithms=[{args.compile_entry}]"] if args.compile else [])
    if args.paired_steps:
        r = run_worker("paired", llm_overrides, args.steps, args.warmup)  # --pairs is not used
        print(f"model: {'smoke' if args.smoke else 'small' if args.small else 'demo'}; one process, "
              f"{r['steps']} paired steps after {args.warmup} warm-up")
        print(f"median step: llmforge {r['llmforge_step_s'] * 1e3:.1f} ms, bare {r['bare_step_s'] * 1e3:.1f} ms")
        print(f"per-step ratio bare time / llmforge time (llmforge speed relative to bare): median "
              f"{r['ratio_median']:.3f} (p10 {r['ratio_p10']:.3f}, p90 {r['ratio_p90']:.3f}); "
              f"total time ratio {r['ratio_sum']:.3f}")
        return 0
    results: dict[str, list[dict]] = {"bare": [], "llmforge": []}
    for pair in range(args.pairs + (0 if args.smoke else 1)):  # the first pair warms caches
        a = run_worker("bare", overrides, args.steps, args.warmup, args.bare_malloc_tuning)
        b = run_worker("llmforge", llm_overrides, args.steps, args.warmup)
        if pair > 0 or args.smoke:
            results["bare"].append(a)
            results["llmforge"].append(b)
    tps = {k: [r["tokens_per_second"] for r in v] for k, v in results.items()}
    ratios = [b / a for a, b in zip(tps["bare"], tps["llmforge"])]
    label = f"llmforge+{args.compile_entry}" if args.compile else "llmforge"
    print(f"model: {'smoke' if args.smoke else 'small' if args.small else 'demo'}; "
          f"{args.pairs} pairs x {args.steps} steps ({args.warmup} warm-up)")
    for k in ("bare", "llmforge"):
        name = label if k == "llmforge" else "bare eager loop" + (" (malloc tuned)" if args.bare_malloc_tuning else "")
        print(f"{name:18s} median {statistics.median(tps[k]):9.1f} tokens/s   "
              f"peak RSS {max(r['peak_rss_mib'] for r in results[k]):7.0f} MiB")
    print(f"ratio {label}/bare: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    shares = [r["data_share"] for r in results["llmforge"]]
    print(f"llmforge data wait: median {statistics.median(shares):.2%} of step time "
          f"(time/data_seconds / time/step_seconds; max {max(shares):.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
