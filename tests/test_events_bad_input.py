"""Bad input to the event contract and its algorithms: each is one clear error before anything
runs (in-process, no trainer; the CLI path is checked once with ``--dry-run``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from algo_harness import batches, make_cfg, make_module
from conftest import DEMO
from llmforge.algorithms import Algorithm
from llmforge.algorithms.loading import build_algorithms
from llmforge.errors import ConfigError
from llmforge.events import PluginError


def shell_command(marker: str) -> int:
    """A function, not a class: naming it as an algorithm must not call it."""
    Path(marker).touch()
    return 0


class Typo(Algorithm):
    name = "typo"

    def after_los(self, state):  # misspelled after_loss: never called
        raise AssertionError


class Helper(Algorithm):
    name = "helper"

    def compute_scale(self):  # not close to any event: allowed
        return 1.0


class Raises(Algorithm):
    name = "raises"

    def after_loss(self, state):
        raise RuntimeError("boom")


class NonScalarLoss(Algorithm):
    name = "non_scalar"

    def after_loss(self, state):
        state.loss = state.loss * torch.ones(3)


class FloatLoss(Algorithm):
    name = "float_loss"

    def after_loss(self, state):
        state.loss = state.loss.item()


@pytest.mark.parametrize("entry, message", [
    ({"name": "ema", "use_for_eval": "no"}, "ema.use_for_eval='no' must be true or false"),
    ({"name": "ema", "use_for_export": "false"}, "ema.use_for_export='false' must be true or false"),
    ({"name": "seq_length_warmup", "min_seq_len": 8, "step_size": 64},
     "seq_length_warmup.step_size=64 exceeds trainer.seq_len=32"),
    ({"name": "z_loss", "coef": True}, "z_loss.coef=True"),
    ({"name": f"{__name__}.Typo"}, "Typo.after_los is not an event .* did you mean after_loss"),
])
def test_a_bad_algorithm_entry_is_one_config_error(entry, message):
    with pytest.raises(ConfigError, match=message):
        build_algorithms(make_cfg([entry]))


def test_seq_length_warmup_is_refused_for_sft_rows():
    cfg = make_cfg([{"name": "seq_length_warmup", "min_seq_len": 8}])
    cfg.data.task = "sft"
    with pytest.raises(ConfigError, match="cuts the responses .* of data.task=sft rows"):
        build_algorithms(cfg)


def test_an_import_path_that_is_not_a_class_is_refused_before_it_is_called(tmp_path):
    marker = tmp_path / "ran"
    cfg = make_cfg([{"name": f"{__name__}.shell_command", "marker": str(marker)}])
    with pytest.raises(ConfigError, match=r"algorithms\[0\].name: .*is a function, not a class"):
        build_algorithms(cfg)
    cfg = make_cfg([{"name": "collections.OrderedDict", "marker": str(marker)}])
    with pytest.raises(ConfigError, match=r"OrderedDict is not a .*Algorithm"):
        build_algorithms(cfg)
    assert not marker.exists()
    assert [type(a).__name__ for a in build_algorithms(make_cfg([{"name": f"{__name__}.Helper"}]))] == ["Helper"]


def test_the_cli_refuses_a_function_as_an_algorithm_in_one_line(tmp_path, tiny_overrides, capsys):
    from llmforge.cli import main

    marker = tmp_path / "ran"
    rc = main(["train", DEMO, *tiny_overrides, "--dry-run",
               f"algorithms=[{{name: os.system, command: 'touch {marker}'}}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not marker.exists()
    assert err == ["error: algorithms[0].name: 'os.system' is a builtin_function_or_method, not a "
                   "class; name an llmforge.plugin.Algorithm subclass"]


@pytest.fixture(scope="module")
def module():
    return make_module([])


@pytest.mark.parametrize("plugin, message", [
    (Raises(), r"test_events_bad_input.Raises.after_loss \(step 0\) raised RuntimeError: boom"),
    (NonScalarLoss(), r"state.loss after after_loss is a tensor of shape \[3\], not a scalar "
                      r"tensor \(set by one of: test_events_bad_input.NonScalarLoss\)"),
    (FloatLoss(), r"state.loss after after_loss is float, not a scalar tensor"),
])
def test_a_plugin_that_breaks_the_contract_is_named(module, plugin, message):
    module.setup_events([plugin])
    with pytest.raises(PluginError, match=message) as info:
        module.forward_backward(batches(1, module.cfg.trainer.seq_len)[0])
    assert info.value.exit_code == 1
    module.setup_events([])


@pytest.mark.parametrize("uri, message", [
    ("http://127.0.0.1:9/", "does not answer"),  # nothing listens on the discard port
    ("bogus://x", "cannot be used"),
])
def test_an_unusable_mlflow_tracking_uri_is_one_config_error_not_minutes_of_retries(tmp_path, uri, message):
    pytest.importorskip("mlflow")
    from llmforge.loggers.mlflow import MLflowLogger

    logger = MLflowLogger(run_dir=tmp_path, tracking_uri=uri)
    with pytest.raises(ConfigError, match=rf"mlflow.tracking_uri='{uri}' {message}"):
        logger.log_metrics({"train/loss": 1.0}, step=1)


class KwargsLogger:
    """Not a Lightning Logger: it would fail later with an AttributeError mid-run."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def test_loggers_and_callbacks_by_import_path_must_be_lightning_classes(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, Logger

    from llmforge import registry
    from llmforge.registry import build_entries

    with pytest.raises(ConfigError, match=r"loggers\[0\] \(.*KwargsLogger\): KwargsLogger is not a subclass of "
                                          r"lightning.pytorch.loggers.logger.Logger"):
        build_entries(registry.loggers, "loggers", [{"name": f"{__name__}.KwargsLogger"}], base=Logger,
                      run_dir=tmp_path)
    built = build_entries(registry.loggers, "loggers", [{"name": "lightning.pytorch.loggers.CSVLogger",
                                                         "save_dir": str(tmp_path)}], base=Logger,
                          run_dir=tmp_path, run=None)  # only the keywords CSVLogger declares
    assert isinstance(built[0], CSVLogger) and built[0].save_dir == str(tmp_path)


