"""llmforge against the trainers users would pick instead: same model shape, data, batch, optimizer.

    python benchmarks/peers.py                    # demo model, 5 interleaved rounds after a warm-up round
    python benchmarks/peers.py --pairs 7 --steps 25
    python benchmarks/peers.py --side-by-side     # each peer at the same time as llmforge, one core each
    python benchmarks/peers.py --alternate        # each peer beside llmforge, their steps taking turns
    python benchmarks/peers.py --smoke            # tiny, for the test suite (only the peers installed)

The work is the demo model of ``yamls/demo_cpu.yaml`` (Llama dim 256, 4 blocks, 8 heads / 4 KV
heads, vocab 2048, seq 256, micro-batch 8 x 2 accumulation = 4,096 tokens per optimizer step,
AdamW lr 2e-3 wd 0.1, grad clip 1.0, fp32 on the CPU), trained by:

* ``llmforge`` — ``Trainer.fit`` exactly as ``benchmarks/overhead.py`` runs it (default callbacks,
  jsonl logger); compiled = its ``compile`` algorithm (``algorithms=[{name: compile}]``).
* ``lightning`` — a plain ``lightning.Trainer`` around a minimal LightningModule of the same
  Llama (llmforge's model code, so only the trainer differs): automatic optimization,
  ``accumulate_grad_batches``, ``gradient_clip_val``, the same AdamW and LR schedule, CSV logger.
  Always available.
* ``litgpt`` — ``litgpt.pretrain.setup`` (its Python API) with a LitGPT ``Config`` of the same
  shape and a LitGPT ``DataModule`` that serves the same packed token windows in the same order.
  ``pretrain`` always wraps the model in ``torch.compile``: "compiled" is that default, "eager"
  replaces ``torch.compile`` by the identity for that run.
* ``torchtitan`` — its ``Trainer`` (llama3, a model config of the same shape, its own HF-datasets
  loader over the same text and llmforge's tokenizer), on one process. Where it cannot run on the
  CPU, the script prints the error and goes on.

A peer whose package is not installed prints ``skipped: <package> not installed``. Each run is a
fresh subprocess with the same ``OMP_NUM_THREADS``; a round runs every variant once (the order is
reversed every other round, so no variant always follows another); tokens/s counts the optimizer
steps after the first ``--warmup`` ones (compilation falls in the warm-up). The ratio
llmforge / peer is taken per round, eager against eager and compiled against compiled, and
printed as its median with min-max over the rounds. ``--side-by-side`` runs each peer at the
same time as an llmforge run of its mode instead, on disjoint halves of the cores swapped
every round, so that the machine's drift hits both runs of a ratio
(:func:`side_by_side_main`); side by side, though, the two runs share the cache and the memory
bus, which slows each by what the other does. ``--alternate`` starts the same pairs together,
unpinned, with all the cores each, and makes their timed steps take turns, one optimizer step
each (:class:`overhead.Turns`): every timed step runs alone on the machine, as in a run of its
own, and the drift hits both runs step by step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import REPO, SMOKE, Turns, config, peak_rss_mib, worker_llmforge  # noqa: E402

COMPILE = "{name: compile}"  # llmforge's compiled variant: algorithms=[<this>]
# (trainer, mode): the llmforge variant of the same mode is the reference for a peer's ratio
VARIANTS = [("llmforge", "eager"), ("lightning", "eager"), ("litgpt", "eager"),
            ("torchtitan", "eager"), ("llmforge", "compiled"), ("litgpt", "compiled"),
            ("torchtitan", "compiled")]
PACKAGES = {"llmforge": None, "lightning": "lightning", "litgpt": "litgpt",
            "torchtitan": "torchtitan"}


# -- shared by the peer workers ------------------------------------------------------------------
def prepared(overrides: list[str], steps: int, work: Path, text: bool = False) -> dict:
    """The config, plan and the token windows of every step, ``rows [steps * local_batch,
    seq_len + 1]`` int64, in the order llmforge's loader (and overhead.py's bare loop) consumes
    them; with ``text``, also the tokenizer and the training documents. Built before any timed
    step. The rows are kept in ``$PEERS_ROWS_CACHE`` (a folder the parent makes for one
    benchmark run), built for ``$PEERS_ROWS_STEPS`` steps (the most any round runs), so only the
    first run of the warm-up round tokenizes the corpus for them: a measured run whose peak RSS
    held the tokenizing would not be the same work as its rounds' others. llmforge reads its own
    token cache (``data.token_cache``, ``$LLMFORGE_CACHE/tokens``) the same way: its warm-up run
    fills it when it is empty, and its measured runs memory-map the ids."""
    import hashlib

    import torch

    from llmforge.config import validate
    from llmforge.data.datamodule import tokenize_documents
    from llmforge.data.packing import PackedWindows, ShardedSampler
    from llmforge.data.shakespeare import cache_root
    from llmforge.data.sources import iter_texts, load_documents
    from llmforge.data.tokenizers import build_tokenizer

    cfg = config(overrides, steps, work)
    plan = validate(cfg, 1)
    out = {"cfg": cfg, "plan": plan}
    built = max(steps, int(os.environ.get("PEERS_ROWS_STEPS") or 0))
    key = hashlib.sha256(json.dumps([overrides, built]).encode()).hexdigest()[:16]
    cached = Path(os.environ.get("PEERS_ROWS_CACHE") or work) / f"rows-{key}.pt"
    if text or not cached.is_file():
        docs = load_documents(cfg.data, cfg.run.seed)
        tok = build_tokenizer(cfg.tokenizer,
                              lambda: iter_texts(docs.train, cfg.tokenizer.train_max_bytes),
                              cache_dir=cache_root() / "tokenizers", fingerprint=docs.fingerprint)
        out.update(docs=docs, tok=tok)
    if cached.is_file():
        out["rows"] = torch.load(cached)
    else:
        windows = PackedWindows(tokenize_documents(out["docs"].train, out["tok"]),
                                cfg.trainer.seq_len)
        order = iter(ShardedSampler(len(windows), seed=cfg.run.seed,
                                    local_batch=plan.local_batch_size))
        out["rows"] = torch.stack([windows[next(order)]
                                   for _ in range(built * plan.local_batch_size)])
        part = cached.with_suffix(f".{os.getpid()}.part")  # runs may be side by side (smoke)
        torch.save(out["rows"], part)
        os.replace(part, cached)
    out["rows"] = out["rows"][:steps * plan.local_batch_size]
    torch.manual_seed(cfg.run.seed)
    return out


class StepClock:
    """Wall time after every optimizer step of any torch optimizer in this process (a global
    ``torch.optim`` post-hook), whichever trainer drives it; side by side, the ``warmup``-th
    step waits for the run beside it first (:func:`side_by_side_barrier`); alternating, the
    timed steps take turns with it (:class:`overhead.Turns`)."""

    def __init__(self, warmup: int, steps: int) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.marks: list[float] = []
        self.turns = Turns()
        self._handle = register_optimizer_step_post_hook(lambda *a, **k: self._mark(warmup, steps))

    def _mark(self, warmup: int, steps: int) -> None:
        self.turns.after_step(len(self.marks) + 1, warmup, steps)  # the step that just ended
        self.marks.append(time.perf_counter())

    def tokens_per_second(self, steps: int, warmup: int, tokens_per_step: int) -> float:
        if len(self.marks) != steps:
            raise RuntimeError(f"expected {steps} optimizer steps, counted {len(self.marks)}")
        seconds = (self.turns.timed(steps - warmup) if self.turns.active
                   else self.marks[steps - 1] - self.marks[warmup - 1])
        return (steps - warmup) * tokens_per_step / seconds


# -- the peers -------------------------------------------------------------------------------
def worker_lightning(overrides: list[str], steps: int, warmup: int, work: Path) -> dict:
    import lightning as L
    import torch.nn.functional as F
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from llmforge import registry
    from llmforge.training.optim import build_optimizer
    from llmforge.training.schedule import build_scheduler

    d = prepared(overrides, steps, work)
    cfg, plan = d["cfg"], d["plan"]

    class PlainLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = registry.models.get(cfg.model.name)(cfg.model)

        def training_step(self, batch, batch_idx):
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self):
            opt = build_optimizer(self.model, cfg.optimizer)
            sched = build_scheduler(opt, cfg.scheduler, steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    clock = StepClock(warmup, steps)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=steps,
                        accumulate_grad_batches=plan.gradient_accumulation_steps,
                        gradient_clip_val=cfg.trainer.gradient_clip_val,
                        logger=CSVLogger(work), log_every_n_steps=cfg.trainer.log_every,
                        enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=work)
    loader = DataLoader(d["rows"], batch_size=plan.micro_batch_size, shuffle=False)
    trainer.fit(PlainLlama(), train_dataloaders=loader)
    return {"tokens_per_second": clock.tokens_per_second(steps, warmup, plan.tokens_per_step)}


def litgpt_config(m, seq_len: int):
    """LitGPT's ``Config`` of the same Llama as llmforge's ``LlamaArgs`` ``m`` (GQA, SwiGLU
    ``LLaMAMLP``, RMSNorm, no biases), context ``seq_len`` tokens (also ``peers_block.py``)."""
    from litgpt.config import Config
    from llmforge.models.llama3.model import ffn_hidden_dim

    return Config(
        name="llmforge-demo", block_size=seq_len, vocab_size=m.vocab_size,
        padded_vocab_size=m.vocab_size, n_layer=m.n_layers, n_head=m.n_heads,
        n_query_groups=m.n_kv_heads, n_embd=m.dim, rotary_percentage=1.0,
        parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=m.norm_eps,
        mlp_class_name="LLaMAMLP", rope_base=int(m.rope_theta),
        intermediate_size=ffn_hidden_dim(m.dim, m.multiple_of, m.ffn_dim_multiplier))


def worker_litgpt(overrides: list[str], steps: int, warmup: int, work: Path,
                  compiled: bool) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from litgpt import pretrain
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import DataModule
    from llmforge.models.llama3.config import llama_args_from_config

    d = prepared(overrides, steps, work)
    cfg, plan, rows = d["cfg"], d["plan"], d["rows"]
    model_config = litgpt_config(llama_args_from_config(cfg.model), cfg.trainer.seq_len)

    class Windows(DataModule):  # the same packed windows, in the same order
        def connect(self, tokenizer=None, batch_size=1, max_seq_length=None, **kwargs):
            self.batch_size = batch_size

        def train_dataloader(self):
            return DataLoader(rows, batch_size=self.batch_size, shuffle=False)

        def val_dataloader(self):  # pretrain's sanity check before training reads 2 batches
            return DataLoader(rows[:2 * self.batch_size], batch_size=self.batch_size)

    # after training, pretrain records its CLI arguments by parsing sys.argv (this script's):
    # called through the Python API there are none to record
    pretrain.save_hyperparameters = lambda *args, **kwargs: None
    if not compiled:  # pretrain calls torch.compile(model) unconditionally
        torch.compile = lambda model=None, **kwargs: model
    o = cfg.optimizer
    clock = StepClock(warmup, steps)
    pretrain.setup(
        model_name="llmforge-demo", model_config=model_config, out_dir=work / "litgpt",
        precision="32-true", data=Windows(), devices=1, logger_name="csv", seed=cfg.run.seed,
        train=TrainArgs(save_interval=None, log_interval=1, global_batch_size=plan.global_batch_size,
                        micro_batch_size=plan.micro_batch_size,
                        max_tokens=steps * plan.tokens_per_step, max_norm=cfg.trainer.gradient_clip_val,
                        lr_warmup_steps=cfg.scheduler.warmup_steps,
                        min_lr=o.lr * cfg.scheduler.min_lr_ratio, tie_embeddings=False),
        eval=EvalArgs(interval=10**9, max_iters=1, initial_validation=False, final_validation=False),
        optimizer={"class_path": "torch.optim.AdamW",
                   "init_args": {"lr": o.lr, "weight_decay": o.weight_decay,
                                 "betas": list(o.betas), "eps": o.eps}})
    return {"tokens_per_second": clock.tokens_per_second(steps, warmup, plan.tokens_per_step)}


def worker_torchtitan(overrides: list[str], steps: int, warmup: int, work: Path,
                      compiled: bool) -> dict:
    d = prepared(overrides, steps, work, text=True)
    cfg, plan = d["cfg"], d["plan"]
    # torchtitan's own loader reads text through HF datasets and tokenizes it with a
    # tokenizer.json: give it the same training text and llmforge's BPE
    from llmforge.data.sources import iter_texts

    text = work / "train.jsonl"
    with text.open("w") as f:
        for t in iter_texts(d["docs"].train):
            f.write(json.dumps({"text": t}) + "\n")
    d["tok"].save(work / "tokenizer")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    from datasets import load_dataset
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.models.llama3.model import Llama3Model
    from llmforge.models.llama3.model import ffn_hidden_dim
    from llmforge.models.llama3.config import llama_args_from_config

    text_datasets.DATASETS["llmforge_demo"] = DatasetConfig(
        path=str(text), loader=lambda p: load_dataset("json", data_files=p, split="train"),
        sample_processor=lambda sample: sample["text"])
    m = llama_args_from_config(cfg.model)
    hidden = ffn_hidden_dim(m.dim, m.multiple_of, m.ffn_dim_multiplier)
    spec = llama3.model_registry("debugmodel")
    spec.model = Llama3Model.Config(
        dim=m.dim, vocab_size=m.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=m.dim,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=m.dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=m.dim, out_features=m.vocab_size,
                              param_init=llama3._output_linear_init(m.dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=m.n_layers, dim=m.dim, n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads, hidden_dim=hidden, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=m.dim // m.n_heads, max_seq_len=cfg.trainer.seq_len,
                                    theta=m.rope_theta, scaling="none")))
    tc = llama3_debugmodel()
    tc.model_spec = spec
    tc.hf_assets_path = str(work / "tokenizer")
    tc.dump_folder = str(work / "torchtitan")
    tc.dataloader.dataset = "llmforge_demo"
    tc.optimizer = default_adamw(lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                                 betas=tuple(cfg.optimizer.betas), eps=cfg.optimizer.eps)
    tc.training.local_batch_size = plan.micro_batch_size
    tc.training.global_batch_size = plan.global_batch_size
    tc.training.seq_len = cfg.trainer.seq_len
    tc.training.steps = steps
    tc.training.max_norm = cfg.trainer.gradient_clip_val
    tc.training.mixed_precision_param = "float32"
    tc.activation_checkpoint = None
    tc.checkpoint.enable = False
    tc.validator.enable = False
    tc.metrics.log_freq = cfg.trainer.log_every
    tc.compile.enable = compiled
    clock = StepClock(warmup, steps)
    trainer = tc.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"tokens_per_second": clock.tokens_per_second(steps, warmup, plan.tokens_per_step)}


def start_worker(trainer: str, mode: str, overrides: list[str], steps: int, warmup: int,
                 threads: int, cores: Optional[list[int]] = None,
                 env: Optional[dict] = None) -> subprocess.Popen:
    """Start one run in a fresh subprocess, pinned to ``cores`` when given (Linux affinity,
    inherited by its compile and data workers)."""
    cmd = [sys.executable, __file__, "--worker", trainer, "--mode", mode, "--steps", str(steps),
           "--warmup", str(warmup), "--overrides", json.dumps(overrides)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": str(threads), **(env or {})}
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=env, preexec_fn=pin)


def finish_worker(proc: subprocess.Popen, t0: float) -> dict:
    """Wait for a run of :func:`start_worker`: its result, or ``{"error": ...}`` (the
    exception, or the end of stderr when the process died without one)."""
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    lines = stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        out = None
    if isinstance(out, dict) and ("tokens_per_second" in out or "error" in out):
        return {**out, "wall_s": wall}
    return {"error": f"exit {proc.returncode}: {stderr.strip()[-1500:]}"}


def run_worker(trainer: str, mode: str, overrides: list[str], steps: int, warmup: int,
               threads: int) -> dict:
    """One run alone, in a fresh subprocess (:func:`start_worker`, :func:`finish_worker`)."""
    t0 = time.perf_counter()
    return finish_worker(start_worker(trainer, mode, overrides, steps, warmup, threads), t0)


def run_side_by_side(pair: list[tuple[str, str]], overrides: list[list[str]], steps: int,
                     warmup: int, threads: int, cores: Optional[list[list[int]]],
                     alternate: bool = False) -> list[dict]:
    """Two runs at once, each pinned to its own ``cores`` (unless ``None``) with ``threads``
    compute threads; both start timing together after their warm-up
    (:func:`side_by_side_barrier`). With ``alternate``, the timed steps take turns instead of
    running at the same time, the first run of ``pair`` first (:class:`overhead.Turns`).
    Inductor compiles with as many workers as the machine has cores, as it would for a run
    alone."""
    with tempfile.TemporaryDirectory(prefix="peers-barrier-") as barrier, \
            tempfile.TemporaryDirectory(prefix="peers-turns-") as turns:
        env = {"PEERS_BARRIER": barrier,
               "TORCHINDUCTOR_COMPILE_THREADS": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS",
                                                               str(os.cpu_count() or 1))}
        fifos = []
        if alternate:
            env["PEERS_TURNS"] = turns
            for role in (0, 1):
                os.mkfifo(Path(turns, f"turn-{role}"))
                fifos.append(os.open(Path(turns, f"turn-{role}"), os.O_RDWR | os.O_NONBLOCK))
        t0 = time.perf_counter()
        procs = [start_worker(*v, o, steps, warmup, threads, c,
                              {**env, "PEERS_TURN_ROLE": str(role)})
                 for role, (v, o, c) in enumerate(zip(pair, overrides, cores or [None, None]))]

        def finish(proc: subprocess.Popen) -> dict:
            out = finish_worker(proc, t0)
            # a run that ended (done, or failed before its barrier) frees the one beside it
            Path(barrier, f"ended-{proc.pid}").touch()
            for fd in fifos:  # and, alternating, lets it take every turn from now on
                try:
                    os.write(fd, b"e" * 4096)
                except BlockingIOError:  # the FIFO is full: it has turns enough
                    pass
            return out

        try:
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(finish, procs))
        finally:
            for fd in fifos:
                os.close(fd)


def worker_main(args) -> int:
    # no harness import of HF datasets: each run holds what its trainer imports (llmforge and
    # the peers but torchtitan read pre-tokenized rows; issue 30: ~80 MiB of peak RSS)
    overrides = json.loads(args.overrides)
    compiled = args.mode == "compiled"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            if args.worker == "llmforge":
                out = worker_llmforge(overrides, args.steps, args.warmup, work)
            elif args.worker == "lightning":
                out = worker_lightning(overrides, args.steps, args.warmup, work)
            elif args.worker == "litgpt":
                out = worker_litgpt(overrides, args.steps, args.warmup, work, compiled)
            else:
                out = worker_torchtitan(overrides, args.steps, args.warmup, work, compiled)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which goes on
            if args.worker == "llmforge":
                raise
            frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
            # the peer's own line that led to the error, then the line that raised it
            own = [f for f in frames if f"/{args.worker}/" in f.filename]
            where = "".join(dict.fromkeys(
                f" (at {f.filename.split('site-packages/')[-1]}:{f.lineno}: {f.line})"
                for f in own[-1:] + frames[-1:]))
            print(traceback.format_exc(), file=sys.stderr)
            out = {"error": f"{type(e).__name__}: {e}{where}"}
    out["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5, help="measured rounds (after a warm-up round)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS of every run (default: $OMP_NUM_THREADS or all cores; "
                         "side by side: half the cores)")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run each peer at the same time as an llmforge run of the same mode, each "
                         "pinned to its own half of the cores, swapped every round")
    ap.add_argument("--alternate", action="store_true",
                    help="run each peer at the same time as an llmforge run of the same mode, "
                         "the timed steps taking turns (one optimizer step each, every step "
                         "alone on the machine), llmforge first in even rounds")
    ap.add_argument("--only", default="", help="comma-separated peers to run (default: all installed)")
    ap.add_argument("--no-compiled", action="store_true", help="eager variants only")
    ap.add_argument("--llmforge-compile", default=COMPILE, metavar="YAML",
                    help=f"the algorithm entry of llmforge's compiled runs (default: {COMPILE}; "
                         "e.g. '{name: compile, per_block: false}' compiles the whole model)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", choices=list(PACKAGES), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["eager", "compiled"], default="eager", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    cores = sorted(os.sched_getaffinity(0))
    if args.side_by_side and args.alternate:
        ap.error("--side-by-side and --alternate are two ways to pair the runs: give one")
    if not args.smoke and not (args.pairs >= 1 and 1 <= args.warmup < args.steps):
        ap.error(f"need --pairs >= 1 and 1 <= --warmup < --steps; got --pairs {args.pairs} "
                 f"--warmup {args.warmup} --steps {args.steps}")
    if args.threads is None:
        args.threads = (max(1, len(cores) // 2) if args.side_by_side else
                        int(os.environ.get("OMP_NUM_THREADS") or len(cores)))
    if args.threads < 1:
        print(f"--threads {args.threads}: give at least 1", file=sys.stderr)
        return 2
    if args.side_by_side and len(cores) < 2 * args.threads:
        print(f"--side-by-side: two runs of {args.threads} thread(s) need {2 * args.threads} cores; "
              f"this process may use {len(cores)}: give --threads {max(1, len(cores) // 2)}",
              file=sys.stderr)
        return 2

    # llmforge evaluates before the first and after the last step, outside the timed steps (the
    # peers do not): one batch is enough there
    overrides = ["trainer.eval_batches=1"] + (SMOKE + ["data.max_documents=8"] if args.smoke else [])
    if args.smoke:  # no compiled variants: a compile would take most of the test's time
        args.pairs, args.steps, args.warmup, args.no_compiled, args.threads = 1, 4, 1, True, 1
    only = {p for p in args.only.split(",") if p}
    peers = []
    for name, package in PACKAGES.items():
        if name == "llmforge" or (only and name not in only):
            continue
        if importlib.util.find_spec(package) is None:
            print(f"{name}: skipped: {package} not installed")
        else:
            peers.append(name)
    variants = [(t, m) for t, m in VARIANTS if (t == "llmforge" or t in peers)
                and not (args.no_compiled and m == "compiled")]
    variants = [(t, m) for t, m in variants  # llmforge compiled only if a compiled peer runs
                if t != "llmforge" or any(p != "llmforge" and pm == m for p, pm in variants)]
    import torch

    print(f"model: {'smoke' if args.smoke else 'demo (yamls/demo_cpu.yaml)'}; {args.pairs} round{'s' * (args.pairs != 1)} x "
          f"{args.steps} steps ({args.warmup} warm-up); OMP_NUM_THREADS={args.threads}; "
          f"{'side by side, ' + str(len(cores)) + ' cores; ' if args.side_by_side else ''}"
          f"{'alternating steps, ' + str(len(cores)) + ' cores; ' if args.alternate else ''}"
          f"torch {torch.__version__}; {' '.join(_versions(peers))}; llmforge compiled = "
          f"algorithms=[{args.llmforge_compile}]", flush=True)

    def run_overrides(v: tuple[str, str]) -> list[str]:
        if v == ("llmforge", "compiled"):
            return overrides + [f"algorithms=[{args.llmforge_compile}]"]
        return overrides

    cache = tempfile.TemporaryDirectory(prefix="peers-rows-")
    os.environ["PEERS_ROWS_CACHE"] = cache.name
    os.environ["PEERS_ROWS_STEPS"] = str(args.steps)  # the warm-up round builds the measured rows
    rounds = args.pairs + (0 if args.smoke else 1)  # the first round warms caches, runs short
    if args.side_by_side or args.alternate:
        return side_by_side_main(args, [v for v in variants if v[0] != "llmforge"],
                                 run_overrides, rounds, cores)
    results: dict[tuple[str, str], list[dict]] = {v: [] for v in variants}
    errors: dict[tuple[str, str], str] = {}
    for r, warm, steps, order in schedule(args, rounds, variants, errors):
        if args.smoke:  # timings are not the point: run the variants side by side
            with ThreadPoolExecutor(len(order)) as pool:
                outs = list(pool.map(lambda v: run_worker(*v, run_overrides(v), steps,
                                                          args.warmup, args.threads), order))
        for i, v in enumerate(order):
            out = outs[i] if args.smoke else run_worker(*v, run_overrides(v), steps,
                                                        args.warmup, args.threads)
            label = f"{v[0]} ({v[1]})"
            if "error" in out:
                if v[0] == "llmforge":
                    raise RuntimeError(f"{label} failed: {out['error']}")
                errors[v] = out["error"]
                print(f"  {label}: cannot run: {out['error']}", flush=True)
                continue
            print(f"  round {r}{' (warm-up, not counted)' if warm else ''}: {label:22s} "
                  f"{out['tokens_per_second']:9.1f} tokens/s  ({out['wall_s']:.0f} s)",
                  flush=True)
            if not warm:
                out["round"] = r
                results[v].append(out)

    print()
    for v, rs in results.items():
        if v in errors or not rs:
            continue
        tps = [o["tokens_per_second"] for o in rs]
        print(f"{v[0] + ' (' + v[1] + ')':22s} median {statistics.median(tps):9.1f} tokens/s   "
              f"peak RSS {max(o['peak_rss_mib'] for o in rs):7.0f} MiB")
    for v, rs in results.items():
        if v[0] == "llmforge" or v in errors:
            continue
        ref = {o["round"]: o["tokens_per_second"] for o in results[("llmforge", v[1])]}
        ratios = [ref[o["round"]] / o["tokens_per_second"] for o in rs if o["round"] in ref]
        if ratios:
            rss = (max(o["peak_rss_mib"] for o in results[("llmforge", v[1])])
                   / max(o["peak_rss_mib"] for o in rs))
            print(f"ratio llmforge/{v[0]} ({v[1]}): median {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f}); peak RSS ratio {rss:.3f}")
    for v, err in errors.items():
        print(f"{v[0]} ({v[1]}): cannot run: {err.splitlines()[0] if err else err}")
    return 0


def schedule(args, rounds: int, variants: list[tuple[str, str]], errors: dict):
    """``(round, warm-up?, steps, variants in order)`` of every round: the first round (not in
    ``--smoke``) is a short warm-up; the order is reversed every other round; a variant that
    failed (in ``errors``, filled as the rounds run) is left out of later rounds."""
    for r in range(rounds):
        warm = r == 0 and not args.smoke
        order = [v for v in variants if v not in errors]
        yield r, warm, args.warmup + 2 if warm else args.steps, order[::-1] if r % 2 else order


def side_by_side_main(args, peer_variants: list[tuple[str, str]], run_overrides, rounds: int,
                      cores: list[int]) -> int:
    """``--side-by-side``: every round runs each peer variant at the same time as an llmforge
    run of its mode (:func:`run_side_by_side`), the two on disjoint halves of the cores, which
    swap every round; the ratio is taken within each pair, so a drift of the machine's speed
    hits both of its runs. The run that finishes first leaves the other alone for its last
    steps, which favours the slower of the two. ``--alternate``: the same pairs, unpinned,
    with ``--threads`` each (default all cores), their timed steps taking turns
    (:class:`overhead.Turns`): each step runs alone on the machine, as in a run of its own,
    and the drift hits both runs step by step; llmforge takes the first timed step in even
    rounds, the peer in odd ones."""
    t = args.threads
    halves = [cores[:t], cores[t:2 * t]]
    results: dict[tuple[str, str], list[tuple[dict, dict]]] = {v: [] for v in peer_variants}
    errors: dict[tuple[str, str], str] = {}
    for r, warm, steps, order in schedule(args, rounds, peer_variants, errors):
        pin = halves if r % 2 == 0 else halves[::-1]
        for v in order:
            ref = ("llmforge", v[1])
            pair = [ref, v] if not args.alternate or r % 2 == 0 else [v, ref]
            outs = run_side_by_side(pair, [run_overrides(x) for x in pair], steps, args.warmup, t,
                                    None if args.alternate else pin, alternate=args.alternate)
            ours, peer = outs if pair[0] == ref else outs[::-1]
            if "error" in ours:
                raise RuntimeError(f"llmforge ({v[1]}) failed: {ours['error']}")
            label = f"{v[0]} ({v[1]})"
            if "error" in peer:
                errors[v] = peer["error"]
                print(f"  {label}: cannot run: {peer['error']}", flush=True)
                continue
            where = (f"{'after' if pair[0] == ref else 'before'} each llmforge step"
                     if args.alternate else f"on cores {pin[1]}")
            beside = "" if args.alternate else f" on {pin[0]}"
            print(f"  round {r}{' (warm-up, not counted)' if warm else ''}: {label:22s} "
                  f"{peer['tokens_per_second']:9.1f} tokens/s {where}, llmforge "
                  f"{'alternating' if args.alternate else 'beside it'} "
                  f"{ours['tokens_per_second']:9.1f}{beside}: ratio "
                  f"{ours['tokens_per_second'] / peer['tokens_per_second']:.3f}", flush=True)
            if not warm:
                results[v].append((ours, peer))
    print()
    for v, pairs in results.items():
        if v in errors or not pairs:
            continue
        ratios = [o["tokens_per_second"] / p["tokens_per_second"] for o, p in pairs]
        rss = max(o["peak_rss_mib"] for o, _ in pairs) / max(p["peak_rss_mib"] for _, p in pairs)
        print(f"{v[0] + ' (' + v[1] + ')':22s} median {statistics.median(p['tokens_per_second'] for _, p in pairs):9.1f} "
              f"tokens/s (llmforge {'alternating' if args.alternate else 'beside it'} {statistics.median(o['tokens_per_second'] for o, _ in pairs):9.1f})   "
              f"peak RSS {max(p['peak_rss_mib'] for _, p in pairs):7.0f} MiB "
              f"(llmforge {max(o['peak_rss_mib'] for o, _ in pairs):7.0f})")
        print(f"ratio llmforge/{v[0]} ({v[1]}): median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}); peak RSS ratio {rss:.3f}")
    for v, err in errors.items():
        print(f"{v[0]} ({v[1]}): cannot run: {err.splitlines()[0] if err else err}")
    return 0


def _versions(peers: list[str]) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for p in dict.fromkeys(["lightning", *peers]):
        try:
            out.append(f"{p} {version(PACKAGES[p])}")
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    sys.exit(main())
