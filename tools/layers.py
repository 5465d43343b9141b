#!/usr/bin/env python3
"""Import layering of a Python package: which packages depend on which, and where that runs in circles.

    python tools/layers.py [SRC_DIR] [--package llmforge] [--json]

Reads every ``.py`` file under SRC_DIR/PACKAGE as text (nothing is imported or run) and collects
``import`` / ``from ... import`` statements, at module level and inside functions alike: a
function-local import is still a dependency, it only hides it from import time. Imports under
``if TYPE_CHECKING:`` are left out (they exist for type checkers only).

A *unit* is a direct subpackage (``llmforge/data/``) or a top-level module (``llmforge/events.py``).
It prints:
- the unit graph: for each unit, the units it uses;
- circles between units (strongly connected components of more than one unit): each is a pair of
  layers that depend on each other, so neither can be understood or tested without the other;
- circles between modules inside one unit;
- the count of function-local imports, per file.
Exit status 0 always; ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


class Collector(ast.NodeVisitor):
    def __init__(self) -> None:
        self.depth = 0
        self.found: list[tuple[str, int, bool, list[str]]] = []  # (target, level, local, names)

    def _type_checking(self, node: ast.If) -> bool:
        t = node.test
        return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")

    def visit_If(self, node: ast.If) -> None:
        if self._type_checking(node):
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def _func(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _func

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.found.append((a.name, 0, self.depth > 0, []))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node.module or "", node.level, self.depth > 0, [a.name for a in node.names]))


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1
                    stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", nargs="?", default="src")
    ap.add_argument("--package", default="llmforge")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    root = Path(a.src)
    pkg_dir = root / a.package
    if not pkg_dir.is_dir():
        print(f"no package folder {pkg_dir}", file=sys.stderr)
        return 0
    files = sorted(p for p in pkg_dir.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {module_name(p, root): p for p in files}
    mod_graph: dict[str, set[str]] = defaultdict(set)
    edge_local: dict[tuple[str, str], bool] = {}
    local_count: dict[str, int] = defaultdict(int)
    for mod, path in modules.items():
        mod_graph[mod]
        c = Collector()
        try:
            c.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        except SyntaxError as e:
            print(f"cannot parse {path}: {e}", file=sys.stderr)
            continue
        is_pkg = path.name == "__init__.py"
        for target, level, local, names in c.found:
            base = resolve(mod, is_pkg, level, target or None)
            cands = [f"{base}.{n}" for n in names] + [base]
            for t in cands:
                if t in modules and t != mod:
                    mod_graph[mod].add(t)
                    edge_local[(mod, t)] = edge_local.get((mod, t), True) and local
                    if local:
                        local_count[str(path.relative_to(root))] += 1
                    break

    def unit(m: str) -> str:
        parts = m.split(".")
        if len(parts) == 1:
            return parts[0]
        if (root / Path(*parts[:2])).is_dir():
            return ".".join(parts[:2])
        return ".".join(parts[:2])

    unit_graph: dict[str, set[str]] = defaultdict(set)
    unit_edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for m, ts in mod_graph.items():
        unit_graph[unit(m)]
        for t in ts:
            if unit(t) != unit(m):
                unit_graph[unit(m)].add(unit(t))
                unit_edges[(unit(m), unit(t))].append(f"{m} -> {t}" + (" (in a function)" if edge_local[(m, t)] else ""))
    unit_cycles = sccs(unit_graph)
    inner_cycles = []
    for u in sorted(unit_graph):
        sub = {m: {t for t in ts if unit(t) == u} for m, ts in mod_graph.items() if unit(m) == u}
        inner_cycles += sccs(sub)
    total_local = sum(local_count.values())
    result = {
        "units": len(unit_graph),
        "unit_edges": sum(len(v) for v in unit_graph.values()),
        "unit_graph": {u: sorted(v) for u, v in sorted(unit_graph.items())},
        "circles_between_units": unit_cycles,
        "circles_inside_units": inner_cycles,
        "function_local_imports": total_local,
        "function_local_imports_per_file": dict(sorted(local_count.items(), key=lambda kv: -kv[1])),
    }
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{len(unit_graph)} units, {result['unit_edges']} unit-to-unit dependencies, "
          f"{len(unit_cycles)} circles between units, {len(inner_cycles)} inside units, "
          f"{total_local} function-local imports")
    for comp in unit_cycles:
        print(f"\ncircle between units ({len(comp)}): {', '.join(comp)}")
        for u in comp:
            for v in comp:
                if (u, v) in unit_edges:
                    ex = unit_edges[(u, v)]
                    print(f"  {u} -> {v}: {len(ex)} import(s), e.g. {ex[0]}")
    for comp in inner_cycles:
        print(f"\ncircle inside a unit ({len(comp)}): {', '.join(comp)}")
    print("\nfunction-local imports per file (top 15):")
    for f, n in list(result["function_local_imports_per_file"].items())[:15]:
        print(f"  {n:4d}  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
