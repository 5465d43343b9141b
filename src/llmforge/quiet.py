"""What a run hides from the libraries it uses: messages that are not actionable on every run.
Ground floor: no llmforge imports."""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_libraries"]


def quiet_libraries() -> None:
    """Silence what the libraries print that a user cannot act on (Lightning's rank-zero info,
    progress bars of datasets (its logging is quieted where it is imported,
    :func:`llmforge.data.documents.hf_datasets`), warnings of torch.distributed on the CPU, ...),
    once per process:
    the CLI calls it after a config's checks, :class:`llmforge.Trainer` when it is built, so
    the Python API is as quiet as ``llmforge train``."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", module="torch.distributed.device_mesh")
    warnings.filterwarnings("ignore", module="torch.distributed.tensor._random")
    # not actionable on every run: DTensor's RNG is CUDA-only (warned from its caller's module,
    # so matched by text), and Lightning's hint that srun exists on this machine
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system")
    warnings.filterwarnings("ignore", message=".*_get_slice_mesh_layout.*|.*_rng_tracker.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
    warnings.filterwarnings("ignore", message=".*Found a non-scalar tensor with numel=1 and ndim!=0.*")
    # FSDP2's note on a view output and DTensor's redistribution hints: about torch's internals
    # (the planner's simulated step prints them), nothing a user changes in a config
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