def test_a_resume_names_the_saved_plugin_states_it_drops(tmp_path):
    """A checkpoint of an ema + loss_spike_guard run resumed with neither: both are named."""
    import torch.distributed.checkpoint as dcp
    from types import SimpleNamespace

    from llmforge.checkpoint.plugins import dropped_states

    dcp.save({"model": {"w": torch.ones(2)}, "plugins": {"EMA": {"layers.0.w": torch.ones(2)}}},
             checkpoint_id=str(tmp_path))
    plain = {"LossSpikeGuard": {"loss": [1.0]}, "SpeedMonitor": {}}
    now = [SimpleNamespace(state_key="SpeedMonitor")]
    assert dropped_states(tmp_path, now, plain) == ["EMA", "LossSpikeGuard"]
    now += [SimpleNamespace(state_key="EMA"), SimpleNamespace(state_key="LossSpikeGuard")]
    assert dropped_states(tmp_path, now, plain) == []


def test_dry_run_lines_of_ema_and_chunked_cross_entropy_check_the_head():
    from llmforge.algorithms import EMA, ChunkedCrossEntropy
    from llmforge.plugin import meta_model
    from llmforge.config.validate import plan_batch

    cfg = make_cfg([])
    plan = plan_batch(cfg, 1)
    n = sum(p.numel() for p in meta_model(cfg).parameters())
    assert EMA().dry_run_lines(cfg, plan, None) == [
        f"ema             + {n * 4 / 2**30:.2f} GiB per device (fp32 average of {n:,} weights, "
        "sharded 1x; not in memory/device)"]
    assert ChunkedCrossEntropy(chunk_size=16).dry_run_lines(cfg, plan, None) == [
        "chunked CE      fp32 logits 0.00 GiB per chunk of 16 tokens instead of 0.00 GiB per "
        "micro-batch (head output, vocab 256)"]
    with pytest.raises(ConfigError, match="chunked_cross_entropy.head='nope' must name"):
        ChunkedCrossEntropy(head="nope").dry_run_lines(cfg, plan, None)
