"""Loading a run directory (or one checkpoint of it) for inference, evaluation and export: the one
path ``llmforge generate``, ``llmforge eval`` and ``llmforge convert to-hf`` share.

A run directory is data, whoever wrote it. Its ``config.yaml`` is read with every name resolved
to a built-in or registered one only (:func:`llmforge.registry.untrusted`; installed packages'
entry points count as registered): an ``imports:`` list, or an import path in ``model.name`` or
``algorithms:``, stops with one ``error:`` line naming the key and ``--trust-code`` (exit 2)
before anything of it is imported. ``trust_code=True`` (``--trust-code``) imports them from
``sys.path`` as ``llmforge train`` does (``PYTHONPATH``; llmforge adds no folder to it). The
config's ``callbacks:``, ``loggers:`` and ``trainer.module`` are not needed to load a model and
are never imported here. Finding the checkpoint reads ``checkpoint.dir`` as plain YAML.

The run's algorithms shape loading and export through three hooks
(:class:`~llmforge.plugin.Algorithm`), called in an order the plugins declare, never
the YAML list's:

* ``inference_model``: in the training pipeline's order (``stage``, then ``priority``, then the
  event order :func:`llmforge.events.plugin_order`), plugins without a stage last, so the model
  is rebuilt as training built it;
* ``export_model`` and ``export_adapters``: in the reverse order, so plugins that act on the
  trained model's parameters by name (``ema``'s averaged weights) run before the transforms are
  undone, last stage first (an adapter algorithm merges its adapters away).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence


from llmforge import registry
from llmforge.plugin import Algorithm, build_meta_model
from llmforge.checkpoint.dcp import load_model_weights, read_json
from llmforge.checkpoint.init_from import load_initial_weights
from llmforge.checkpoint.layout import COMPLETE, latest_checkpoint
from llmforge.config import load_config
from llmforge.config.yaml_files import _read_yaml
from llmforge.data.tokenizers import Tokenizer, load_saved
from llmforge.errors import ConfigError
from llmforge.events import plugin_order
from llmforge.parallel.init import seeded_init

__all__ = ["resolve_checkpoint", "confine_run_files", "load_run_config", "inference_plugins", "export_order",
           "load_model", "load_for_inference"]

_HOOKS = ("inference_model", "export_model", "export_adapters")


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """``(run_dir, checkpoint_dir)`` for a run directory or a checkpoint folder; the run's
    ``checkpoint.dir`` is read from its ``config.yaml`` as plain YAML (nothing is imported).

    Raises:
        ConfigError: the path is neither, or the run has no complete checkpoint (exit 2: a
            wrong path is bad input).
        ConfigError: ``config.yaml`` is not valid YAML (file, line, column).
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such run directory or checkpoint")
    if (p / COMPLETE).exists():
        for run_dir in (p.parent.parent, p.parent):
            if (run_dir / "config.yaml").exists():
                return run_dir, p
        raise ConfigError(f"{p}: checkpoint found, but no config.yaml in its run directory")
    if not (p / "config.yaml").exists():
        raise ConfigError(f"{p}: not a run directory (no config.yaml) and not a checkpoint (no {COMPLETE})")
    # a linked config.yaml is not read here (load_run_config refuses it without --trust-code)
    linked = (p / "config.yaml").is_symlink()
    section = None if linked else _read_yaml(p / "config.yaml", str(p / "config.yaml"), None).get("checkpoint")
    folder = section.get("dir") if isinstance(section, dict) else None
    ckpt_root = Path(folder) if isinstance(folder, str) and folder else p / "checkpoints"
    ckpt = latest_checkpoint(ckpt_root)
    if ckpt is None:
        raise ConfigError(f"{p}: the run has no complete checkpoint under {ckpt_root}")
    return p, ckpt


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or real.is_relative_to(r) for r in roots)


