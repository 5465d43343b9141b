"""The ``llmforge`` command line.

    llmforge train CONFIG.yaml [key=value ...] [--nproc N] [--dry-run [--simulate] [--device-memory-gib G]]
                   [--overwrite] [--debug]
    llmforge generate RUN_DIR_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T]
                      [--top-k K] [--seed S] [--chat] [--trust-code] [--debug]
    llmforge eval RUN_DIR_OR_CHECKPOINT --tasks T1,T2 [--include-path DIR] [--limit N]
                  [--num-fewshot K] [--batch-size B] [--device D] [--trust-code]
    llmforge plan CONFIG.yaml [key=value ...] --gpus N [--gpu NAME|--cluster NAME] [--json]   # layout
    llmforge algorithms          # the algorithm plugins: name, pipeline stage, summary
    llmforge runs plot RUN_DIR... [--metric train/loss] [--out FILE.png] [--x step|tokens]
    llmforge launch CONFIG.yaml [--cluster NAME] [--gpus N] [--nodes M] [--dry-run] [key=value ...]
    llmforge clusters | secrets | runs list|describe|logs|stop|delete|restart   (llmforge.cli.runs_commands)

Errors in the input print one line ``error: ...`` and exit non-zero (2 for configuration and
data errors) without a traceback; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from llmforge import signals
from llmforge.cli.data_commands import cmd_data
from llmforge.cli.handlers import (cmd_algorithms, cmd_checkpoint, cmd_convert, cmd_eval,
                                   cmd_generate, cmd_plan, cmd_runs, cmd_train)
from llmforge.cli.parser import _parser
from llmforge.cli.runs_commands import RUN_COMMANDS, TOP_COMMANDS
from llmforge.errors import LLMForgeError
from llmforge.paths import os_error_message
from llmforge.quiet import quiet_libraries


def _scrub(message: str) -> str:
    """An error message without URL credentials, the environment's credential values, or a
    value the config interpolated from the environment or held under a secret key."""
    from llmforge.config.redaction import scrub_message  # omegaconf: not imported for --help

    return scrub_message(message)


def main(argv: Optional[Sequence[str]] = None, *, own_process: Optional[bool] = None) -> int:
    """Entry point of the ``llmforge`` script; returns the exit code.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
        own_process: the process exits when this returns (default: ``argv is None``): a stop
            signal during startup, or a second Ctrl-C, ends it at once (:mod:`llmforge.signals`);
            otherwise (tests, a caller's own script) they raise.
    """
    own_process = argv is None if own_process is None else own_process
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if not hasattr(args, "overrides") or "=" not in a or a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    # before the heavy imports: a stop during startup loses nothing (see llmforge.signals); this
    # process's own command line exits at once on it, an in-process caller gets it raised
    owns_signals = args.command in ("train", "data") and signals.install(exit_at_once=own_process)
    handlers = {"train": cmd_train, "generate": cmd_generate, "algorithms": cmd_algorithms,
                "runs": cmd_runs, "checkpoint": cmd_checkpoint, "convert": cmd_convert, "eval": cmd_eval,
                "plan": cmd_plan}
    handlers.update(TOP_COMMANDS)  # launch, clusters, secrets
    handlers["data"] = cmd_data
    try:
        light = args.command in TOP_COMMANDS or getattr(args, "runs_command", None) in RUN_COMMANDS
        if not light and args.command != "train":  # train quiets them after its config checks
            quiet_libraries()  # run management imports neither datasets nor (mostly) torch
        return handlers[args.command](args)
    except Exception as exc:
        stop = None if isinstance(exc, signals.StopRequested) else signals.startup_stop()
        return _failed(args, stop or exc)  # a command's own stop message stands
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if owns_signals and own_process:  # this process's own command line: it exits next
            signals.exiting()
        elif owns_signals:  # an in-process caller (tests) gets its handlers back
            signals.uninstall()


def _failed(args: argparse.Namespace, exc: Exception) -> int:
    """Print ``exc`` as one line (its traceback with ``--debug``); returns the exit code. A
    stop signal received during startup wins over whatever it raised on its way out of the
    library code it interrupted (:func:`llmforge.signals.startup_stop`)."""
    try:
        raise exc
    except LLMForgeError as exc:
        if args.debug:
            raise
        if isinstance(exc, signals.StopRequested):
            # our own message, no secrets; and no import here: the signal may have interrupted
            # one, leaving that module half-initialized (yaml, in CI). Every rank of a
            # multi-process run stops alike (the agent forwards the signal): rank 0 says so.
            if os.environ.get("RANK", "0") == "0":
                print(f"stopped: {exc}", file=sys.stderr)
            return exc.exit_code
        print(f"error: {_scrub(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into `head` and closed
        sys.stderr.close()
        return 0
    except Exception as exc:  # a bug or an input we did not foresee: one line, no traceback
        if args.debug:
            raise
        if isinstance(exc, OSError) and exc.filename is not None:  # a read/write error: exit 2
            print(f"error: {_scrub(os_error_message(exc))}", file=sys.stderr)
            return 2
        print(f"error: {type(exc).__name__}: {_scrub(str(exc))} (run again with --debug for the "
              "traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
