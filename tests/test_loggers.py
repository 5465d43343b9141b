"""Every logger writes the same records as metrics.jsonl; trackers run offline, keep no API key
or other secret, fall back to offline when their server does not answer, and fail clearly when
misconfigured.

One short in-process run (4 optimizer steps, gradient accumulation 2) feeds jsonl, W&B
(offline), Comet (offline experiment), MLflow (SQLite store), TensorBoard and console at once;
each file is then read back with the tracker's own format. The run also carries secrets the
way users pass them (HTTP headers in ``data.storage_options``, an override on the command line,
that value in ``run.tags``) and reports to a runs registry; no file holds them afterwards.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, TINY_OVERRIDES, run_cli
from llmforge.errors import ConfigError

FAKE_WANDB_KEY = "fakeWANDBkey" + "0123456789abcdef" * 3  # 60 characters, like a real one
FAKE_COMET_KEY = "fakeCOMETkey0123456789abcdefXYZ"
HEADER_KEY, PRIVATE_TOKEN, ARGV_KEY = "hdr-value-" + "A1" * 8, "glpat-" + "B2" * 8, "argv-" + "C3" * 8
# names outside the first secret rule (issue 47, item 5): a cookie, a passphrase, a signed URL
COOKIE, PASSPHRASE = "session=" + "D4" * 8, "open-" + "E5" * 8
AMZ_CRED, AMZ_SIG, AZ_SIG, URL_TOKEN = "AKIA" + "F6" * 8, "a1b2" * 8, "G7" * 10, "tok" + "H8" * 8
SIGNED_URL = (f"https://b.s3.amazonaws.com/shard.jsonl?X-Amz-Credential={AMZ_CRED}&X-Amz-Date=20261204"
              f"&X-Amz-Signature={AMZ_SIG}&sig={AZ_SIG}&token={URL_TOKEN}")
STEPS = 4


def isolate_trackers(mp: pytest.MonkeyPatch, home: Path) -> None:
    """Fake keys in the environment; the SDKs' own config/cache folders under ``home``."""
    mp.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    mp.setenv("COMET_API_KEY", FAKE_COMET_KEY)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        mp.setenv(var, str(home / var.lower()))
    mp.setenv("WANDB_SILENT", "true")


TRACKED = [*TINY_OVERRIDES, "run.name=trackers", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
           "trainer.eval_every=2", "trainer.eval_batches=2", "checkpoint.save_every=2",
           "loggers=[{name: jsonl}, {name: wandb, mode: offline, project: llmforge-test, "
           "tags: [t1]}, {name: comet, mode: offline}, {name: tensorboard}, {name: console}, "
           "{name: mlflow}]",
           # secrets as users pass them (issue 21): header-style keys, a command-line override, a tag
           f"data.storage_options={{X-Api-Key: {HEADER_KEY}, Private-Token: {PRIVATE_TOKEN}, "
           f"headers: {{Cookie: '{COOKIE}'}}, passphrase: {PASSPHRASE}}}",
           f"variables.mirror={SIGNED_URL}", f"variables.api_key={ARGV_KEY}", "run.tags=['${variables.api_key}', plain]",
           "callbacks=[{name: generate_samples, prompts: [ROMEO.], every: 2, max_new_tokens: 6}]"]