def confine_run_files(named: str | Path, run_dir: Path, ckpt: Path) -> None:
    """Without ``--trust-code``: what a run directory from elsewhere makes llmforge read stays
    inside it. The checkpoint (from ``checkpoint.dir``) must lie in ``run_dir`` unless ``named``
    (the path the user gave) is that checkpoint by a path without symbolic links; no file or folder in the checkpoint or the
    ``tokenizer`` folder may be a link leading outside those. Cheap: names only, nothing read.

    Raises:
        ConfigError: naming the key or the linked file and ``--trust-code``.
    """
    roots = [Path(os.path.realpath(run_dir))]
    real = os.path.realpath(named)
    if real == os.path.realpath(ckpt) and real == os.path.abspath(named):
        # the user named this checkpoint folder, by a path without links (a shared run's
        # `checkpoints/step_N -> your checkpoint` named directly is not an exemption)
        roots.append(Path(real))
    hint = ("a run directory from elsewhere reads none of your files: pass --trust-code if "
            "this is your own run")
    if not _inside(ckpt, roots):
        if Path(os.path.abspath(ckpt)).is_relative_to(os.path.abspath(run_dir)):  # by its name, inside
            raise ConfigError(f"{ckpt} is a symbolic link to {os.path.realpath(ckpt)}, outside the run; {hint}")
        raise ConfigError(f"{run_dir / 'config.yaml'}: checkpoint.dir leads outside the run directory "
                          f"(to {Path(os.path.realpath(ckpt)).parent}); {hint}")
    for folder in (ckpt, run_dir / "tokenizer"):
        if folder.is_symlink() and not _inside(folder, roots):  # os.walk would follow it unchecked
            raise ConfigError(f"{folder} is a symbolic link to {os.path.realpath(folder)}, "
                              f"outside the run; {hint}")
        for top, dirs, files in os.walk(folder):
            for name in dirs + files:
                entry = Path(top) / name
                if entry.is_symlink() and not _inside(entry, roots):
                    raise ConfigError(f"{entry} is a symbolic link to {os.path.realpath(entry)}, "
                                      f"outside the run; {hint}")


def load_run_config(run_dir: Path, trust_code: bool = False) -> Any:
    """The run's ``config.yaml``, its ``imports:`` imported only with ``trust_code``.

    Without ``trust_code`` the config is also confined: a ``base:`` outside ``run_dir`` and any
    resolver call (``${oc.env:NAME}``) are refused before anything is read or resolved.

    Raises:
        ConfigError: without ``trust_code``, the config names code outside the built-in and
            registered names (the key, the name and ``--trust-code``), a ``base:`` outside the
            run directory or a resolver; or an invalid config.
    """
    path = Path(run_dir) / "config.yaml"
    if not trust_code and path.is_symlink():  # a link would read any file of yours as the config
        raise ConfigError(f"{path} is a symbolic link (to {os.path.realpath(path)}); a run directory "
                          "from elsewhere reads none of your files: pass --trust-code if you made "
                          "this link yourself")
    with registry.untrusted(path, trust_code):  # and reads no file outside it, no environment
        cfg = load_config(path, confine=None if trust_code else Path(run_dir))
        registry.import_modules(cfg.imports)
    return cfg


def _pipeline_key(plugin: Any) -> tuple:
    stage = getattr(plugin, "stage", None)
    return (stage is None, int(stage or 0), int(getattr(plugin, "priority", 0)), plugin_order(plugin))


