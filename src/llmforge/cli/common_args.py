"""Arguments every ``llmforge`` command has (shared by the parser modules of :mod:`llmforge.cli`)."""

from __future__ import annotations

import argparse


def add_debug(p: argparse.ArgumentParser) -> None:
    """``--debug``: show tracebacks instead of one ``error:`` line (every command has it)."""
    p.add_argument("--debug", action="store_true", help="show tracebacks")
