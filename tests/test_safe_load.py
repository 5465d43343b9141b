"""No checkpoint can run code: DCP metadata and non-tensor entries are read with allow-lists."""

import os
import pickle

import pytest
import torch

from llmforge.checkpoint import load_model_weights, save_checkpoint
from llmforge.checkpoint.dcp import load_training_state
from llmforge.checkpoint.safe_load import UnsafeCheckpointError


class Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > pwned.txt",))


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


def test_malicious_metadata_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, _, path = make(tmp_path)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        load_model_weights(path, torch.nn.Linear(4, 3))
    assert not (tmp_path / "pwned.txt").exists()


def test_malicious_non_tensor_entry_is_refused(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict(), "extra": {"x": Evil()}}, checkpoint_id=str(tmp_path / "ev"))
    from llmforge.checkpoint.safe_load import safe_load

    with pytest.raises(UnsafeCheckpointError, match="not plain data"):
        safe_load({"model": model.state_dict(), "extra": {"x": None}}, str(tmp_path / "ev"))
    assert not (tmp_path / "pwned.txt").exists()
