"""Resident memory at each stage of a run: llmforge against the plain Lightning peer of peers.py.

    python benchmarks/memory_stages.py llmforge [--steps 4] [override ...]
    python benchmarks/memory_stages.py lightning [--steps 4]

One process, the work of ``benchmarks/peers.py`` (demo model, data, batch; llmforge exactly as
``overhead.py`` runs it, the Lightning peer on the packed windows ``peers.prepared`` builds or
reads from ``$PEERS_ROWS_CACHE``). Prints, after each import and each stage (llmforge: every
``Trainer.build_*``, ``cached_tokens`` (the in-memory ids read or tokenized), the data
module's ``setup``, ``configure_model``, ``configure_optimizers``, each evaluation and
training step; the peer: the prepared rows, ``fit``, steps), the process's
``VmRSS``, ``VmHWM`` (peak so far), ``RssAnon`` and ``RssFile`` in MiB from
``/proc/self/status`` (Linux). Peak RSS hardly depends on the machine's load, so this runs on a
busy machine. Extra arguments are llmforge config overrides (``trainer.malloc_tuning=false``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))


def mem(label: str) -> None:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) // 1024
    print(f"{time.perf_counter() - T0:7.1f}s {label:28s} RSS {d['VmRSS']:5d}  peak {d['VmHWM']:5d}  "
          f"anon {d['RssAnon']:5d}  file {d['RssFile']:5d}  MiB", flush=True)


def wrap(cls: type, name: str) -> None:
    """Print the memory before and after every call of ``cls.name``."""
    orig = getattr(cls, name)

    def probed(self, *args, **kwargs):
        mem(f"> {name}")
        out = orig(self, *args, **kwargs)
        mem(f"< {name}")
        return out

    setattr(cls, name, probed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trainer", choices=["llmforge", "lightning"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="llmforge config overrides")
    args = ap.parse_args()
    mem("start")
    import torch  # noqa: F401

    mem("import torch")
    import lightning as L

    mem("import lightning")
    from lightning.pytorch.callbacks import Callback

    import peers
    from overhead import config

    steps = args.steps

    class Probe(Callback):
        def on_train_start(self, trainer, pl_module):
            mem("on_train_start")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            mem(f"after step {trainer.global_step}")

    work = Path(tempfile.mkdtemp())
    if args.trainer == "llmforge":
        from llmforge import Trainer
        from llmforge.data.datamodule import LLMDataModule
        from llmforge.training.module import LLMModule

        mem("import llmforge")
        for name in ("build_callbacks", "build_loggers", "build_documents", "build_tokenizer",
                     "cached_tokens", "build_module", "build_datamodule", "build_lightning_trainer"):
            wrap(Trainer, name)
        wrap(LLMDataModule, "setup")
        for name in ("configure_model", "configure_optimizers", "evaluate"):
            wrap(LLMModule, name)
        trainer = Trainer(config(["trainer.eval_batches=1", *args.overrides], steps, work),
                          overwrite=True)
        trainer.setup()
        trainer.lightning.callbacks.append(Probe())
        trainer.lightning.fit(trainer.module, datamodule=trainer.datamodule)
    else:
        orig_prepared, orig_fit = peers.prepared, L.Trainer.fit

        def prepared(*a, **k):
            out = orig_prepared(*a, **k)
            mem("prepared rows")
            return out

        def fit(self, *a, **k):
            self.callbacks.append(Probe())
            mem("> fit")
            return orig_fit(self, *a, **k)

        peers.prepared, L.Trainer.fit = prepared, fit
        peers.worker_lightning(["trainer.eval_batches=1"], steps, 1, work)
    mem("end")
    # llmforge imports Hugging Face datasets only where it reads documents (~80 MiB resident)
    print(f"datasets imported: {'datasets' in sys.modules}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
