"""Code examples of the docs, loaded as modules so that tests run them as written."""

from __future__ import annotations

import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESEARCH = REPO / "docs" / "research.md"


def code_block(doc: Path, marker: str) -> str:
    """The code block of ``doc`` whose first line starts with ``marker`` (e.g.
    ``# my_lab/module.py``), as written, up to its closing fence."""
    text = doc.read_text()
    assert marker in text, f"{doc} has no code block starting with {marker!r}"
    return marker + text.split(marker, 1)[1].split("```", 1)[0]


def write_research_package(folder: Path) -> list[str]:
    """Write every ``# my_lab/NAME.py`` block of docs/research.md to ``folder/my_lab/NAME.py``
    (a package importable with ``folder`` on ``sys.path``); returns the module names."""
    import re

    names = re.findall(r"^# my_lab/(\w+)\.py", RESEARCH.read_text(), flags=re.M)
    (folder / "my_lab").mkdir(parents=True, exist_ok=True)
    (folder / "my_lab" / "__init__.py").write_text("")
    for name in names:
        (folder / "my_lab" / f"{name}.py").write_text(code_block(RESEARCH, f"# my_lab/{name}.py"))
    return [f"my_lab.{n}" for n in names]


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
