"""``llmforge train CONFIG --nproc N``: N local processes through torchrun's launcher API.

The parent is torch's elastic agent (``torch.distributed.launcher.elastic_launch``, what
``torchrun --standalone --nproc-per-node N`` runs); every worker runs
``python -m llmforge train CONFIG ...`` with the torchelastic environment (RANK, WORLD_SIZE,
MASTER_ADDR, ...), which Lightning detects. Each worker chooses its compute threads from the
cores it may use, its share of them and its data workers
(:func:`llmforge.parallel.threads.choose_num_threads`; ``OMP_NUM_THREADS`` if set).
This process holds the run's lock; its workers die with it
(:func:`llmforge.job.torchrun.die_with_launcher`), so a SIGKILL of the launcher leaves no rank
training beside the run that resumes it.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Sequence

from llmforge import signals
from llmforge.errors import LLMForgeError
from llmforge.job.torchrun import _forward_usr1, exit_code, signal_exit_code
from llmforge.run_guard import LAUNCHER_ENV


def launch_local(nproc: int, argv: Sequence[str]) -> int:
    """Run ``python -m llmforge *argv`` in ``nproc`` processes; returns the exit code.

    A failed worker's own message has already been printed by the worker; the exit code is
    :func:`llmforge.job.torchrun.exit_code`'s (75 when a worker saved on a stop signal, 2 for
    configuration errors, else the first failed rank's); when this process got SIGTERM/SIGINT
    (torch's agent has passed it on to the workers; SIGUSR1 is forwarded), the workers' code:
    :func:`llmforge.job.torchrun.signal_exit_code`.
    """
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the workers own the stop signals from here: torch's agent forwards SIGTERM/SIGINT to them,
    # and SIGUSR1 (SLURM's warning) is forwarded as llmforge.job.torchrun does
    signals.uninstall()
    signal.signal(signal.SIGUSR1, _forward_usr1)
    # the workers die with this process (it holds the run's lock): die_with_launcher
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "llmforge", *argv)
    except ChildFailedError as exc:
        return exit_code(exc.failures)  # 75 when a worker saved on a stop signal, else 2, else the first
    except SignalException as exc:  # the agent got SIGTERM/SIGINT and stopped the workers
        return signal_exit_code(int(exc.sigval))
    except Exception as exc:  # rendezvous or agent failure
        raise LLMForgeError(f"--nproc {nproc}: the local launcher failed: {exc}") from exc
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
    return 0
