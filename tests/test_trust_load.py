"""A run directory is data: loading one (generate, eval, convert to-hf, checkpoint tools) imports
only built-in and registered names unless ``--trust-code``; import paths are checked for their
kind before anything calls them; export hooks run in the plugins' declared order, never the
YAML list's. All in-process (``llmforge.cli.main``) on hand-made run folders (no training)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import DEMO

SHAPE = dict(preset=None, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64,
             multiple_of=16, max_seq_len=16)

PAYLOAD = '''
import pathlib
MARKER = pathlib.Path({marker!r})
MARKER.write_text("imported")  # what a shared run's own Python file would do on import


def build(cfg):
    MARKER.write_text("called")


class Evil:
    def __init__(self, **kwargs):
        MARKER.write_text("called")
'''


def _main(argv, capsys) -> tuple[int, str, str]:
    from llmforge.cli import main

    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _write_run(run: Path, algorithms=(), plugin=None) -> tuple[torch.nn.Module, object]:
    """A finished run folder of a tiny llama3 (config.yaml + checkpoints/step_00000001); returns
    the saved model and the config."""
    from llmforge.checkpoint.dcp import save_checkpoint
    from llmforge.config import save_config, structured_config
    from llmforge.models.spec import get_spec
    from llmforge.parallel.init import seeded_init

    cfg = structured_config("llama3")
    for key, value in SHAPE.items():
        cfg.model[key] = value
    cfg.run.name, cfg.run.output_dir = run.name, str(run.parent)
    cfg.algorithms = list(algorithms)
    model = get_spec("llama3")(cfg.model)
    if plugin is not None:
        model = plugin(model, cfg)
    seeded_init(model, cfg.run.seed)
    state = plugin.state(model) if plugin is not None else None
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "checkpoints", 1, model, None, {"step": 1, "tokens_seen": 0},
                    {"world_size": 1}, plugin_state=state)
    return model, cfg


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("template") / "shared"
    _write_run(run)
    return run


def _crafted(template: Path, tmp_path: Path, monkeypatch, edit) -> tuple[Path, Path, str]:
    """A copy of the template run whose config.yaml names a payload module beside it, the
    module importable (as if the working directory were on sys.path); returns (run, marker,
    module name)."""
    import shutil

    run = tmp_path / "runs" / "x"
    shutil.copytree(template, run)
    module = f"payload_{tmp_path.name.replace('-', '_').replace('[', '_').replace(']', '_')}"
    marker = tmp_path / "marker"
    (run / f"{module}.py").write_text(PAYLOAD.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(run))
    data = yaml.safe_load((run / "config.yaml").read_text())
    edit(data, module)
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return run, marker, module


def _set_imports(d, m):
    d["imports"] = [m]
    d["model"]["name"] = "lab_llama"  # registered by the imports (never imported here)


def _set_print(d, m):
    d["model"]["name"] = "builtins.print"


def _set_model_path(d, m):
    d["model"]["name"] = f"{m}.build"


def _set_algorithm(d, m):
    d["algorithms"] = [{"name": f"{m}.Evil"}]


EDITS = {"imports": (_set_imports, "imports"), "print": (_set_print, "model.name"),
         "model_path": (_set_model_path, "model.name"), "algorithm": (_set_algorithm, r"algorithms[0].name")}
COMMANDS = {"generate": lambda run, tmp: ["generate", str(run), "--prompt", "hi", "--max-new-tokens", "2"],
            "eval": lambda run, tmp: ["eval", str(run), "--tasks", "x"],
            "convert": lambda run, tmp: ["convert", "to-hf", str(run), str(tmp / "hf")]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_shared_run_folder_runs_none_of_its_code(template, tmp_path, monkeypatch, capsys, command, edit):
    fn, key = EDITS[edit]
    run, marker, module = _crafted(template, tmp_path, monkeypatch, fn)
    rc, out, err = _main(COMMANDS[command](run, tmp_path), capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: {run / 'config.yaml'}: {key} names ")
    assert "--trust-code" in lines[0] and "PYTHONPATH" in lines[0]
    assert not marker.exists() and module not in sys.modules
    assert out == ""  # builtins.print was not called with the model section
    assert not (tmp_path / "hf").exists() and not (run / "eval_harness.jsonl").exists()


@pytest.mark.parametrize("command", ["inspect", "consolidate"])
def test_checkpoint_tools_read_only_data(template, tmp_path, monkeypatch, capsys, command):
    """The checkpoint tools never read config.yaml: a hostile one changes nothing, imports nothing."""
    def hostile(d, m):
        _set_imports(d, m)
        _set_algorithm(d, m)

    run, marker, module = _crafted(template, tmp_path, monkeypatch, hostile)
    argv = ["checkpoint", command, str(run)] + ([str(tmp_path / "w.safetensors")] * (command == "consolidate"))
    rc, out, err = _main(argv, capsys)
    assert rc == 0, err
    assert not marker.exists() and module not in sys.modules
    if command == "inspect":
        assert "step         1" in out and "layers.0.attention.wq.weight" in out
    else:
        from safetensors.torch import load_file

        assert load_file(str(tmp_path / "w.safetensors"))["tok_embeddings.weight"].shape == (64, 32)


def test_trust_code_loads_the_research_run(tmp_path, monkeypatch, capsys):
    """The legitimate case: a research model family registered by the run's imports: module,
    found on PYTHONPATH; --trust-code exports it."""
    from safetensors.torch import load_file

    from llmforge.registry import models

    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "trust_lab_models.py").write_text(
        "from llmforge.models import LLAMA3\nfrom llmforge.registry import models\n"
        "models.register('trust_lab_llama', LLAMA3.derive(name='trust_lab_llama'))\n")
    run = tmp_path / "runs" / "lab_run"
    model, _ = _write_run(run)
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["imports"], data["model"]["name"] = ["trust_lab_models"], "trust_lab_llama"
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.syspath_prepend(str(lab))
    try:
        rc, _, err = _main(["convert", "to-hf", str(run), str(tmp_path / "hf")], capsys)
        assert rc == 2 and "imports names 'trust_lab_models'" in err and "trust_lab_models" not in sys.modules
        rc, out, err = _main(["convert", "to-hf", str(run), str(tmp_path / "hf"), "--trust-code"], capsys)
        assert rc == 0, err
    finally:
        models._items.pop("trust_lab_llama", None)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    torch.testing.assert_close(weights["model.embed_tokens.weight"], model.tok_embeddings.weight.detach(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("name, kind", [("builtins.print", "builtin_function_or_method"),
                                        ("subprocess.Popen", "class that is not an nn.Module"),
                                        ("shutil.rmtree", "function of the standard library")])
def test_train_checks_a_model_import_path_before_calling_it(tmp_path, capsys, name, kind):
    rc, out, err = _main(["train", DEMO, f"model.name={name}", f"run.output_dir={tmp_path}", "--dry-run"],
                         capsys)
    assert rc == 2 and err.startswith(f"error: model.name: '{name}' is a {kind}") and "not a model factory" in err
    assert out == "" and not list(tmp_path.iterdir())


def test_the_working_directory_is_not_put_on_sys_path(tmp_path, monkeypatch):
    from llmforge.errors import ConfigError
    from llmforge.registry import import_modules

    if "" in sys.path or str(tmp_path) in sys.path:
        pytest.skip("this interpreter imports from the working directory itself")
    (tmp_path / "cwd_only_module.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="imports: cannot import 'cwd_only_module'.*PYTHONPATH"):
        import_modules(["cwd_only_module"])
    assert str(tmp_path) not in sys.path


class _LoraEma:
    """Builds the model of a LoRA + EMA(use_for_export) run: adapters and their averages set to
    distinct random values, so an export shows which ones it used."""

    def __call__(self, model, cfg):
        from llmforge.algorithms.lora import LoRA

        return LoRA(rank=2, alpha=4.0, targets=["wv"], base_dtype="float32").convert(model, cfg.run.seed)

    def state(self, model):
        from llmforge.algorithms.ema import EMA

        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            ema = EMA(use_for_export=True)
            ema.attach(model)
            for t in ema.shadow.values():
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
        self.shadow = {k: v.clone() for k, v in ema.shadow.items()}
        return {ema.state_key: ema.sharded_state_dict()}


def test_export_hooks_follow_the_declared_order_not_the_yaml(tmp_path, capsys):
    from safetensors.torch import load_file

    lora = {"name": "lora", "rank": 2, "alpha": 4.0, "targets": ["wv"], "base_dtype": "float32"}
    ema = {"name": "ema", "use_for_export": True}
    exported = {}
    for order in ("lora_ema", "ema_lora"):
        build = _LoraEma()
        algos = [lora, ema] if order == "lora_ema" else [ema, lora]
        model, _ = _write_run(tmp_path / order, algos, build)
        rc, _, err = _main(["convert", "to-hf", str(tmp_path / order), str(tmp_path / f"hf_{order}")], capsys)
        assert rc == 0, err
        exported[order] = load_file(str(tmp_path / f"hf_{order}" / "model.safetensors"))
    assert exported["lora_ema"].keys() == exported["ema_lora"].keys()
    for key in exported["lora_ema"]:
        torch.testing.assert_close(exported["lora_ema"][key], exported["ema_lora"][key], rtol=0, atol=0)
    # merged from the averaged adapters: W + (alpha / rank) * B_ema @ A_ema
    prefix = "layers.0.attention.wv."
    base = model.get_submodule("layers.0.attention.wv").weight.detach()
    want = base + 2.0 * build.shadow[prefix + "lora_B.weight"] @ build.shadow[prefix + "lora_A.weight"]
    torch.testing.assert_close(exported["lora_ema"]["model.layers.0.self_attn.v_proj.weight"], want)


# ------------------------------------------------------------------ run registry and launch
@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("LLMFORGE_HOME", str(h))
    return h


def test_a_run_record_never_imports_its_backend(home, tmp_path, monkeypatch, capsys):
    from llmforge.job.records import RunRegistry

    marker = tmp_path / "marker"
    (tmp_path / "evil_backend_mod.py").write_text(PAYLOAD.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    registry = RunRegistry()
    bad = registry.create("x", "lab", "evil_backend_mod.Evil", run_id="x-000001")
    registry.set_status(bad.id, "running", "started")
    registry.create("y", "local", "local", run_id="y-000002")
    rc, out, err = _main(["runs", "list"], capsys)
    assert rc == 0, err
    assert "x-000001" in out and "(backend refused)" in out and "backend refused: x-000001 " in out
    assert out.count("refused") == 2  # the y row has no marker
    rc, out, err = _main(["runs", "stop", "x-000001"], capsys)
    assert rc == 2 and err.startswith("error: run x-000001: the run registry names backend "
                                      "'evil_backend_mod.Evil', which is neither a registered backend")
    assert not marker.exists() and "evil_backend_mod" not in sys.modules
    assert registry.get("x-000001").status == "running"  # nothing changed by the refusal
    # the user's own clusters.yaml naming it as the cluster's type is what trusts an import path
    (home / "clusters.yaml").write_text("lab:\n  type: evil_backend_mod.Evil\n")
    from llmforge.runs.backend import record_backend_allowed

    assert record_backend_allowed(registry.get("x-000001")) and not marker.exists()


@pytest.mark.parametrize("entry, words", [
    ("{name: os.system, command: 'touch MARKER'}", "'os.system' is a builtin_function_or_method, not a class"),
    ("{name: speed_monitor, every_n: 3}", "callbacks[0] (speed_monitor): "),
])
def test_launch_checks_callbacks_before_submitting(home, tmp_path, capsys, entry, words):
    from llmforge.job.records import RunRegistry

    marker = tmp_path / "marker"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base: {DEMO}\ncallbacks: [{entry.replace('MARKER', str(marker))}]\n")
    for dry in (["--dry-run"], []):
        rc, _, err = _main(["launch", str(cfg), f"run.output_dir={tmp_path / 'runs'}", *dry], capsys)
        assert rc == 2 and err.startswith("error: ") and words in err, err
    assert not marker.exists() and not (tmp_path / "runs").exists() and RunRegistry().list() == []


@pytest.mark.parametrize("entry, words", [
    ({"name": "ema", "bogus": 1}, "(ema): EMA.__init__() got an unexpected keyword"),
    ({"decay": 0.5}, "has no name")])
def test_a_malformed_algorithm_entry_in_a_shared_run_exits_2(template, tmp_path, monkeypatch, capsys, entry,
                                                             words):
    """An entry training would refuse (exit 2) is refused by generate too, not a TypeError (exit 1)."""
    run, _, _ = _crafted(template, tmp_path, monkeypatch, lambda d, m: d.update(algorithms=[entry]))
    rc, out, err = _main(COMMANDS["generate"](run, tmp_path), capsys)
    assert rc == 2 and out == "" and err.startswith(f"error: {run / 'config.yaml'}: algorithms[0] "), err
    assert words in err and err.count("\n") == 1


@pytest.mark.parametrize("name", ["eval_harness.jsonl", "metrics.jsonl"])
def test_eval_of_a_shared_run_never_appends_through_a_link(template, tmp_path, monkeypatch, capsys, name):
    """A shared run holding ``metrics.jsonl -> ~/.bashrc``: eval (which appends its scores to
    both files) exits 2 before loading anything; the file the link names is unchanged."""
    run, _, _ = _crafted(template, tmp_path, monkeypatch, lambda d, m: None)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / name).symlink_to(victim)
    rc, out, err = _main(COMMANDS["eval"](run, tmp_path), capsys)
    assert rc == 2 and err.startswith(f"error: {run / name} is a symbolic link (to {victim}); "), err
    assert victim.read_text() == "precious\n"


SECRET_FILE_TEXT = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA" + "Q9" * 12 + "\n"
PLANTED = "https://hooks.example.com/T0/" + "W4" * 10


@pytest.mark.parametrize("how", ["base", "env"])
def test_a_shared_run_reads_none_of_your_files_and_none_of_your_environment(
        template, tmp_path, monkeypatch, capsys, how):
    """Issue 47, item 3: a shared run's ``base: ~/.ssh/id_rsa`` is not opened and an
    ``${oc.env:HOOK}`` is not resolved by generate, eval or convert (exit 2, one line); the
    secret is in no output and in no file the commands write. With --trust-code (a run you
    wrote) the ``base:`` is followed, and still no message prints the file's text."""
    import shutil

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(SECRET_FILE_TEXT)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HOOK", PLANTED)  # a name outside the secret rule
    run = tmp_path / "runs" / "x"
    shutil.copytree(template, run)
    data = yaml.safe_load((run / "config.yaml").read_text())
    if how == "base":
        data["base"] = "~/.ssh/id_rsa"
        says = f"error: base in {run / 'config.yaml'} names a file outside its run directory {run}"
    else:
        data["run"]["tags"] = ["${oc.env:HOOK}"]
        says = (f"error: {run / 'config.yaml'}: run.tags.0 calls the resolver 'oc.env' "
                "(${oc.env:...}); a run directory from elsewhere reads nothing from your environment")
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    secrets = ("PRIVATE KEY", "Q9Q9Q9", PLANTED)
    for command in COMMANDS:
        rc, out, err = _main(COMMANDS[command](run, tmp_path), capsys)
        assert rc == 2 and err.startswith(says) and err.count("\n") == 1, err
        assert "--trust-code" in err and not any(s in out + err for s in secrets)
    if how == "base":  # trusted: the base is read, but its text is never quoted
        rc, out, err = _main(["generate", str(run), "--prompt", "hi", "--trust-code"], capsys)
        assert rc == 2 and "id_rsa must be a mapping of sections" in err and err.endswith("got a string\n"), err
        assert not any(s in out + err for s in secrets)
    if how == "env":  # a config.yaml that links to a file of yours is not read either
        (run / "config.yaml").unlink()
        (run / "config.yaml").symlink_to(home / ".ssh" / "id_rsa")
        rc, out, err = _main(COMMANDS["generate"](run, tmp_path), capsys)
        assert rc == 2 and err.startswith(f"error: {run / 'config.yaml'} is a symbolic link"), err
        assert not any(s in out + err for s in secrets)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and home not in p.parents]
    assert not [p for p in written for s in secrets if s.encode() in p.read_bytes()]


