"""``llmforge convert foundry IN.yaml [-o OUT.yaml]``: an LLM Foundry training YAML as the
llmforge YAML of the same run, with a report of every key (mapped, mapped with a difference,
not mapped with the reason and the nearest llmforge setting).

The input is data: its ``variables:`` and ``${...}`` references are resolved with OmegaConf,
and a resolver call (``${oc.env:HOME}``) is refused; no code in it is run or imported.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llmforge.config.foundry.context import Conversion
from llmforge.config.foundry.data import convert_loaders
from llmforge.config.foundry.model import convert_model, convert_tokenizer
from llmforge.config.foundry.monitors import (convert_callbacks, convert_checkpoints,
                                              convert_identity, convert_loggers)
from llmforge.config.foundry.training import (batch_and_duration, convert_algorithms,
                                              convert_fsdp, convert_optimizer,
                                              convert_precision, convert_scheduler)
from llmforge.config.loader import _RESOLVER, load_config
from llmforge.config.redaction import strip_url_credentials
from llmforge.config.validate import validate
from llmforge.config.yaml_files import _read_yaml
from llmforge.errors import ConfigError
from llmforge.paths import resolve_dotdot

REQUIRED = ("model", "train_loader", "max_duration", "global_train_batch_size")
"""Top-level keys every LLM Foundry training YAML has (``scripts/train/train.py``)."""
_ORDER = ("run", "model", "tokenizer", "data", "trainer", "optimizer", "scheduler", "strategy",
          "checkpoint", "algorithms", "callbacks", "loggers")


def read_foundry(path: str | Path) -> dict:
    """The Foundry YAML at ``path`` with its interpolations resolved.

    Raises:
        ConfigError: unreadable or malformed YAML, a resolver call, a reference to a missing
            key, or a file that is not a Foundry training YAML (names the key)."""
    shown = str(path)
    data = _read_yaml(Path(path), shown, None)

    def refuse(node: Any, where: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            here = f"{where}.{k}" if where else str(k)
            if isinstance(v, str) and (m := _RESOLVER.search(v)):
                raise ConfigError(f"{shown}: {here} calls the resolver '{m.group(1)}'; the converter "
                                  "reads no environment: write the value itself")
            refuse(v, here)

    refuse(data, "")
    if "trainer" in data or "data" in data:
        raise ConfigError(f"{shown}: has '{'trainer' if 'trainer' in data else 'data'}:', an llmforge "
                          "section: this is not an LLM Foundry YAML (train it with llmforge train)")
    for key in REQUIRED:
        if key not in data:
            raise ConfigError(f"{key}: {shown} has no '{key}:', so it is not an LLM Foundry training "
                              f"YAML (those have {', '.join(REQUIRED)})")
    for key in ("model", "train_loader"):
        if not isinstance(data[key], dict) or "name" not in data[key]:
            raise ConfigError(f"{key}.name: {shown}'s {key} must be a mapping with a name "
                              "(e.g. mpt_causal_lm / text), as in LLM Foundry")
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as exc:
        where = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{where}: {shown}: {str(exc).splitlines()[0]}") from None
    return resolved  # type: ignore[return-value]


def convert(path: str | Path, *, steps_per_epoch: Optional[int] = None,
            prepared: Optional[str] = None) -> Conversion:
    """Convert the Foundry YAML at ``path``; the result's ``out`` is the llmforge config (a
    dict) and its lists are the report.

    Args:
        steps_per_epoch: optimizer steps in one pass over the training data (for ``ep`` times).
        prepared: where ``llmforge data prepare`` writes an MDS loader's token shards (default:
            the MDS folder + ``-llmforge``).

    Raises:
        ConfigError: not Foundry's format, an unknown model or loader, an unparseable time
            string, a duration in epochs without ``steps_per_epoch`` (each names the key)."""
    c = Conversion(read_foundry(path))
    if c.has("variables"):
        c.used.add("variables")  # resolved into the values above
        c.mapped.append(("variables", "resolved into the values that refer to them", ""))

    def step(keys: str, fn: Any, *args: Any) -> Any:
        """``fn(c, *args)``; a value of the wrong kind in its keys (``optimizer.lr: fast``, a
        list where a name goes) is a ConfigError naming those keys, not a crash."""
        try:
            return fn(c, *args)
        except (TypeError, ValueError, ArithmeticError, KeyError, AttributeError, IndexError) as exc:
            raise ConfigError(f"{keys}: {path} has a value there the converter cannot read "
                              f"({type(exc).__name__}: {exc}); write it as LLM Foundry documents it"
                              ) from None

    step("run_name, seed", convert_identity)
    step("model", convert_model)
    step("tokenizer", convert_tokenizer)
    clock = step("global_train_batch_size, device_train_microbatch_size, max_duration, max_seq_len",
                 batch_and_duration, steps_per_epoch)
    if c.out["model"]["name"] == "llama3" and "init_from" not in c.out["model"]:
        c.set("model.max_seq_len", max(c.out["model"].get("max_seq_len") or 0, clock.seq_len))
    step("optimizer", convert_optimizer)
    step("scheduler", convert_scheduler, clock)
    step("precision", convert_precision)
    step("fsdp_config", convert_fsdp, c.out["trainer"].get("precision", "fp32"))
    step("algorithms", convert_algorithms)
    step("train_loader, eval_loader", convert_loaders, prepared)
    step("callbacks", convert_callbacks, clock)
    step("loggers", convert_loggers)
    step("save_folder, save_interval, load_path", convert_checkpoints, clock)
    for key in c.leftovers():
        c.drop(key, "not a key the converter knows", "none (check docs/migrating_from_composer.md)")
    c.defaults()
    c.out = {k: c.out[k] for k in _ORDER if k in c.out and c.out[k] != []}
    _leave_out_credentials(c)
    return c


def _leave_out_credentials(c: Conversion) -> None:
    """Drop the credentials of every URL (``s3://KEY:SECRET@bucket``, a tracking URI's
    ``user:password@``, a pre-signed URL's signature) from the converted config and the report:
    secrets come from the environment, never from a file llmforge writes."""
    before = (c.out, c.mapped, c.changed, c.unmapped, c.todo)
    c.out, c.mapped, c.changed, c.unmapped, c.todo = (_map_strings(strip_url_credentials, x)
                                                      for x in before)
    if (c.out, c.mapped, c.changed, c.unmapped, c.todo) != before:
        c.todo.append("credentials in URLs (user:password@, a signature) were left out of this file: "
                      "give them through the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                      "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, ...)")


def report(c: Conversion) -> str:
    """The closing report: counts, then the differences, the keys not mapped and what to do."""
    lines = [f"{len(c.mapped)} keys mapped, {len(c.changed)} mapped with a difference, "
             f"{len(c.unmapped)} not mapped"]
    if c.changed:
        lines.append("mapped with a difference:")
        lines += [f"  {k} -> {what}" + (f": {note}" if note else "") for k, what, note in c.changed]
    if c.unmapped:
        lines.append("not mapped (reason; nearest llmforge setting):")
        lines += [f"  {k}: {why}; nearest: {nearest}" for k, why, nearest in c.unmapped]
    if c.todo:
        lines.append("to do before training:")
        lines += [f"  - {t}" for t in c.todo]
    return "\n".join(lines)


def render(c: Conversion, source: str) -> str:
    """The output YAML: the report as a comment header, then the config."""
    head = [f"# llmforge YAML converted from the LLM Foundry YAML {source} by `llmforge convert foundry`."]
    head += [f"# {line}" for line in report(c).splitlines()]
    body = yaml.safe_dump(_map_strings(_escape_interpolations, c.out), sort_keys=False,
                          default_flow_style=False, width=100)
    return "\n".join(head) + "\n\n" + body


_BRACE = re.compile(r"(\\*)\$\{")


def _map_strings(fn: Callable[[str], str], value: Any) -> Any:
    """``value`` (dicts, lists and tuples of them) with ``fn`` applied to every string in it."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(fn, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(fn, v) for v in value)
    return value


def _escape_interpolations(text: str) -> str:
    """``text`` with each ``${`` escaped as OmegaConf escapes it: the values are resolved
    already (a Foundry ``'\\${x}'`` reads as the text ``${x}``), and llmforge would otherwise
    read that text as a reference when it loads the file. ``k`` backslashes before ``${``
    become ``2 k + 1`` (each backslash escaped, then the ``${``)."""
    return _BRACE.sub(lambda m: m[1] * 2 + "\\${", text)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_converted(src: str, out: Optional[str], *, overwrite: bool = False,
                    steps_per_epoch: Optional[int] = None, prepared: Optional[str] = None,
                    checks: Sequence[Callable[[Any], None]] = ()) -> tuple[str, str]:
    """Convert ``src`` and write it to ``out`` (``None``: return it only). The text is loaded
    with llmforge's schema before it is written, so what is written loads; what
    :func:`~llmforge.config.validate.validate` and each of ``checks`` (called with the loaded
    config; the command line passes the model family's shape check, a floor above this one)
    refuse becomes a to-do of the report.

    Returns:
        ``(yaml_text, report)``.

    Raises:
        ConfigError: as :func:`convert`; ``out`` exists and ``overwrite`` is false."""
    if out is not None and (not str(out).strip() or str(out).endswith(("/", os.sep))):
        raise ConfigError(f"-o: {out!r} is not a file path; give the path of the YAML file to write")
    target = resolve_dotdot(out) if out is not None else None
    if target is not None and target.is_dir():
        raise ConfigError(f"-o: {out} is a folder; give the path of the YAML file to write")
    if target is not None and target.exists() and not overwrite:
        raise ConfigError(f"-o: {out} already exists; choose another file or pass --overwrite")
    c = convert(src, steps_per_epoch=steps_per_epoch, prepared=prepared)
    text = render(c, src)
    where = target.parent if target is not None else Path(tempfile.gettempdir())
    made = [d for d in (where, *where.parents) if not d.exists()]  # deepest first
    where.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".yaml", dir=where, prefix=".foundry-")
    written = False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600: a config is for the team to read
        try:
            cfg = load_config(tmp)
        except ConfigError as exc:  # write nothing
            why = str(exc).replace(tmp, out or "the converted YAML")  # not the temporary file's name
            raise ConfigError(f"the converted YAML does not load ({why}): a value in {src} of a kind "
                              "llmforge does not take (fix it there), or a converter bug (please "
                              f"report it with {src})") from None
        try:  # the value checks of `train --dry-run` (Composer clamps what llmforge refuses)
            validate(cfg, world_size=None)
            for check in checks:
                check(cfg)
        except ConfigError as exc:
            c.todo.append(f"llmforge train refuses this file as written: {exc}")
            text = render(c, src)
            Path(tmp).write_text(text, encoding="utf-8")
        if target is not None:
            os.replace(tmp, target)
        written = True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        for folder in made if not written else ():  # a refused conversion leaves no empty folders
            try:
                folder.rmdir()
            except OSError:  # not empty: something else wrote there
                continue
    return text, report(c)