def tracked_fit(home: Path, out: Path, *extra: str) -> tuple[Path, list[dict]]:
    from llmforge import Trainer
    from llmforge.config import config_to_dict, load_config, redact
    from llmforge.job.records import RunRegistry

    overrides = [*TRACKED, f"run.output_dir={out}", *extra]
    config = str(REPO / "yamls" / "demo_cpu.yaml")
    with pytest.MonkeyPatch.context() as mp:
        isolate_trackers(mp, home)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        # the command line W&B and Comet record, and a registry row the run reports to (as launched)
        mp.setattr(sys, "argv", ["llmforge", "train", config, *overrides])
        mp.setenv("LLMFORGE_HOME", str(home))
        row = RunRegistry().create("trackers", "local", "local",
                                   config=redact(config_to_dict(load_config(config, overrides))))
        mp.setenv("LLMFORGE_RUN_ID", row.id)
        trainer = Trainer.from_yaml(config, overrides)
        summary = trainer.fit()
    run_dir = Path(summary["run_dir"])
    return run_dir, [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tracker_run(tmp_path_factory):
    """A 4-step run (global batch 16 = 2 micro-batches of 8) with every logger, offline;
    checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trackers")
    return tracked_fit(tmp, tmp / "runs")


@pytest.fixture(scope="module")
def resumed_run(tracker_run, tmp_path_factory):
    """A copy of ``tracker_run`` resumed from its step-2 checkpoint: steps 3 and 4 (and the
    step-4 samples) are logged a second time, to the same tracker runs."""
    import shutil

    tmp = tmp_path_factory.mktemp("resumed")
    shutil.copytree(tracker_run[0], tmp / "runs" / "trackers")
    ckpt = tmp / "runs" / "trackers" / "checkpoints" / "step_00000002"
    return tracked_fit(tmp, tmp / "runs", f"checkpoint.resume={ckpt}")


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


def assert_same(expected: dict[int, dict], got: dict[int, dict], rel: float) -> None:
    assert sorted(got) == sorted(expected)
    for step, rec in expected.items():
        for k, v in rec.items():
            if k == "step" or not isinstance(v, (int, float)):
                continue
            assert k in got[step], f"{k} missing at step {step}"
            assert math.isclose(got[step][k], v, rel_tol=rel, abs_tol=1e-12), (step, k, got[step][k], v)


# ----------------------------------------------------------------- readers of tracker files
def read_wandb_history(run_dir: Path) -> dict[int, dict]:
    """History rows of the offline W&B run: the ``.wandb`` file is a LevelDB-style log of
    protobuf records (7-byte header ``:W&B`` + magic, 32 KiB blocks, 7-byte chunk headers)."""
    [path] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    return read_wandb_file(path)


def read_wandb_file(path: Path, steps: list | None = None) -> dict[int, dict]:
    """History rows of one ``.wandb`` file; ``steps`` collects the step of every history record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, rows = path.read_bytes(), 32768, 7, b"", {}
    assert data[:4] == b":W&B"
    chunks = []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            chunks.append(buf + chunk)
    for c in chunks:
        rec = pb.Record()
        rec.ParseFromString(c)
        if rec.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            rows.setdefault(int(row["_step"]), {}).update(row)
            if steps is not None:
                steps.append(int(row["_step"]))
    return rows


def read_comet_archive(run_dir: Path, path: Path | None = None) -> tuple[dict[int, dict], list[dict]]:
    """Metrics per step and all messages of the offline Comet experiment's zip archive."""
    if path is None:
        [path] = (run_dir / "comet").glob("*.zip")
    with zipfile.ZipFile(path) as z:
        messages = [json.loads(x) for x in z.read("messages.json").decode().splitlines() if x.strip()]
    rows: dict[int, dict] = {}
    for m in messages:
        if m["type"] == "metric_msg":
            metric = m["payload"]["metric"]
            rows.setdefault(metric["step"], {})[metric["metricName"]] = float(metric["metricValue"])
    return rows, messages


def read_tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    rows: dict[int, dict] = {}
    for tag in ea.Tags()["scalars"]:
        for ev in ea.Scalars(tag):
            rows.setdefault(ev.step, {})[tag] = ev.value
    return rows, ea


# ----------------------------------------------------------------------------- the records
def test_one_record_per_optimizer_step_with_accumulation(tracker_run):
    run_dir, records = tracker_run
    assert [r["step"] for r in records] == list(range(STEPS + 1))  # step 0 = the first eval
    tokens_per_step = 16 * 64  # global batch 16 (2 micro-batches of 8) x seq_len 64
    for r in records[1:]:
        assert r["train/tokens_seen"] == r["step"] * tokens_per_step
        # one window per logged step: tokens/s x seconds/step = the tokens of one optimizer step
        assert r["throughput/tokens_per_second"] * r["time/step_seconds"] == pytest.approx(tokens_per_step)
    assert {"eval/loss", "eval/perplexity"} <= set(records[2]) and "eval/loss" not in records[1]


def test_tensorboard_matches_jsonl(tracker_run):
    run_dir, records = tracker_run
    rows, ea = read_tensorboard(run_dir)
    assert_same(by_step(records), rows, rel=1e-6)  # event files store float32
    assert "config/text_summary" in ea.Tags()["tensors"]
    text = ea.Tensors("samples/text_summary")
    assert [e.step for e in text] == [2, 4] and b"ROMEO." in text[0].tensor_proto.string_val[0]


def test_wandb_offline_matches_jsonl(tracker_run):
    run_dir, records = tracker_run
    rows = read_wandb_history(run_dir)
    metric_rows = {s: {k: v for k, v in r.items() if not k.startswith(("_", "samples/"))}
                   for s, r in rows.items()}
    assert_same(by_step(records), metric_rows, rel=1e-12)
    assert rows[2]["samples/_type"] == "table-file" and rows[2]["samples/nrows"] == 1
    [files] = (run_dir / "wandb").glob("offline-run-*/files")
    table = json.loads((files / rows[2]["samples/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "sample"] and table["data"][0][:2] == [2, "ROMEO."]


def test_comet_offline_matches_jsonl(tracker_run):
    run_dir, records = tracker_run
    rows, messages = read_comet_archive(run_dir)
    expected = by_step(records)
    names = {k for r in records for k in r if k != "step"}
    rows = {s: {k: v for k, v in r.items() if k in names} for s, r in rows.items() if s in expected}
    assert_same(expected, rows, rel=1e-12)
    texts = [m for m in messages if m["type"] == "file_upload" and m["payload"]["upload_type"] == "text-sample"]
    assert len(texts) == 2 and texts[0]["payload"]["metadata"]["prompt"] == "ROMEO."
    from comet_ml.schemas import get_parameter_msg_validator

    validator = get_parameter_msg_validator()
    params = {}
    for m in messages:
        if m["type"] == "parameter_msg":
            validator.validate(m["payload"])  # what an upload checks: scalar values only
            p = m["payload"]["param"]
            params[p["paramName"]] = p["paramValue"]
    assert isinstance(params["optimizer|lr"], float)
    assert params["loggers|0|name"] == "jsonl" and params["loggers|1|tags"] == '["t1"]'
    assert params["callbacks|0|prompts"] == '["ROMEO."]' and params["run|tags"] == '["***", "plain"]'
    assert json.loads(params["optimizer|betas"]) == [0.9, 0.95]


def test_resumed_run_shows_each_step_once_in_every_tracker(tracker_run, resumed_run):
    """TensorBoard through its purge marker, W&B through its run id with resume="allow", Comet
    through ExistingOfflineExperiment: after re-logging steps 3-4, every tracker holds steps 0-4
    once. TensorBoard shows the resumed attempt's values; W&B and Comet keep the first ones
    (W&B drops a step lower than its last), which the bit-exact resume makes equal but for
    timings."""
    run_dir, records = resumed_run
    first = by_step(tracker_run[1])
    assert [first[s]["train/loss"] for s in (3, 4)] == [by_step(records)[s]["train/loss"] for s in (3, 4)]
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    expected = by_step(records)
    rows, ea = read_tensorboard(run_dir)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert_same(expected, rows, rel=1e-6)
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2, 3, 4]
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    tensors = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    tensors.Reload()  # the reader TensorBoard serves from (it purges text, the legacy one not)
    assert [e.step for e in tensors.Tensors("samples/text_summary")] == [2, 4]

    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1  # one W&B run id, two attempts
    steps, history = [], {}
    for f in files:
        for step, row in read_wandb_file(f, steps).items():
            history.setdefault(step, {}).update(row)
    assert sorted(steps) == list(range(STEPS + 1))  # no step sent twice
    assert_same(first, {s: {k: v for k, v in r.items() if not k.startswith(("_", "samples/"))}
                        for s, r in history.items()}, rel=1e-12)

    zips = sorted((run_dir / "comet").glob("*.zip"))
    assert len(zips) == 2
    keys, strategies, metric_steps = set(), set(), []
    for z in zips:
        _, messages = read_comet_archive(run_dir, z)
        with zipfile.ZipFile(z) as archive:
            meta = json.loads(archive.read("experiment.json"))
        keys.add(meta["offline_id"])
        strategies.add(meta["resume_strategy"])  # "create", then "get": the same experiment
        metric_steps += sorted({m["payload"]["metric"]["step"] for m in messages
                                if m["type"] == "metric_msg" and m["payload"]["metric"]["metricName"] == "train/loss"})
    assert len(keys) == 1 and strategies == {"create", "get"} and sorted(metric_steps) == [1, 2, 3, 4]


def test_no_api_key_or_secret_in_any_written_file(tracker_run):
    """The trackers' keys (environment) and the secrets of the config, the command line and the
    tags are in no file of the run directory, the trackers' own folders or runs.db."""
    run_dir, _ = tracker_run
    home = run_dir.parents[1]
    assert (home / "runs.db").is_file() and (run_dir / "mlflow.db").is_file()
    keys = [k.encode() for k in (FAKE_WANDB_KEY, FAKE_COMET_KEY, HEADER_KEY, PRIVATE_TOKEN, ARGV_KEY,
                                 COOKIE, PASSPHRASE, AMZ_CRED, AMZ_SIG, AZ_SIG, URL_TOKEN)]
    checked = 0
    for path in home.rglob("*"):
        if not path.is_file():
            continue
        blobs = [path.read_bytes()]
        if path.suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                blobs += [z.read(n) for n in z.namelist()]
        for blob in blobs:
            checked += 1
            assert not [k for k in keys if k in blob], f"a secret is written in {path}"
    assert checked > 10
    import sqlite3

    params = dict(sqlite3.connect(run_dir / "mlflow.db").execute("SELECT key, value FROM params"))
    assert params["data.storage_options.X-Api-Key"] == params["variables.api_key"] == "***"
    assert params["run.tags"] == '["***", "plain"]'
    assert params["data.storage_options.headers.Cookie"] == params["data.storage_options.passphrase"] == "***"
    assert params["variables.mirror"] == ("https://b.s3.amazonaws.com/shard.jsonl?X-Amz-Credential=***&"
                                          "X-Amz-Date=20261204&X-Amz-Signature=***&sig=***&token=***")
    [wandb_run] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    recorded = wandb_run.read_bytes()  # W&B keeps the command line (its args) in the run file
    assert b"variables.api_key=***" in recorded and b"{X-Api-Key: ***, Private-Token: ***, " in recorded


def test_mlflow_renames_metrics_it_refuses_once_and_alike_at_every_step(tracker_run, tmp_path):
    """A mixture entry named after a folder (``code+math``) gives ``data/code+math/tokens_seen``,
    which MLflow refuses: it is logged as ``data/code_math/tokens_seen`` at every step, with one
    warning naming it; names that would collide stay apart; parameters are mapped alike. (The
    tracker run's SQLite store is reused: a new one costs seconds of migrations.)"""
    from mlflow.tracking import MlflowClient

    from llmforge.loggers.mlflow import MLflowLogger

    uri = f"sqlite:///{tracker_run[0] / 'mlflow.db'}"
    logger = MLflowLogger(tmp_path, config=None, tracking_uri=uri, experiment="names", run_name="x")
    logger.log_hyperparams({"data": {"weights": {"code+math": 0.5}}})
    with pytest.warns(UserWarning) as warned:
        for step in (1, 2):
            logger.log_metrics({"train/loss": 1.0 / step, "data/code+math/tokens_seen": 64.0 * step,
                                "data/code_math/tokens_seen": 1.0}, step=step)
    messages = [str(w.message) for w in warned if "mlflow" in str(w.message)]
    head = "mlflow: logs under other names what it does not accept (or what would then collide): "
    assert sorted(messages) == [head + "data.weights.code+math -> data.weights.code_math",
                                head + "data/code+math/tokens_seen -> data/code_math/tokens_seen, "
                                "data/code_math/tokens_seen -> data/code_math/tokens_seen_a983f4"]
    client = MlflowClient(tracking_uri=uri)
    history = {m.step: m.value for m in client.get_metric_history(logger.run_id, "data/code_math/tokens_seen")}
    assert history == {1: 64.0, 2: 128.0}
    metrics = client.get_run(logger.run_id).data.metrics
    assert {"train/loss", "data/code_math/tokens_seen"} < set(metrics) and len(metrics) == 3
    assert client.get_run(logger.run_id).data.params == {"data.weights.code_math": "0.5"}


def test_console_prints_one_line_per_record(capsys):
    from llmforge.loggers.console import ConsoleLogger

    log = ConsoleLogger(keys=["train/loss", "eval/loss"])
    log.log_metrics({"train/loss": 5.123456, "train/lr": 1e-3}, step=10)
    log.log_metrics({"train/lr": 1e-3}, step=11)  # none of the keys: no line
    log.log_metrics({"train/loss": 4.0, "eval/loss": 4.5}, step=20)
    assert capsys.readouterr().out.splitlines() == [
        "step 10 | train/loss 5.1235", "step 20 | train/loss 4 | eval/loss 4.5"]


# ------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("name, env", [("wandb", "WANDB_API_KEY"), ("comet", "COMET_API_KEY")])
def test_online_without_key_is_a_config_error(name, env, monkeypatch, tmp_path):
    from llmforge import registry
    import llmforge.loggers  # noqa: F401

    monkeypatch.delenv(env, raising=False)
    with pytest.raises(ConfigError, match=f"{env} is not set"):
        registry.loggers.get(name)(run_dir=tmp_path, run=None, config={}, mode="online")
    with pytest.raises(ConfigError, match=f"export {env}"):
        registry.loggers.get(name)(run_dir=tmp_path, api_key="in-yaml", mode="offline")
    with pytest.raises(ConfigError, match="mode must be"):
        registry.loggers.get(name)(run_dir=tmp_path, mode="sometimes")


def test_missing_key_stops_the_cli_with_exit_2_before_training(tmp_path, monkeypatch, capsys):
    from llmforge.cli import main

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    code = main(["train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES,
                 f"run.output_dir={tmp_path}", "loggers=[{name: jsonl}, {name: wandb}]"])
    assert code == 2
    assert "WANDB_API_KEY is not set" in capsys.readouterr().err
    assert not (tmp_path / "demo_cpu" / "tokenizer").exists()  # failed before any data work


@pytest.mark.parametrize("name, module, extra", [("wandb", "wandb", "wandb"), ("comet", "comet_ml", "comet"),
                                                 ("tensorboard", "tensorboard", "tensorboard")])
def test_missing_sdk_says_which_extra_to_install(name, module, extra, monkeypatch, tmp_path):
    from llmforge import registry
    import llmforge.loggers  # noqa: F401

    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(ConfigError, match=rf"pip install 'llmforge\[{extra}\]'"):
        registry.loggers.get(name)(run_dir=tmp_path, mode="offline") if name != "tensorboard" \
            else registry.loggers.get(name)(run_dir=tmp_path)


# ------------------------------------------------------------------- unreachable servers
@pytest.mark.slow
def test_unreachable_trackers_fall_back_offline_without_hanging(tmp_path):
    """Both servers accept the connection and never answer (the worst case: no quick refusal)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    port = silent.getsockname()[1]
    try:
        env = {"WANDB_API_KEY": FAKE_WANDB_KEY, "COMET_API_KEY": FAKE_COMET_KEY,
               "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
               "COMET_URL_OVERRIDE": f"http://127.0.0.1:{port}/clientlib/",
               **{v: str(tmp_path / v.lower()) for v in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}}
        proc = run_cli("train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES,
                       f"run.output_dir={tmp_path / 'runs'}", "trainer.max_steps=1",
                       "scheduler.warmup_steps=0", "trainer.eval_every=0", "trainer.eval_batches=1",
                       "checkpoint.save_final=false",
                       "loggers=[{name: jsonl}, {name: wandb, connect_timeout: 2, init_timeout: 3}, "
                       "{name: comet, connect_timeout: 2}]", env=env, timeout=240)
    finally:
        silent.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert err.count("wandb: could not start an online run") == 1
    assert err.count("comet: could not start an online run") == 1
    run_dir = tmp_path / "runs" / "demo_cpu"
    assert rows_of(run_dir) == [0, 1]  # the evaluation before training, then step 1
    assert sorted(read_wandb_history(run_dir)) == [0, 1]
    assert sorted(s for s in read_comet_archive(run_dir)[0] if s is not None) == [0, 1]


def rows_of(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