def test_alias_bombs_and_huge_configs_are_refused_at_once(tmp_path, capsys):
    """The "billion laughs" shape (9 levels of 9 aliases: 1 KB that OmegaConf would expand into
    387 million values) and a merge-key doubling are refused in well under a second."""
    import time

    from llmforge.cli import main

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))
    merge = "a: &a {x: 1}\n" + "".join(
        f"m{i + 1}: &m{i + 1} {{<<: [*{'a' if i == 0 else f'm{i}'}], y{i}: [*{'a' if i == 0 else f'm{i}'}, "
        f"*{'a' if i == 0 else f'm{i}'}]}}\n" for i in range(24))
    for name, text in (("bomb", bomb), ("merge", merge)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"base: {DEMO}\nvariables:\n" + "".join("  " + line + "\n" for line in text.splitlines()))
        start = time.monotonic()
        assert main(["train", str(path), "--dry-run"]) == 2
        assert time.monotonic() - start < 5
        err = capsys.readouterr().err
        assert err == (f"error: {path}: its aliases (*name) and merge keys (<<) expand to more than "
                       "200,000 values; a config repeats a section by an alias, not by aliases of "
                       "aliases: write the values out, or use ${...} interpolation\n"), err
    # ${...} references of references grow as fast (a breaker's variant): refused before resolving
    refs = "  s0: xxxxxxxxxx\n" + "".join(f"  s{i}: '{'${variables.s%d}' % (i - 1) * 10}'\n" for i in range(1, 9))
    path = tmp_path / "refs.yaml"
    path.write_text(f"base: {DEMO}\nvariables:\n{refs}")
    start = time.monotonic()
    assert main(["train", str(path), "--dry-run"]) == 2 and time.monotonic() - start < 5
    assert capsys.readouterr().err == ("error: variables: its ${...} interpolations would resolve to more "
                                       "than 10,000,000 characters (references of references); write the "
                                       "values out instead\n")
    big = tmp_path / "big.yaml"
    big.write_text("variables:\n  blob: '" + "x" * (5 << 20) + "'\n")
    assert main(["train", str(big), "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"error: config file {big} is larger than 4 MiB; a config holds "
                                       "settings, not data: give data files under data.path\n")


@pytest.mark.parametrize("how", ["checkpoint_dir", "meta_link", "folder_link", "tokenizer_link", "named_link"])
def test_a_shared_run_reads_no_checkpoint_of_yours(template, tmp_path, monkeypatch, capsys, how):
    """A shared run whose ``checkpoint.dir`` names your run's checkpoints, whose checkpoint
    holds a link to a file or folder of yours, or whose ``tokenizer`` folder is such a link: every loading command exits 2 naming it and
    ``--trust-code``, before reading anything."""
    import shutil

    yours = tmp_path / "yours"
    shutil.copytree(template / "checkpoints", yours)
    edit = ((lambda d, m: d["checkpoint"].update(dir=str(yours))) if how == "checkpoint_dir"
            else (lambda d, m: None))
    run, _, _ = _crafted(template, tmp_path, monkeypatch, edit)
    ckpt = next((run / "checkpoints").glob("step_*"))
    if how == "meta_link":
        (ckpt / "meta.json").unlink()
        (ckpt / "meta.json").symlink_to(next(yours.glob("step_*")) / "meta.json")
    if how == "folder_link":
        shutil.rmtree(ckpt / "rng")
        (ckpt / "rng").symlink_to(yours)
    if how == "tokenizer_link":  # the tokenizer folder itself, not a file in it
        (run / "tokenizer").symlink_to(yours)
    named = run
    if how == "named_link":  # `checkpoints/step_N -> your checkpoint`, named directly
        shutil.rmtree(ckpt)
        ckpt.symlink_to(next(yours.glob("step_*")))
        named = ckpt
    for command in COMMANDS:
        rc, out, err = _main(COMMANDS[command](named, tmp_path), capsys)
        assert rc == 2 and err.count("\n") == 1 and "--trust-code" in err, err
        if how == "checkpoint_dir":
            assert err.startswith(f"error: {run / 'config.yaml'}: checkpoint.dir leads outside the run "
                                  f"directory (to {yours})"), err
        else:
            assert "is a symbolic link to " in err and str(yours) in err, err
