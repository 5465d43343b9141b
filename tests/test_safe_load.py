"""No checkpoint can run code: DCP metadata and non-tensor entries are read with allow-lists.

Every path that loads a checkpoint (``generate``, ``checkpoint inspect``, ``checkpoint
consolidate``, ``train checkpoint.resume=auto``, ``model.init_from``) is given a crafted
``.metadata`` that walks from an allowed module to ``os.system`` (pickle protocol 4 dotted name,
the hole of the old module-prefix allow-list): nothing runs, exit 2, and the message names the
file and says it was refused.
"""

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import DEMO, TINY_OVERRIDES
from llmforge.checkpoint import load_model_weights, save_checkpoint
from llmforge.checkpoint.dcp import load_training_state
from llmforge.checkpoint.safe_load import SAFE_GLOBALS, CheckpointReadError, UnsafeCheckpointError, load_metadata


class Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > pwned.txt",))


def _s(text: str) -> bytes:  # SHORT_BINUNICODE
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def dotted_payload(marker: Path) -> bytes:
    """Protocol 4: ``STACK_GLOBAL('torch.distributed.checkpoint.filesystem', 'os.system')``
    resolves by walking attributes (the module imports ``os``), then calls it."""
    return (b"\x80\x04" + _s("torch.distributed.checkpoint.filesystem") + _s("os.system") + b"\x93"
            + _s(f"touch {marker}") + b"\x85R.")


def make(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    pending = save_checkpoint(tmp_path / "ck", 1, model, opt, {"step": 1}, {"world_size": 1})
    return model, opt, pending.final


def test_round_trip_loads_model_and_optimizer(tmp_path):
    model, opt, path = make(tmp_path)
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    state = load_training_state(path, fresh, fresh_opt)
    assert state["step"] == 1
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.param_groups[0]["lr"] == 0.1  # non-tensor entries read back safely
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"],
                               opt.state_dict()["state"][0]["exp_avg"])


def test_allow_list_is_exact_pairs_only():
    assert all("." not in name for _, name in SAFE_GLOBALS)
    assert not any(mod.endswith(".") for mod, _ in SAFE_GLOBALS)  # never a module prefix


@pytest.mark.parametrize("payload", ["reduce", "dotted", "dotted_torch"])
def test_malicious_metadata_is_refused(tmp_path, monkeypatch, payload):
    monkeypatch.chdir(tmp_path)
    _, _, path = make(tmp_path)
    marker = tmp_path / "pwned"
    data = {"reduce": lambda: pickle.dumps(Evil()),
            "dotted": lambda: dotted_payload(marker),
            # a dtype-looking name under `torch` that is really an attribute walk
            "dotted_torch": lambda: (b"\x80\x04" + _s("torch") + _s("os.system") + b"\x93"
                                     + _s(f"touch {marker}") + b"\x85R.")}[payload]()
    (path / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refers to .*refused"):
        load_model_weights(path, torch.nn.Linear(4, 3))
    assert not marker.exists() and not (tmp_path / "pwned.txt").exists()


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"a": [1, 2]}))
    with pytest.raises(UnsafeCheckpointError, match="not DCP metadata"):
        load_metadata(tmp_path / ".metadata")


def test_missing_or_truncated_metadata_is_a_read_error(tmp_path):
    _, _, path = make(tmp_path)
    whole = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointReadError, match="truncated or corrupt") as info:
        load_metadata(path / ".metadata")
    assert info.value.exit_code == 2
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointReadError, match="is missing"):
        load_metadata(path / ".metadata")


def test_malicious_non_tensor_entry_is_refused(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict(), "extra": {"x": Evil()}}, checkpoint_id=str(tmp_path / "ev"))
    from llmforge.checkpoint.safe_load import safe_load

    with pytest.raises(UnsafeCheckpointError, match="not plain data"):
        safe_load({"model": model.state_dict(), "extra": {"x": None}}, str(tmp_path / "ev"))
    assert not (tmp_path / "pwned.txt").exists()


# ------------------------------------------------------------- every CLI load path
@pytest.fixture(scope="module")
def crafted_run(tmp_path_factory):
    """A 2-step tiny run whose checkpoint's ``.metadata`` is replaced by the dotted payload."""
    from llmforge.cli import main

    root = tmp_path_factory.mktemp("crafted")
    code = main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={root}", "run.name=evil",
                 "trainer.max_steps=2", "trainer.eval_every=0", "checkpoint.save_every=2"])
    assert code == 0
    run = root / "evil"
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    marker = root / "pwned"
    (ckpt / ".metadata").write_bytes(dotted_payload(marker))
    return root, run, ckpt, marker


@pytest.mark.parametrize("path", ["generate", "inspect", "consolidate", "resume", "init_from"])
def test_every_load_path_refuses_the_crafted_checkpoint(crafted_run, path, tmp_path, capsys):
    from llmforge.cli import main

    root, run, ckpt, marker = crafted_run
    common = [DEMO, *TINY_OVERRIDES, "trainer.max_steps=3", "trainer.eval_every=0"]
    if path == "resume":
        copy = tmp_path / "evil"
        shutil.copytree(run, copy)
        argv = ["train", *common, f"run.output_dir={tmp_path}", "run.name=evil", "checkpoint.resume=auto",
                "checkpoint.allow_config_changes=true"]  # max_steps 2 -> 3: the load must be reached
    else:
        argv = {"generate": ["generate", str(run), "--prompt", "x", "--max-new-tokens", "2"],
                "inspect": ["checkpoint", "inspect", str(ckpt)],
                "consolidate": ["checkpoint", "consolidate", str(ckpt), str(tmp_path / "out.safetensors")],
                "init_from": ["train", *common, f"run.output_dir={tmp_path}", "run.name=ft",
                              f"model.init_from={run}"]}[path]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert ".metadata: refers to torch.distributed.checkpoint.filesystem.os.system" in err
    assert "refused" in err and "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()
