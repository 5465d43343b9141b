"""Code examples of the docs, loaded as modules so that tests run them as written."""

from __future__ import annotations

import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def grad_noise() -> types.ModuleType:
    """docs/algorithms/README.md's DTensor example (``# my_lab/grad_noise.py``: ``GradNoise``,
    ``local_piece``) as a fresh module; used in one process and on 2 (tests/dist/fsdp_worker.py)."""
    doc = REPO / "docs" / "algorithms" / "README.md"
    marker = "# my_lab/grad_noise.py"
    code = marker + doc.read_text().split(marker, 1)[1].split("```", 1)[0]
    module = types.ModuleType("my_lab.grad_noise")
    exec(compile(code, str(doc), "exec"), module.__dict__)  # the docs' own text: trusted
    return module


def confidence_penalty_source() -> str:
    """docs/migrating_from_composer.md's ported algorithm (``# my_lab/confidence_penalty.py``)."""
    doc = REPO / "docs" / "migrating_from_composer.md"
    marker = "# my_lab/confidence_penalty.py"
    return marker + doc.read_text().split(marker, 1)[1].split("```", 1)[0]
