"""A damaged or mismatched checkpoint, a damaged runs.db and a full disk are each one
``error:`` line naming the file (and, for shapes, the parameter with both shapes), exit code 2,
never DCP's raw ``CheckpointException`` traceback (issue 21, item 4). Every case damages a copy
of one tiny 2-step run (module fixture) and calls the CLI in-process."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import DEMO, TINY_OVERRIDES
from llmforge.checkpoint.safe_load import load_metadata
from llmforge.cli import main

SHORT = [DEMO, *TINY_OVERRIDES, "trainer.eval_every=0"]
STEP = "checkpoints/step_00000002"


def run_main(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return code, errors[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run (dim 64, vocab 1024) with checkpoints at steps 1 and 2."""
    root = tmp_path_factory.mktemp("trust-ckpt")
    assert main(["train", *SHORT, f"run.output_dir={root}", "run.name=base",
                 "trainer.max_steps=2", "checkpoint.save_every=1"]) == 0
    return root / "base"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained, tmp_path / "base")
    return tmp_path / "base"


def rewrite_metadata(ckpt: Path, change) -> None:
    md = load_metadata(ckpt / ".metadata")
    change(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def generate(run: Path) -> list[str]:
    return ["generate", str(run), "--prompt", "x", "--max-new-tokens", "1"]


def test_flipped_bytes_in_a_shard_name_the_shard(run, capsys):
    ckpt = run / STEP
    offset = min(i.offset for k, i in load_metadata(ckpt / ".metadata").storage_data.items()
                 if k.fqn.startswith("model."))
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[offset + 200:offset + 260] = bytes(b ^ 0xFF for b in data[offset + 200:offset + 260])
    shard.write_bytes(bytes(data))
    code, line = run_main(generate(run), capsys)
    assert code == 2 and f"error: {shard} is corrupt (" in line, line


def test_truncated_shard_behind_a_non_string_storage_path(run, capsys):
    ckpt = run / STEP

    def as_paths(md):  # pathlib objects are allowed in the metadata; the check once skipped them
        for info in md.storage_data.values():
            info.relative_path = Path(info.relative_path)

    rewrite_metadata(ckpt, as_paths)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, line = run_main(generate(run), capsys)
    assert code == 2 and f"error: {shard} is truncated (" in line, line


@pytest.mark.parametrize("where", ["../../outside.distcp", "/etc/hostname"])
def test_storage_paths_stay_inside_the_checkpoint(run, capsys, where):
    ckpt = run / STEP
    shutil.copy(ckpt / "__0_0.distcp", run / "outside.distcp")  # a readable file elsewhere

    def redirect(md):
        for info in md.storage_data.values():
            info.relative_path = where

    rewrite_metadata(ckpt, redirect)
    code, line = run_main(generate(run), capsys)
    assert code == 2 and line == (f"error: {ckpt}/.metadata: storage path {where!r} leads outside "
                                  f"the checkpoint folder {ckpt}; refused (a checkpoint reads only "
                                  "its own files)"), line


def test_metadata_that_asks_for_absurd_memory(run, tmp_path, capsys):
    ckpt = run / STEP

    def huge(md):
        entry = md.state_dict_metadata["model.tok_embeddings.weight"]
        entry.size = torch.Size([10**12, 64])
        entry.chunks[0].sizes = torch.Size([10**12, 64])

    rewrite_metadata(ckpt, huge)
    code, line = run_main(["checkpoint", "consolidate", str(ckpt), str(tmp_path / "out")], capsys)
    assert code == 2 and f"error: {ckpt}/.metadata: tensor 'model.tok_embeddings.weight' claims " \
        "shape (1000000000000, 64) (256,000,000,000,000 bytes) but its shards hold" in line, line
    assert not (tmp_path / "out").exists()


def test_init_from_another_shape_names_the_parameter_and_writes_nothing(trained, tmp_path, capsys):
    code, line = run_main(["train", *SHORT, f"run.output_dir={tmp_path}", "run.name=small",
                           "model.dim=32", "model.n_heads=2", "model.n_kv_heads=1",
                           f"model.init_from={trained / STEP}"], capsys)
    assert code == 2 and line == (
        f"error: model.init_from: {trained / STEP}: parameter tok_embeddings.weight has shape "
        "(1024, 64) in the checkpoint, but this model's is (1024, 32); it was saved by a model of "
        "another size or architecture"), line
    assert not (tmp_path / "small").exists()


def edit_json(file: Path, change) -> None:
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("name, change, says", [
    ("trainer_state.json", lambda d: d.update(step="2"), "step is '2', not an integer >= 0"),
    ("trainer_state.json", lambda d: d.update(step=-1), "step is -1, not an integer >= 0"),
    ("trainer_state.json", lambda d: d["scheduler"].update(last_epoch="x"),
     "scheduler.last_epoch is 'x', not a number"),
    ("trainer_state.json", lambda d: d["scheduler"].update(base_lrs=["0.1"]),
     "scheduler.base_lrs is ['0.1'], not a number"),
    ("trainer_state.json", lambda d: d["scheduler"].update(base_lrs=[float("nan")]),
     "scheduler.base_lrs is [nan], not a number"),  # a NaN learning rate: NaN weights, silently
    ("trainer_state.json", lambda d: d["scheduler"].update(base_lrs=[0.1]),
     "scheduler lists differ in length (base_lrs: 1, _last_lr: 2, lr_lambdas: 2)"),
    ("rng/rank0.json", lambda d: d.update(numpy=["MT19937", [1, 2], 0, 0, 0.0]),
     "an RNG state is not valid (IndexError"),
    ("rng/rank0.json", lambda d: d.update(torch=[300]), "an RNG state is not valid"),
    ("meta.json", lambda d: d.update(world_size=0), "world_size is 0, not an integer >= 1"),
])
def test_state_files_are_checked_by_type_and_range_before_a_resume(run, capsys, name, change, says):
    ckpt = run / STEP
    edit_json(ckpt / name, change)
    code, line = run_main(["train", *SHORT, f"run.output_dir={run.parent}", "run.name=base",
                           "trainer.max_steps=3", "checkpoint.resume=auto",
                           "checkpoint.allow_config_changes=true"], capsys)
    assert code == 2 and line.startswith(f"error: {ckpt / name}: {says}"), line
    assert line.endswith(f"the previous checkpoint is checkpoint.resume={run / 'checkpoints'}/step_00000001")


def test_adapters_only_without_adapters_is_refused_not_sampled_from_random_weights(run, capsys):
    ckpt = run / STEP
    edit_json(ckpt / "meta.json", lambda d: d.update(adapters_only=True))
    code, line = run_main(generate(run), capsys)
    assert code == 2 and line.startswith(f"error: {ckpt}/meta.json: says adapters_only, but this "
                                         "run's algorithms add no adapters"), line
    edit_json(ckpt / "meta.json", lambda d: d.update(adapters_only="yes"))
    code, line = run_main(["checkpoint", "inspect", str(ckpt)], capsys)
    assert code == 2 and f"{ckpt}/meta.json: adapters_only is 'yes', not true or false" in line


def test_corrupt_runs_db_is_exit_2_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLMFORGE_HOME", str(tmp_path))
    (tmp_path / "runs.db").write_bytes(b"not a database" * 100)
    code, line = run_main(["runs", "list"], capsys)
    assert code == 2 and line.startswith(f"error: {tmp_path}/runs.db is not a readable runs "
                                         "registry (file is not a database)"), line


def full_disk(written: list):
    """A writer that writes a little of its file, then finds the disk full (ENOSPC)."""
    def write(*args, **kwargs):
        path = next(a for a in [*args, *kwargs.values()] if isinstance(a, (str, Path)) and "/" in str(a))
        Path(path).write_bytes(b"partial")
        written.append(Path(path))
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return write


@pytest.mark.parametrize("command", ["consolidate", "to-hf"])
def test_full_disk_in_an_export_leaves_no_half_written_output(trained, tmp_path, monkeypatch, capsys, command):
    import safetensors.torch

    written: list = []
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk(written))
    out = tmp_path / "out"
    argv = (["checkpoint", "consolidate", str(trained / STEP), str(out)] if command == "consolidate"
            else ["convert", "to-hf", str(trained), str(out)])
    code, line = run_main(argv, capsys)
    assert code == 2 and line.startswith(f"error: cannot write {written[0]}: No space left on device"), line
    assert f"nothing of {out}" in line and not out.exists()


