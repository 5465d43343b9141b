"""The table of YAML keys in docs/configuration.md, generated from the schema's field docstrings.

``python -m llmforge.config.docs`` prints the table; ``tests/test_docs.py`` checks that
docs/configuration.md holds exactly this table between the ``<!-- keys:begin -->`` and ``<!-- keys:end -->``
markers, so the documentation cannot drift from the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any

from llmforge import registry
from llmforge.config import schema

SECTIONS = {
    "run": schema.RunConfig, "model": schema.ModelConfig, "tokenizer": schema.TokenizerConfig,
    "data": schema.DataConfig, "trainer": schema.TrainerSettings,
    "optimizer": schema.OptimizerConfig, "scheduler": schema.SchedulerConfig,
    "strategy": schema.StrategyConfig, "strategy.mixed_precision": schema.MixedPrecisionConfig,
    "pipeline": schema.PipelineConfig, "context_parallel": schema.ContextParallelConfig,
    "fault_tolerance": schema.FaultToleranceConfig,
    "checkpoint": schema.CheckpointConfig,
    "compute": schema.ComputeConfig, "scheduling": schema.SchedulingConfig,
}


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass, those of its
    dataclass bases included (a subclass's own docstring of a field wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
        for prev, node in zip(body, body[1:]):
            if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                    and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
                docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return None if dataclasses.is_dataclass(value) else value
    return None


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v).replace("'", "")


def _family_specs() -> list[Any]:
    """The registered model families that are specs (a name, a ``build`` and a ``config_cls``;
    bare factories have no keys of their own), found through the registry: the config floor
    does not import :mod:`llmforge.models`."""
    return registry.models.matching(lambda o: all(hasattr(o, a) for a in ("name", "build", "config_cls")))


def _family_rows() -> list[str]:
    """Rows of each built-in family's own ``model.*`` keys (its config dataclass minus the
    generic :class:`~llmforge.config.schema.ModelConfig` keys), labelled with the family."""
    base = {f.name for f in dataclasses.fields(schema.ModelConfig)} - {"preset"}
    rows = []
    for spec in _family_specs():
        cls, family, build = spec.config_cls, spec.name, spec.build
        where = build if isinstance(build, str) else getattr(build, "__module__", "")
        if cls is None or not where.startswith("llmforge.models."):
            continue  # research and third-party families document their own keys
        docs = {**field_docs(schema.ModelConfig), **field_docs(cls)}
        for f in dataclasses.fields(cls):
            if f.name in base:
                continue
            doc = docs.get(f.name, "").replace("|", "\\|")
            rows.append(f"| `model.{f.name}` ({family}) | `{_fmt(_default(f))}` | {doc} |")
    return rows


def key_table() -> str:
    """A markdown table: key, default, meaning — one row per leaf key of every section (the
    ``model:`` keys of each built-in family after the generic ones)."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name == "mixed_precision" or (section == "model" and f.name == "preset"):
                continue
            doc = docs.get(f.name, "").replace("|", "\\|")
            rows.append(f"| `{section}.{f.name}` | `{_fmt(_default(f))}` | {doc} |")
        if section == "model":
            rows += _family_rows()
    top = field_docs(schema.TrainConfig)
    for name in ("algorithms", "callbacks", "loggers", "variables", "imports"):
        f = next(x for x in dataclasses.fields(schema.TrainConfig) if x.name == name)
        doc = top.get(name, "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{_fmt(_default(f))}` | {doc} |")
    rows.append("| `base` | — | Path of a YAML file this one extends (relative to this file). |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(key_table())
