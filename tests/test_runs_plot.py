"""``llmforge runs plot`` draws the loss curves of several runs into a PNG of the asked size."""

from __future__ import annotations

import json
import struct

import pytest

from llmforge.cli import main


def fake_run(path, losses, evals=()):
    path.mkdir(parents=True)
    lines = [{"step": 0, "eval/loss": 9.0}]
    lines += [{"step": i + 1, "train/loss": v, "train/tokens_seen": (i + 1) * 1024} for i, v in enumerate(losses)]
    lines += [{"step": s, "eval/loss": v} for s, v in evals]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_two_runs_writes_a_png(tmp_path, capsys):
    a = fake_run(tmp_path / "runs" / "a", [5.0, 4.0, 3.5, "nan", 3.0])  # NaN (a string) is skipped
    b = fake_run(tmp_path / "runs" / "b", [5.5, 4.5, 4.0, 3.8, 3.6])
    out = tmp_path / "plots" / "loss.png"
    assert main(["runs", "plot", str(a), str(b), "--out", str(out), "--width", "800", "--height", "500"]) == 0
    assert png_size(out) == (800, 500) and out.stat().st_size > 5000
    assert f"wrote {out}" in capsys.readouterr().out


def test_plot_several_metrics_and_tokens_axis(tmp_path, monkeypatch):
    a = fake_run(tmp_path / "a", [5.0, 4.0], evals=[(2, 4.2)])
    monkeypatch.chdir(tmp_path)
    assert main(["runs", "plot", str(a), "--metric", "train/loss", "--metric", "eval/loss", "--x", "tokens"]) == 0
    assert png_size(tmp_path / "train_loss.png") == (1000, 600)  # default name and size


def test_plot_errors_are_one_line(tmp_path, capsys):
    a = fake_run(tmp_path / "a", [5.0])
    assert main(["runs", "plot", str(a), "--metric", "train/los"]) == 2
    assert "no run has values of 'train/los'" in capsys.readouterr().err
    assert main(["runs", "plot", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["runs"])  # a subcommand is required


def test_series_sorted_by_step_after_an_eval_of_an_older_checkpoint(tmp_path):
    from llmforge.runs.plot import series

    lines = [{"step": 2, "eval/harness/t/acc": 0.5}, {"step": 4, "eval/harness/t/acc": 0.75},
             {"step": 2, "eval/harness/t/acc": 0.6}, {"step": 1, "eval/harness/t/acc": 0.25}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert series(tmp_path, "eval/harness/t/acc") == ([1.0, 2.0, 2.0, 4.0], [0.25, 0.5, 0.6, 0.75])
