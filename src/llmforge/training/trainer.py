"""``llmforge.Trainer``: config -> tokenizer, data, model, callbacks, loggers -> ``lightning.Trainer.fit``.

Subclass it and override any ``build_*`` method to change one piece; the rest stays::

    from llmforge import Trainer

    trainer = Trainer.from_yaml("yamls/demo_cpu.yaml", ["trainer.max_steps=50"])
    summary = trainer.fit()
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
from lightning.pytorch.loggers import Logger
import torch
from omegaconf import DictConfig, OmegaConf

from llmforge import registry
from llmforge.algorithms.loading import build_algorithms
from llmforge.callbacks import Checkpointer, GarbageCollection, NaNGuard, RichProgress, SpeedMonitor
from llmforge.callbacks.threads import EVERY_SECONDS, ThreadWatch
from llmforge.checkpoint import list_checkpoints, read_json
from llmforge.checkpoint.init_from import check_initial_weights
from llmforge.checkpoint.layout import is_checkpoint_folder
from llmforge.checkpoint.plugins import check_state_keys
from llmforge.config import config_to_dict, load_config, redact, save_config
from llmforge.config.schema import PRECISIONS
from llmforge.data.datamodule import LLMDataModule
from llmforge.data.mixture import MixtureTokens, PreparedMixture
from llmforge.data.tokenizers import Tokenizer
from llmforge.errors import ConfigError
from llmforge.job.tracker import RunTracker
from llmforge.parallel.fault_tolerance import ReplicaGroup, import_torchft
from llmforge.parallel.lighthouse import check_lighthouse
from llmforge.parallel.strategy import LLMParallelStrategy
from llmforge.parallel.threads import available_cores, explicit_threads, machine_wide
from llmforge.parallel.transforms import check_strategy, strategy_transforms
from llmforge.paths import check_writable_dir
from llmforge.plugin import meta_model
from llmforge.preflight.resolve import ResolvedRun, resolve_run, worker_cores
from llmforge.quiet import quiet_libraries
from llmforge.registry import build_entries
from llmforge.run_guard import RunLock, clear_run_dir, mark_run_dir
from llmforge.training.entries import build_callbacks, module_class
from llmforge.training.steps import check_plugins
from llmforge.training.summary import run_summary
from llmforge.training.run_data import DataBuilders
from llmforge.training.run_files import _inside, check_resumable, recheck_run_dir, truncate_metrics

__all__ = ["Trainer"]


class Trainer(DataBuilders):
    """Builds every piece of a run from a resolved config and runs ``lightning.Trainer.fit``.

    Args:
        cfg: a config from :func:`llmforge.config.load_config` (not changed; ``self.cfg`` is
            the read-only resolved copy, :attr:`ResolvedRun.cfg`).
        overwrite: delete an existing run directory of the same name first.
        run: the run already resolved from ``cfg`` (:func:`llmforge.preflight.resolve.resolve_run`;
            the CLI resolves it before the heavy imports); default: resolved here.

    Raises:
        ConfigError: invalid settings (see :func:`llmforge.config.validate`), or a run directory
            that already holds a run (use ``checkpoint.resume``, another ``run.name`` or ``overwrite``).
    """

    def __init__(self, cfg: DictConfig, *, overwrite: bool = False,
                 run: Optional[ResolvedRun] = None) -> None:
        self.run = run if run is not None else resolve_run(cfg, overwrite=overwrite)
        quiet_libraries()  # the Python API is as quiet as the CLI (issue 27.7)
        self.cfg = cfg = self.run.cfg
        self.world_size, self.plan, self.dims = self.run.world_size, self.run.plan, self.run.dims
        registry.import_modules(cfg.imports)
        check_strategy(cfg, self.dims)  # reject impossible strategy settings up front
        self.algorithms = self.build_algorithms()  # instantiated and checked before any allocation
        check_plugins(self.algorithms, self.dims)  # each handler fires under the run's step
        module_class(cfg)
        self.run_dir, self.checkpoint_dir = self.run.run_dir, self.run.checkpoint_dir
        check_writable_dir(self.run_dir, "run.output_dir")  # before data and tokenizer, not after
        check_writable_dir(self.checkpoint_dir, "checkpoint.dir" if cfg.checkpoint.dir else "run.output_dir")
        self.overwrite = overwrite
        self.run_lock = RunLock(self.run_dir)
        """One process writes the run directory (:mod:`llmforge.run_guard`); taken in setup."""
        self.tokenizer: Optional[Tokenizer] = None
        self.module: Any = None
        self.datamodule: Optional[LLMDataModule] = None
        self.lightning: Optional[L.Trainer] = None
        self.resume_path: Optional[Path] = None
        self.resumed_step: Optional[int] = None  # the resume checkpoint's step (rank 0)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = (), **kwargs: Any) -> "Trainer":
        """Load ``path`` with dotlist ``overrides`` and build a Trainer."""
        return cls(load_config(path, overrides), **kwargs)

    # ------------------------------------------------------------- pieces
    def is_rank_zero(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    def resolve_resume(self) -> Optional[Path]:
        """The checkpoint to resume from (``checkpoint.resume``), or ``None``: resolved with the
        run (:attr:`ResolvedRun.resume_from`, where an incomplete path and a resume that changes
        exactness-relevant settings were refused), then its files checked.

        Raises:
            CheckpointReadError: a damaged checkpoint (see :func:`check_resumable`).
        """
        path = self.run.resume_from
        if path is not None:
            auto = self.cfg.checkpoint.resume == "auto"
            check_resumable(path, list_checkpoints(self.checkpoint_dir) if auto else [])
        return path

    def check_run_dir(self) -> bool:
        """Whether the run directory (or the checkpoint folder) already holds a run (a used one
        without ``checkpoint.resume`` or ``overwrite`` was refused when the run was resolved)."""
        return self.run.run_dir_used

    def apply_threads(self) -> None:
        """Set torch's compute threads (:attr:`ResolvedRun.num_threads`), first thing in setup.

        Raises:
            ConfigError: ``trainer.accelerator`` asks for CUDA and torch finds none (checked
                here, not at construction, so a GPU config's dry run works on a laptop)."""
        t = self.cfg.trainer
        if t.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={t.accelerator}, but torch finds no "
                              "CUDA device here; use trainer.accelerator=auto or cpu")
        torch.set_num_threads(self.run.num_threads)

    def watch_threads(self) -> bool:
        """Whether the threads are re-chosen during training (:class:`ThreadWatch`): llmforge
        chose them (no ``trainer.num_threads``, no ``OMP_NUM_THREADS``), for one process on
        this node, that may run on every core of the machine."""
        return (self.run.local_world_size == 1 and machine_wide(available_cores())
                and explicit_threads(self.cfg.trainer.num_threads, os.environ) is None)

    def announce(self) -> None:
        """Print (rank 0, stderr) the compute threads and what a resume changes: at the end of
        setup, after every check of the input, so an error is the first line a user sees."""
        if self.is_rank_zero():
            n = self.run.num_threads
            again = (f"; counted again every {EVERY_SECONDS:g} s while training"
                     if self.watch_threads() else "")
            print(f"threads: {n} compute thread{'s' * (n != 1)} per process "
                  f"({self.run.threads_reason}{again})", file=sys.stderr, flush=True)
            if self.run.resume_line:
                print(self.run.resume_line, file=sys.stderr, flush=True)

    def lock_run_dir(self) -> None:
        """Take the run directory's lock on rank 0 (the launcher process under ``--nproc``, whose
        workers inherit its token), held until :meth:`fit` ends; the other ranks write what rank
        0's lock covers.

        Raises:
            RunDirBusy: another process holds it (the message names its host, pid, start time).
            ConfigError: the run directory changed since the run was resolved (another process
                trained into it before the lock was taken; :func:`recheck_run_dir`).
        """
        if self.is_rank_zero():
            self.run_lock.acquire()
            auto = self.cfg.checkpoint.resume == "auto" and not self.overwrite
            try:  # under the lock, before the first write: what was checked still holds
                recheck_run_dir(self.run_dir, self.checkpoint_dir, self.run.run_dir_used,
                                self.run.resume_from, auto)
            except BaseException:
                self.run_lock.release()
                raise

    def prepare_run_dir(self, used: bool) -> None:
        """Create and mark the run directory and write the resolved config (secrets redacted).

        With ``overwrite``, the old run's own files are deleted here, after the new run's
        config, data and tokenizer have been checked: the contents of the run directory (an
        llmforge run: :func:`llmforge.run_guard.check_run_dir` was checked when the run was
        resolved) and, when the checkpoint folder lies elsewhere, only llmforge's checkpoints in
        it (:func:`llmforge.checkpoint.layout.is_checkpoint_folder`).
        """
        if used and self.overwrite and self.is_rank_zero():
            clear_run_dir(self.run_dir)
            if self.checkpoint_dir.exists() and not _inside(self.checkpoint_dir, self.run_dir):
                for old in self.checkpoint_dir.iterdir():
                    if is_checkpoint_folder(old):
                        shutil.rmtree(old)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_rank_zero():
            mark_run_dir(self.run_dir)  # also adopts a run made before the mark
        if self.resume_path is None and self.is_rank_zero():
            save_config(self.cfg, self.run_dir / "config.yaml")
            if used and self.cfg.checkpoint.resume == "auto" and not self.overwrite:
                # resume=auto before any checkpoint was complete: the run starts over at step 0,
                # so the records of the attempt that never reached a checkpoint go
                dropped = truncate_metrics(self.run_dir / "metrics.jsonl", -1)
                if dropped:
                    print(f"checkpoint.resume=auto: no complete checkpoint in {self.checkpoint_dir} "
                          f"yet; starting at step 0 (dropped {dropped} records of the earlier attempt "
                          "from metrics.jsonl)", file=sys.stderr, flush=True)
        # resuming: config.yaml and metrics.jsonl change only once the checkpoint has loaded
        # (finish_resume), so a refused resume leaves the run as it was

    def finish_resume(self) -> None:
        """After the resume checkpoint loaded: write this run's config and drop the metrics
        records after the checkpoint's step (they are recomputed), on rank 0."""
        if self.resume_path is not None and self.is_rank_zero():
            step = self.resumed_step = int(read_json(self.resume_path, "trainer_state.json")["step"])
            if step >= int(self.cfg.trainer.max_steps):
                return  # nothing to train: the run's config and records stay as they were
            save_config(self.cfg, self.run_dir / "config.yaml")
            truncate_metrics(self.run_dir / "metrics.jsonl", step)

    def build_module(self) -> Any:
        """Instantiate ``trainer.module`` (an :class:`LLMModule` or a subclass)."""
        cls = module_class(self.cfg)
        try:
            return cls(self.cfg, self.plan, pipeline=self.build_pipeline(),
                       **dict(self.cfg.trainer.module_kwargs))
        except TypeError as exc:
            raise ConfigError(f"trainer.module_kwargs: {exc}") from exc

    def build_callbacks(self) -> list[Any]:
        """The algorithms, speed monitor, NaN guard, progress bar, checkpointer, then ``callbacks:``.

        The speed monitor is always there: a ``speed_monitor`` entry (or a subclass of
        :class:`SpeedMonitor`) in ``callbacks:`` replaces the default one instead of adding a
        second; so does a ``nan_guard`` entry for the NaN guard of ``trainer.nan_guard``."""
        ck = self.cfg.checkpoint
        extra = build_callbacks(self.cfg)
        speed = next((c for c in extra if isinstance(c, SpeedMonitor)), None)
        extra = [c for c in extra if c is not speed]
        cbs: list[Any] = [speed or SpeedMonitor()]
        has_guard = any(isinstance(c, NaNGuard) for c in extra)  # a `nan_guard` entry configures it
        if self.cfg.trainer.nan_guard and not has_guard:
            cbs.append(NaNGuard())
        if self.cfg.trainer.gc_every > 0:
            cbs.append(GarbageCollection(self.cfg.trainer.gc_every))
        if self.watch_threads():
            cbs.append(ThreadWatch(worker_cores(self.cfg.data), announce=self.is_rank_zero()))
        if self.cfg.trainer.progress_bar:
            cbs.append(RichProgress())
        cbs.append(checkpointer := Checkpointer(self.checkpoint_dir, save_every=ck.save_every,
                                save_every_minutes=ck.save_every_minutes, save_final=ck.save_final,
                                keep_last_n=ck.keep_last_n, async_save=ck.async_save,
                                resume_from=self.resume_path, config=redact(config_to_dict(self.cfg)),
                                on_resumed=self.finish_resume, finite_only=has_guard or self.cfg.trainer.nan_guard))
        if self.cfg.fault_tolerance.enabled:
            cbs.append(ReplicaGroup(self.cfg.fault_tolerance, self.batch_for_step,
                                    save=lambda: checkpointer.save_now(self.lightning, self.module)))
        if os.environ.get("LLMFORGE_RUN_ID") and self.is_rank_zero():  # started by `llmforge launch`
            cbs.append(RunTracker(os.environ["LLMFORGE_RUN_ID"]))
        return list(self.algorithms) + cbs + extra  # algorithms are Lightning callbacks too

    def build_loggers(self) -> list[Any]:
        """Loggers from ``loggers:``; each builder is called as
        ``builder(run_dir=..., run=<cfg.run, secrets redacted>, config=<resolved config, secrets
        redacted>, **kwargs)``
        and the config is logged as the run's hyperparameters. Building checks settings (SDK
        installed, API key in the environment) but writes nothing and contacts no server: the
        built-in loggers start with their first record, after the run directory is prepared."""
        config = redact(config_to_dict(self.cfg))
        # the run section as redacted: a secret interpolated into run.tags or run.name stays out
        built = build_entries(registry.loggers, "loggers", self.cfg.loggers, base=Logger,
                              run_dir=self.run_dir, run=OmegaConf.create(config["run"]), config=config)
        for logger in built:
            logger.log_hyperparams(config)
        return built

    def build_strategy(self) -> Any:
        """The Lightning strategy: ``auto`` for one process, else :class:`LLMParallelStrategy`
        over the (dp_replicate, dp_shard, tp) mesh (``strategy.name=auto`` with several
        processes means fsdp2)."""
        name = self.cfg.strategy.name
        if name == "single" and self.world_size > 1:
            raise ConfigError(f"strategy.name=single runs one process, but the world size is "
                              f"{self.world_size}; use strategy.name=ddp or fsdp2")
        if self.world_size == 1 and name in ("auto", "single"):
            return "auto"
        return LLMParallelStrategy(self.dims)

    def build_algorithms(self) -> list[Any]:
        """``algorithms:`` instantiated (registered names, entry points or import paths) and
        checked together against the resolved run
        (:func:`llmforge.algorithms.loading.build_algorithms`)."""
        return build_algorithms(self.cfg, self.run)

    def build_pipeline(self) -> list[Any]:
        """Model transforms: the algorithms' and the strategy's parallel stages (the module's
        ``run_pipeline`` sorts them by stage, so the YAML order does not matter)."""
        algos = [t for t in (a.transform() for a in self.algorithms) if t is not None]
        return algos + strategy_transforms(self.cfg, self.dims)

    def build_lightning_trainer(self, callbacks: list[Any], loggers: list[Any]) -> L.Trainer:
        t = self.cfg.trainer
        return L.Trainer(
            accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
            strategy=self.build_strategy(), precision=PRECISIONS[t.precision],
            max_steps=t.max_steps, max_epochs=-1, callbacks=callbacks, logger=loggers or False,
            log_every_n_steps=max(1, t.log_every),  # Lightning's own callbacks log at this cadence
            enable_checkpointing=False, enable_progress_bar=t.progress_bar,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            # llmforge evaluates every eval_every steps outside Lightning's loop and then calls
            # on_validation_end (LLMModule.publish_evaluation); saying so here makes Lightning's
            # own EarlyStopping check there instead of at an epoch end that never comes
            val_check_interval=max(1, t.eval_every), check_val_every_n_epoch=None,
            use_distributed_sampler=False, default_root_dir=str(self.run_dir))

    # ---------------------------------------------------------------- run
    def setup(self) -> None:
        """Build everything that ``fit`` needs (tokenizer, data, module, Lightning trainer)."""
        L.seed_everything(self.cfg.run.seed, workers=True, verbose=False)
        self.apply_threads()  # the host allocator is tuned after the data's setup (LLMModule.setup)
        self.resume_path = self.resolve_resume()
        used = self.check_run_dir()
        # everything that can fail on bad input runs before an old run is deleted (--overwrite)
        # (loggers too: a missing SDK or API key; building one writes nothing, see build_loggers)
        callbacks, loggers = self.build_callbacks(), self.build_loggers()
        check_state_keys(callbacks)  # two plugins' states under one key: refused, not overwritten
        if self.cfg.fault_tolerance.enabled:  # before the run directory is touched
            import_torchft()
            check_lighthouse(self.cfg.fault_tolerance.lighthouse)
        docs = self.build_documents()
        self.tokenizer = self.build_tokenizer(docs)
        cached_tokens = self.cached_tokens(docs, self.tokenizer)
        self.module = self.build_module()
        if self.cfg.model.get("init_from"):  # a source of another shape fails before any write
            check_initial_weights(meta_model(self.cfg), self.cfg.model.init_from)
        self.lock_run_dir()
        try:
            self._setup_run(used, docs, cached_tokens, callbacks, loggers)
        except BaseException:
            self.run_lock.release()
            raise

    def _setup_run(self, used: bool, docs: Any, cached_tokens: Any, callbacks: list[Any],
                   loggers: list[Any]) -> None:
        """The part of :meth:`setup` that writes the run directory (under its lock)."""
        self.prepare_run_dir(used)
        if self.is_rank_zero():
            self.tokenizer.save(self.run_dir / "tokenizer")
        self.datamodule = self.build_datamodule(docs, self.tokenizer, cached_tokens)
        if isinstance(docs, PreparedMixture):  # data/<name>/tokens_seen in every logger's records
            callbacks.append(MixtureTokens([e["name"] for e in docs.entries], [e["share"] for e in docs.entries],
                                           self.cfg.run.seed, self.plan.global_batch_size, self.cfg.trainer.seq_len))
        self.lightning = self.build_lightning_trainer(callbacks, loggers)
        self.announce()

    def fit(self) -> dict[str, Any]:
        """Train; returns the closing summary (steps, tokens, seconds, final losses, paths)."""
        if self.lightning is None:
            self.setup()
        assert self.lightning is not None
        start = time.perf_counter()
        try:
            self.lightning.fit(self.module, datamodule=self.datamodule)
        finally:
            self.run_lock.release()
        return self.summary(time.perf_counter() - start)

    def summary(self, seconds: float) -> dict[str, Any]:
        """The closing summary (:func:`llmforge.training.summary.run_summary`)."""
        return run_summary(self, seconds)
