"""The floors of docs/architecture.md hold: no import runs uphill, no circle between or inside
packages, and function-local imports stay few (each a lazy import of a heavy module kept off the
CLI's fast path). Reads the sources as text with tools/layers.py; nothing is imported."""

import importlib.util
import json

from conftest import REPO

# docs/architecture.md, bottom to top: a unit imports only from its own floor's ground-floor
# neighbours or from floors below it
FLOORS = [
    {"llmforge", "llmforge.errors", "llmforge.paths", "llmforge.signals", "llmforge.registry",
     "llmforge.events", "llmforge.plugin", "llmforge.run_guard", "llmforge.quiet", "llmforge.host_malloc"},
    {"llmforge.config"},
    {"llmforge.models"},
    {"llmforge.parallel"},
    {"llmforge.data"},
    {"llmforge.checkpoint"},
    {"llmforge.preflight", "llmforge.generate", "llmforge.loggers", "llmforge.job"},
    {"llmforge.evaluation"},
    {"llmforge.callbacks"},
    {"llmforge.algorithms"},
    {"llmforge.training"},
    {"llmforge.planning"},
    {"llmforge.runs"},
    {"llmforge.cli"},
    {"llmforge.__main__"},
]
MAX_FUNCTION_LOCAL_IMPORTS = 60


def _layers() -> dict:
    spec = importlib.util.spec_from_file_location("layers_tool", REPO / "tools" / "layers.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_no_circles_and_few_function_local_imports(capsys):
    _layers().main([str(REPO / "src"), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["circles_between_units"] == [], "import circle between packages (tools/layers.py src)"
    assert result["circles_inside_units"] == [], "import circle inside a package (tools/layers.py src)"
    assert result["function_local_imports"] <= MAX_FUNCTION_LOCAL_IMPORTS, (
        f"{result['function_local_imports']} function-local imports (at most {MAX_FUNCTION_LOCAL_IMPORTS}): "
        "move the shared piece down a floor instead of hiding an import in a function")
    floor = {u: i for i, units in enumerate(FLOORS) for u in units}
    unknown = sorted(set(result["unit_graph"]) - set(floor))
    assert unknown == [], f"{unknown}: give each new package a floor in docs/architecture.md and here"
    uphill = [f"{u} -> {v}" for u, vs in result["unit_graph"].items() for v in vs
              if floor[v] > floor[u] or (floor[v] == floor[u] and floor[u] > 0)]
    assert uphill == [], f"imports that run uphill or sideways (docs/architecture.md): {uphill}"
