"""Every load or write error exits 2 with one ``error:`` line naming the file, and nothing that
was written before is lost: damaged checkpoints (truncated shard, no ``.metadata``, corrupt
``trainer_state.json``/``meta.json``), a full disk during a save, an output folder that is a
file or read-only, ``trainer.module`` that is not a class. All in-process (``main([...])``)."""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import DEMO, TINY_OVERRIDES
from llmforge.cli import main

SHORT = [DEMO, *TINY_OVERRIDES, "trainer.eval_every=0"]


def run_main(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return code, errors[0]


@contextlib.contextmanager
def tmpfs(where: Path, size: str, read_only: bool = False):
    """A small tmpfs at ``where`` (a real full or read-only disk); skips where mounting is not
    allowed (not root, or a container without CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'mount failed'})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run with checkpoints at steps 1 and 2; tests damage copies of step 2."""
    root = tmp_path_factory.mktemp("bad-files")
    assert main(["train", *SHORT, f"run.output_dir={root}", "run.name=base",
                 "trainer.max_steps=2", "checkpoint.save_every=1"]) == 0
    return root / "base"


def damage(run: Path, kind: str) -> Path:
    ckpt = run / "checkpoints" / "step_00000002"
    if kind == "shard":
        shard = next(ckpt.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "metadata":
        (ckpt / ".metadata").unlink()
    elif kind == "trainer_state":
        (ckpt / "trainer_state.json").write_text('{"step": 2, "tok')
    elif kind == "meta":
        (ckpt / "meta.json").write_bytes(b"\xff\xfe{")
    elif kind == "huge_metadata":  # BINBYTES8 of 2**62 bytes: the unpickler allocates them
        (ckpt / ".metadata").write_bytes(b"\x80\x04\x8e" + (2 ** 62).to_bytes(8, "little") + b"xx")
    elif kind == "deep_state":
        (ckpt / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "linked_shard":  # a shard linked to a file outside: neither read nor sized
        shard = next(ckpt.glob("*.distcp"))
        outside = run.parent / "outside.bin"
        outside.write_bytes(shard.read_bytes() * 2)
        shard.unlink()
        shard.symlink_to(outside)
    return ckpt


@pytest.mark.parametrize("kind, command, named", [
    ("shard", "generate", "__0_0.distcp is truncated"),
    ("shard", "resume", "__0_0.distcp is truncated"),
    ("metadata", "generate", ".metadata is missing"),
    ("trainer_state", "resume", "trainer_state.json cannot be read (JSONDecodeError"),
    ("meta", "inspect", "meta.json cannot be read (UnicodeDecodeError"),
    ("meta", "generate", "meta.json cannot be read"),
    ("huge_metadata", "generate", ".metadata cannot be read (MemoryError"),
    ("deep_state", "resume", "trainer_state.json cannot be read (RecursionError"),
    ("linked_shard", "generate", "__0_0.distcp is a symbolic link to "),  # a shared run: refused before loading
])
def test_damaged_checkpoint_is_exit_2_naming_the_file(trained, tmp_path, capsys, kind, command, named):
    run = tmp_path / "base"
    shutil.copytree(trained, run)
    ckpt = damage(run, kind)
    before = {p.name: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    argv = {"generate": ["generate", str(run), "--prompt", "x", "--max-new-tokens", "1"],
            "inspect": ["checkpoint", "inspect", str(ckpt)],
            "resume": ["train", *SHORT, f"run.output_dir={tmp_path}", "run.name=base",
                       "trainer.max_steps=3", "checkpoint.resume=auto",
                       "checkpoint.allow_config_changes=true"]}[command]
    code, line = run_main(argv, capsys)
    assert code == 2 and f"{ckpt}/{named}" in line, line
    assert "does not fit" not in line  # a damaged file is not a model mismatch
    if command == "resume":  # found before data and model are built, with the way out
        assert f"the previous checkpoint is checkpoint.resume={ckpt.parent}/step_00000001" in line
    assert {p.name: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")} == before


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """A real full disk (a 1 MiB tmpfs): the second save fails with exit 2, its .tmp folder is
    gone and the first checkpoint still loads."""
    from llmforge.checkpoint.atomic_save import CheckpointWriteError
    from llmforge.checkpoint.dcp import load_training_state, save_checkpoint

    model = torch.nn.Linear(256, 512)  # 0.5 MiB of weights: one checkpoint fits, two do not
    with tmpfs(tmp_path / "disk", "1m") as disk:
        save_checkpoint(disk, 1, model, None, {"step": 1}, {"world_size": 1})
        with pytest.raises(CheckpointWriteError) as info:
            save_checkpoint(disk, 2, model, None, {"step": 2}, {"world_size": 1})
        assert info.value.exit_code == 2
        msg = str(info.value)
        assert f"cannot write checkpoint {disk}/.tmp-step_00000002: no space left" in msg
        assert f"the previous checkpoint {disk}/step_00000001 is intact" in msg
        assert sorted(p.name for p in disk.iterdir()) == ["step_00000001"]
        fresh = torch.nn.Linear(256, 512)
        assert load_training_state(disk / "step_00000001", fresh, None)["step"] == 1
        assert torch.equal(fresh.weight, model.weight)


def test_full_disk_during_training_exits_2_and_keeps_the_run(trained, tmp_path, capsys, monkeypatch):
    """ENOSPC raised inside DCP's write of the first save after a resume (simulated: no mount
    needed): exit 2, the step-2 checkpoint and the records up to the failed step stay."""
    import llmforge.checkpoint.dcp as ckpt_mod

    run = tmp_path / "base"
    shutil.copytree(trained, run)

    def full(state, checkpoint_id):
        raise OSError(errno.ENOSPC, "No space left on device", f"{checkpoint_id}/__0_0.distcp")

    monkeypatch.setattr(ckpt_mod.dcp, "save", full)
    code, line = run_main(["train", *SHORT, f"run.output_dir={tmp_path}", "run.name=base",
                           "checkpoint.save_every=1", "trainer.max_steps=4",
                           "checkpoint.resume=auto", "checkpoint.allow_config_changes=true"], capsys)
    ckpts = run / "checkpoints"
    assert code == 2 and "cannot write checkpoint" in line and "no space left on the device" in line
    assert f"the previous checkpoint {ckpts}/step_00000002 is intact" in line
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]
    assert main(["checkpoint", "inspect", str(ckpts / "step_00000002")]) == 0
    assert "step         2" in capsys.readouterr().out


def test_output_folder_that_is_a_file_or_read_only(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for out, words in [(tmp_path / "file", f"{tmp_path}/file is a file, not a folder"),
                       (tmp_path / "file" / "sub", f"{tmp_path}/file is a file")]:
        code, line = run_main(["train", *SHORT, f"run.output_dir={out}"], capsys)
        assert code == 2 and "run.output_dir:" in line and words in line, line
    code, line = run_main(["train", *SHORT, f"run.output_dir={tmp_path}",
                           f"checkpoint.dir={tmp_path / 'file'}"], capsys)
    assert code == 2 and line.startswith("error: checkpoint.dir:"), line
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        code, line = run_main(["train", *SHORT, f"run.output_dir={ro / 'runs'}"], capsys)
        assert code == 2 and f"{ro} is on a read-only file system" in line, line


def test_trainer_module_that_is_not_a_class(tmp_path, capsys):
    code, line = run_main(["train", *SHORT, f"run.output_dir={tmp_path}",
                           "trainer.module=os.path.join"], capsys)
    assert code == 2 and "trainer.module: 'os.path.join' is a function" in line, line
    assert not (tmp_path / "demo_cpu").exists()


def test_a_damaged_config_yaml_is_exit_2_naming_the_file_and_key(tmp_path, capsys):
    """Nesting past Python's recursion (RecursionError), nesting OmegaConf cannot hold, and an
    integer of 5,000 digits (ValueError) were exit 1; each names the file (and the key)."""
    cases = {"deep_list.yaml": ("trainer: " + "[" * 5000 + "]" * 5000, "is nested too deeply to read"),
             "deep_map.yaml": ("trainer: " + "{x: " * 40 + "1" + "}" * 40,
                               "nests more than 32 levels of mappings and lists"),
             "digits.yaml": (f"base: {DEMO}\ntrainer:\n  seed: {'9' * 5000}\n",
                             "at line 3, column 9: an integer of 5000 digits (at most 4300 are read)")}
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        code, line = run_main(["train", str(tmp_path / name), f"run.output_dir={tmp_path}"], capsys)
        assert code == 2 and str(tmp_path / name) in line and words in line, line
    assert line.startswith("error: trainer.seed: "), line
    assert not (tmp_path / "demo_cpu").exists()


def test_an_hf_index_naming_a_file_outside_its_folder_is_refused(tmp_path):
    """``model.safetensors.index.json`` may name ``../secret`` or a shard linked out of the
    folder; neither is opened (exit 2, the index named). A damaged index is named too."""
    from llmforge.checkpoint.hf import load_hf_weights
    from llmforge.errors import ConfigError

    hf = tmp_path / "hf"
    hf.mkdir()
    (tmp_path / "secret").write_text("not weights")
    (hf / "linked.safetensors").symlink_to(tmp_path / "secret")
    index = hf / "model.safetensors.index.json"
    for names, words in ((["../secret"], "lies outside"), (["linked.safetensors"], "lies outside"),
                         (None, "cannot be read (RecursionError)")):
        index.write_text('{"weight_map": {"w": "%s"}}' % names[0] if names else "[" * 100_000)
        with pytest.raises(ConfigError) as info:
            load_hf_weights(torch.nn.Linear(1, 1), hf)
        assert info.value.exit_code == 2 and str(index) in str(info.value) and words in str(info.value)