def test_an_export_through_a_missing_folder_and_dotdot_is_the_path_it_names(trained, tmp_path, capsys):
    """``OUT`` given as ``new/../out`` with no ``new/``: the output is ``out``; an existing,
    non-empty ``out`` is refused without --overwrite (the path did not stat, so it was written
    into), and no ``new/`` is made."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, line = run_main(["convert", "to-hf", str(trained), str(tmp_path / "new" / ".." / "out")], capsys)
    assert code == 2 and "already exists" in line and "--overwrite" in line, line
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not (tmp_path / "new").exists()
    assert main(["checkpoint", "consolidate", str(trained / STEP), str(tmp_path / "new" / ".." / "m.safetensors")]) == 0
    assert (tmp_path / "m.safetensors").stat().st_size > 0 and not (tmp_path / "new").exists()
    # an existing file is kept unless --overwrite (consolidate replaced it silently before)
    first = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(b"mine")
    code, line = run_main(["checkpoint", "consolidate", str(trained / STEP), str(tmp_path / "m.safetensors")], capsys)
    assert code == 2 and "already exists" in line and "--overwrite" in line, line
    assert (tmp_path / "m.safetensors").read_bytes() == b"mine"
    assert main(["checkpoint", "consolidate", str(trained / STEP), str(tmp_path), "--overwrite"]) == 0
    assert main(["checkpoint", "consolidate", str(trained / STEP), str(tmp_path / "m.safetensors"), "--overwrite"]) == 0
    import safetensors.torch  # the header's key order may differ between writes: compare tensors

    again, before = safetensors.torch.load((tmp_path / "m.safetensors").read_bytes()), safetensors.torch.load(first)
    assert again.keys() == before.keys() and all(again[k].equal(before[k]) for k in before)
    assert (tmp_path / "model.safetensors").is_file()


def test_full_disk_in_data_prepare_keeps_no_partial_shard(trained, tmp_path, monkeypatch, capsys):
    import llmforge.data.prepare as prepare

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i} " + "word " * 40}) + "\n" for i in range(30)))
    real_replace = prepare.os.replace

    def replace(src, dst):  # the disk is full when the second shard is written
        if str(dst).endswith("shard_00001.bin"):
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(prepare.os, "replace", replace)
    out = tmp_path / "prepared"
    code, line = run_main(["data", "prepare", str(docs), str(out), "tokenizer.type=huggingface",
                           f"tokenizer.path={trained / 'tokenizer' / 'tokenizer.json'}",
                           "--workers", "1", "--docs-per-shard", "10", "--no-progress"], capsys)
    assert code == 2 and line.startswith(f"error: cannot write {out}/train/shard_00001.{os.getpid()}.tmp: No space "
                                         "left on device; the shards written so far are kept"), line
    assert sorted(p.name for p in (out / "train").iterdir()) == ["shard_00000.bin"]


@pytest.mark.parametrize("name", ["meta.json", ".metadata"])
def test_a_named_pipe_in_a_checkpoint_is_refused_not_waited_on(run, capsys, name):
    """A shared checkpoint with a FIFO for meta.json made `checkpoint inspect` and `generate`
    block for ever (open waits for a writer)."""
    file = run / STEP / name
    file.unlink()
    os.mkfifo(file)
    for argv in (["checkpoint", "inspect", str(run / STEP)], generate(run)):
        code, line = run_main(argv, capsys)
        assert code == 2 and line.startswith(f"error: {file} is not a regular file (a named pipe"), line
