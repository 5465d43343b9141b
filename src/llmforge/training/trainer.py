"""``llmforge.Trainer``: config -> tokenizer, data, model, callbacks, loggers -> ``lightning.Trainer.fit``.

Subclass it and override any ``build_*`` method to change one piece; the rest stays::

    from llmforge import Trainer

    trainer = Trainer.from_yaml("yamls/demo_cpu.yaml", ["trainer.max_steps=50"])
    summary = trainer.fit()
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
from omegaconf import DictConfig

from llmforge import registry
from llmforge.callbacks import Checkpointer, RichProgress, SpeedMonitor
from llmforge.checkpoint import list_checkpoints
from llmforge.config import config_to_dict, load_config, redact, save_config, validate
from llmforge.data.datamodule import LLMDataModule
from llmforge.data.shakespeare import cache_root
from llmforge.data.sources import DocumentSplits, iter_texts, load_documents
from llmforge.data.tokenizers import Tokenizer, build_tokenizer, check_vocab
from llmforge.errors import ConfigError
from llmforge.parallel.mesh import ParallelDims
from llmforge.parallel.strategy import LLMParallelStrategy
from llmforge.parallel.transforms import strategy_transforms

PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true"}


def detect_world_size(cfg: Any) -> int:
    """``WORLD_SIZE`` from a launcher (torchrun; SLURM's ``SLURM_NTASKS``), else devices x nodes.

    Under a launcher, ``trainer.devices`` and ``trainer.num_nodes`` are set from it
    (``LOCAL_WORLD_SIZE`` / ``SLURM_NTASKS_PER_NODE``), so the YAML need not repeat them.
    """
    env = os.environ
    if env.get("WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE"):
        world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    elif env.get("SLURM_NTASKS") and env.get("SLURM_NTASKS_PER_NODE") and not env.get("WORLD_SIZE"):
        world = int(env["SLURM_NTASKS"])
        local = int(env["SLURM_NTASKS_PER_NODE"].split("(")[0])
    else:
        return cfg.trainer.devices * cfg.trainer.num_nodes
    cfg.trainer.devices, cfg.trainer.num_nodes = local, max(1, world // local)
    return world


def build_entries(reg: registry.Registry, section: str, entries: Any, **inject: Any) -> list[Any]:
    """Instantiate ``[{name: ..., **kwargs}]`` entries from a registry.

    Raises:
        ConfigError: unknown name, or keyword arguments the class does not accept.
    """
    out = []
    for i, entry in enumerate(entries):
        kwargs = dict(entry)
        name = kwargs.pop("name")
        key = f"{section}[{i}]"
        factory = reg.get(name, key=f"{key}.name")
        try:
            out.append(factory(**inject, **kwargs))
        except TypeError as exc:
            raise ConfigError(f"{key} ({name}): {exc}; check the keys of this entry") from exc
    return out


class Trainer:
    """Builds every piece of a run from a resolved config and runs ``lightning.Trainer.fit``.

    Args:
        cfg: a config from :func:`llmforge.config.load_config`.
        overwrite: delete an existing run directory of the same name first.

    Raises:
        ConfigError: invalid settings (see :func:`llmforge.config.validate`), or a run directory
            that already holds a run (use another ``run.name`` or ``overwrite``).
    """

    def __init__(self, cfg: DictConfig, *, overwrite: bool = False) -> None:
        self.cfg = cfg
        registry.import_modules(cfg.imports)
        self.world_size = detect_world_size(cfg)
        self.plan = validate(cfg, self.world_size)
        if cfg.strategy.name == "auto" and self.world_size > 1:
            cfg.strategy.name = "fsdp2"
        self.dims = ParallelDims.from_config(cfg, self.world_size)
        strategy_transforms(cfg, self.dims)  # reject impossible strategy settings up front
        self.run_dir = Path(cfg.run.output_dir) / cfg.run.name
        self.checkpoint_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.overwrite = overwrite
        self.tokenizer: Optional[Tokenizer] = None
        self.module: Any = None
        self.datamodule: Optional[LLMDataModule] = None
        self.lightning: Optional[L.Trainer] = None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = (), **kwargs: Any) -> "Trainer":
        """Load ``path`` with dotlist ``overrides`` and build a Trainer."""
        return cls(load_config(path, overrides), **kwargs)

    # ------------------------------------------------------------- pieces
    def is_rank_zero(self) -> bool:
        return int(os.environ.get("RANK", "0")) == 0

    def prepare_run_dir(self) -> None:
        """Create the run directory and write the resolved config (secrets redacted)."""
        used = (self.run_dir / "metrics.jsonl").exists() or bool(list_checkpoints(self.checkpoint_dir))
        if used and not self.overwrite:
            raise ConfigError(
                f"run directory {self.run_dir} already holds a run; choose another run.name "
                "(e.g. run.name=my-run-2) or pass --overwrite to delete it"
            )
        if used and self.overwrite and self.is_rank_zero():
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.is_rank_zero():
            save_config(self.cfg, self.run_dir / "config.yaml")

    def model_vocab_size(self) -> int:
        """Embedding rows of the configured model, read from a build on the meta device."""
        factory = registry.models.get(self.cfg.model.name, key="model.name")
        with torch.device("meta"):
            model = factory(self.cfg.model)
        return int(model.vocab_size)

    def build_documents(self) -> DocumentSplits:
        return load_documents(self.cfg.data, self.cfg.run.seed)

    def build_tokenizer(self, docs: DocumentSplits) -> Tokenizer:
        """Build (or train and cache) the tokenizer, check it fits the model, save it in the run."""
        max_bytes = self.cfg.tokenizer.train_max_bytes
        tok = build_tokenizer(self.cfg.tokenizer, lambda: iter_texts(docs.train, max_bytes),
                              cache_dir=cache_root() / "tokenizers", fingerprint=docs.fingerprint)
        check_vocab(tok, self.model_vocab_size())
        if self.is_rank_zero():
            tok.save(self.run_dir / "tokenizer")
        return tok

    def build_datamodule(self, docs: DocumentSplits, tokenizer: Tokenizer) -> LLMDataModule:
        t = self.cfg.trainer
        return LLMDataModule(docs, tokenizer, seq_len=t.seq_len,
                             local_batch_size=self.plan.local_batch_size,
                             micro_batch_size=t.micro_batch_size, eval_batches=t.eval_batches,
                             seed=self.cfg.run.seed, num_workers=self.cfg.data.num_workers)

    def build_module(self) -> Any:
        """Instantiate ``trainer.module`` (an :class:`LLMModule` or a subclass)."""
        cls = registry.import_object(self.cfg.trainer.module, key="trainer.module")
        try:
            return cls(self.cfg, self.plan, pipeline=self.build_pipeline(),
                       **dict(self.cfg.trainer.module_kwargs))
        except TypeError as exc:
            raise ConfigError(f"trainer.module_kwargs: {exc}") from exc

    def build_callbacks(self) -> list[Any]:
        """Speed monitor, progress bar, checkpointer, then the YAML's ``callbacks:``."""
        ck = self.cfg.checkpoint
        cbs: list[Any] = [SpeedMonitor()]
        if self.cfg.trainer.progress_bar:
            cbs.append(RichProgress())
        cbs.append(Checkpointer(self.checkpoint_dir, ck.save_every, ck.save_final, ck.keep_last_n,
                                config=config_to_dict(self.cfg)))
        return cbs + build_entries(registry.callbacks, "callbacks", self.cfg.callbacks)

    def build_loggers(self) -> list[Any]:
        """Loggers from ``loggers:``; each builder is called as
        ``builder(run_dir=..., run=cfg.run, config=<resolved config, secrets redacted>, **kwargs)``
        and the config is logged as the run's hyperparameters."""
        import llmforge.loggers  # noqa: F401  (registers the built-in loggers)

        config = redact(config_to_dict(self.cfg))
        built = build_entries(registry.loggers, "loggers", self.cfg.loggers, run_dir=self.run_dir,
                              run=self.cfg.run, config=config)
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

    def build_pipeline(self) -> list[Any]:
        """Model transforms: the strategy's parallel stages (algorithms join in a later issue)."""
        return strategy_transforms(self.cfg, self.dims)

    def build_lightning_trainer(self, callbacks: list[Any], loggers: list[Any]) -> L.Trainer:
        t = self.cfg.trainer
        return L.Trainer(
            accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
            strategy=self.build_strategy(), precision=PRECISION[t.precision],
            max_steps=t.max_steps, max_epochs=-1, callbacks=callbacks, logger=loggers or False,
            enable_checkpointing=False, enable_progress_bar=t.progress_bar,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            use_distributed_sampler=False, default_root_dir=str(self.run_dir))

    # ---------------------------------------------------------------- run
    def setup(self) -> None:
        """Build everything that ``fit`` needs (tokenizer, data, module, Lightning trainer)."""
        L.seed_everything(self.cfg.run.seed, workers=True, verbose=False)
        self.prepare_run_dir()
        docs = self.build_documents()
        self.tokenizer = self.build_tokenizer(docs)
        self.datamodule = self.build_datamodule(docs, self.tokenizer)
        self.module = self.build_module()
        self.lightning = self.build_lightning_trainer(self.build_callbacks(), self.build_loggers())

    def fit(self) -> dict[str, Any]:
        """Train; returns the closing summary (steps, tokens, seconds, final losses, paths)."""
        if self.lightning is None:
            self.setup()
        assert self.lightning is not None
        start = time.perf_counter()
        self.lightning.fit(self.module, datamodule=self.datamodule)
        return self.summary(time.perf_counter() - start)

    def summary(self, seconds: float) -> dict[str, Any]:
        history = self.module.history
        train = [r for r in history if "train/loss" in r]
        ckpt = next((c.last_path for c in self.lightning.callbacks if isinstance(c, Checkpointer)), None)
        last_eval = self.module.last_eval or {}
        first_eval = next((r["eval/loss"] for r in history if "eval/loss" in r), None)
        return {
            "steps": self.lightning.global_step,
            "tokens": self.module.tokens_seen,
            "seconds": seconds,
            "final_train_loss": train[-1]["train/loss"] if train else None,
            "initial_eval_loss": first_eval,
            "final_eval_loss": last_eval.get("eval/loss"),
            "run_dir": str(self.run_dir),
            "checkpoint": str(ckpt) if ckpt else None,
        }