def inference_plugins(cfg: Any, trust_code: bool = False, source: str | Path = "config.yaml") -> list[Any]:
    """The run's algorithms that take part in loading or exporting its checkpoints (those that
    override ``inference_model``, ``export_model`` or ``export_adapters``), instantiated from
    ``cfg.algorithms`` and sorted in ``inference_model`` order (see the module doc; YAML order
    never matters). The others (e.g. compile) are not built, so their optional packages need not
    be installed to load a run.

    Raises:
        ConfigError: an entry names an import path (without ``trust_code``; ``source`` names
            the file in the message), one that is not an Algorithm subclass, an entry without
            a name or with an argument its class does not take.
    """
    out = []
    with registry.untrusted(source, trust_code):
        for i, entry in enumerate(cfg.algorithms or []):
            kwargs = dict(entry)
            if "name" not in kwargs:
                raise ConfigError(f"{source}: algorithms[{i}] has no name; each entry is "
                                  "{name: ..., **arguments}")
            name = kwargs.pop("name")
            cls = registry.algorithms.get(name, key=f"algorithms[{i}].name")
            if isinstance(cls, type) and any(getattr(cls, h, None) not in (None, getattr(Algorithm, h))
                                             for h in _HOOKS):
                try:
                    out.append(cls(**kwargs))
                except TypeError as exc:  # an argument the class does not take
                    raise ConfigError(f"{source}: algorithms[{i}] ({name}): {exc}; check the keys "
                                      "of this entry") from exc
    return sorted(out, key=_pipeline_key)


def export_order(plugins: Sequence[Any]) -> list[Any]:
    """``plugins`` in the order of the export hooks: the reverse of :func:`inference_plugins`'
    (stage-less plugins first, then the transforms last stage first)."""
    return sorted(plugins, key=_pipeline_key, reverse=True)


def load_model(path: str | Path, device: str = "cpu", with_plugins: bool = False,
               trust_code: bool = False) -> Any:
    """Return ``(model, cfg, run_dir)`` of a run directory or checkpoint, model in eval mode
    (with ``with_plugins``: ``(model, cfg, run_dir, plugins, checkpoint, meta)``, plugins in
    :func:`inference_plugins` order).

    The model is built on the meta device, each plugin's ``inference_model`` prepares it (e.g.
    adds adapter layers), it is materialized with the run's seeded init, and the checkpoint is
    loaded. A checkpoint of adapters only (``adapters_only`` in meta.json) gets its base from
    the run's pointer first (``model.init_from``, else the seeded init), then the adapters.

    Raises:
        ConfigError: the run's config names code and ``trust_code`` is False (see the module
            doc), its checkpoint or files lead outside it (:func:`confine_run_files`), or the
            checkpoint does not fit the model.
        ConfigError: no run directory or checkpoint at ``path`` (exit 2).
    """
    run_dir, ckpt = resolve_checkpoint(path)
    if not trust_code:
        confine_run_files(path, run_dir, ckpt)
    cfg = load_run_config(run_dir, trust_code)
    meta = read_json(ckpt, "meta.json") if (ckpt / "meta.json").exists() else {}
    source = run_dir / "config.yaml"
    plugins = inference_plugins(cfg, trust_code, source)
    with registry.untrusted(source, trust_code):
        model = build_meta_model(cfg)  # a new one: the plugins below change it
    for plugin in plugins:
        model = plugin.inference_model(model, cfg, meta)
    model.to_empty(device=device)
    seeded_init(model, cfg.run.seed)  # buffers (RoPE tables); the base of an adapter run
    adapters_only = bool(meta.get("adapters_only"))
    if adapters_only and cfg.model.get("init_from"):
        load_initial_weights(model, cfg.model.init_from)
    load_model_weights(ckpt, model, adapters_only=adapters_only)
    model.eval()
    if with_plugins:
        return model, cfg, run_dir, plugins, ckpt, meta
    return model, cfg, run_dir


def load_for_inference(path: str | Path, device: str = "cpu",
                       trust_code: bool = False) -> tuple[Any, Tokenizer, Any]:
    """Return ``(model, tokenizer, cfg)`` of a run directory or checkpoint, model in eval mode
    (see :func:`load_model`)."""
    model, cfg, run_dir = load_model(path, device, trust_code=trust_code)
    return model, load_saved(run_dir / "tokenizer"), cfg
