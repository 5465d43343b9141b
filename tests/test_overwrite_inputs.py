"""``--overwrite`` never deletes what the same command reads (issue 47, item 1): fine-tuning a
run in place, a ``checkpoint.dir`` inside another run, a data file inside the run being replaced
and a foreign folder that merely looks like an old run all exit 2 naming both keys, and every
byte stays where it was. (The ``convert`` round trips are in tests/test_hf.py.)"""

from pathlib import Path

from conftest import DEMO, TINY_OVERRIDES
from llmforge.cli import main
from llmforge.run_guard import MARK, is_run_dir


def files(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


def finished_run(path: Path) -> None:
    """A marked run with metrics and a complete checkpoint (what a finished `train` leaves)."""
    ckpt = path / "checkpoints" / "step_00000010"
    ckpt.mkdir(parents=True)
    for name in ("COMPLETE", ".metadata", "trainer_state.json", "meta.json"):
        (ckpt / name).write_text("{}")
    (path / MARK).write_text('{"made_by": "llmforge"}\n')
    (path / "config.yaml").write_text(f"run: {{name: {path.name}}}\nmodel: {{}}\ntrainer: {{}}\n")
    (path / "metrics.jsonl").write_text('{"step": 10, "train/loss": 3.0}\n')


def train(runs: Path, *extra: str) -> int:
    return main(["train", DEMO, *TINY_OVERRIDES, "trainer.max_steps=1", "scheduler.warmup_steps=0", f"run.output_dir={runs}", *extra])


def test_overwrite_refuses_to_clear_what_the_run_reads(tmp_path, capsys):
    runs = tmp_path / "runs"
    finished_run(runs / "ip")
    finished_run(runs / "other")
    (runs / "ip" / "notes.txt").write_text("the data\n")
    before = files(tmp_path)
    ip = (runs / "ip").resolve()
    cases = [
        (["run.name=ip", f"model.init_from={runs / 'ip'}"], f"model.init_from={runs / 'ip'} lies inside {ip} (run.name)"),
        (["run.name=ip", f"checkpoint.resume={runs / 'ip' / 'checkpoints' / 'step_00000010'}"],
         f"checkpoint.resume={runs / 'ip' / 'checkpoints' / 'step_00000010'} lies inside {ip} (run.name)"),
        (["run.name=ip", "data.source=files", f"data.path={runs / 'ip'}/*.txt"],
         f"data.path={runs / 'ip'}/*.txt lies inside {ip} (run.name)"),
        (["run.name=ip", "tokenizer.type=huggingface", f"tokenizer.path={runs / 'ip' / 'notes.txt'}"],
         f"tokenizer.path={runs / 'ip' / 'notes.txt'} lies inside {ip} (run.name)"),
    ]
    # a breaker's spellings: a mixture entry's paths, a wildcard above the run, fsspec's local URLs
    cases += [
        (["run.name=ip", "data.source=files",
          f"data.mixture=[{{source: files, paths: [{runs / 'ip' / 'notes.txt'}], weight: 1}}]"],
         f"data.mixture[0].paths={runs / 'ip' / 'notes.txt'} lies inside {ip} (run.name)"),
        (["run.name=ip", "data.source=files", f"data.path={runs}/i?/*.txt"],
         f"data.path={runs}/i?/*.txt lies inside {ip} (run.name)"),
        (["run.name=ip", "data.source=files", f"data.path=local://{runs / 'ip'}/*.txt"],
         f"data.path=local://{runs / 'ip'}/*.txt lies inside {ip} (run.name)"),
    ]
    for extra, says in cases:
        assert train(runs, *extra, "--overwrite") == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}, which --overwrite would delete before"), err
        assert err.count("\n") == 1 and "Traceback" not in err
    # checkpoint.dir inside another run: refused with or without --overwrite
    other_ckpts = runs / "other" / "checkpoints"
    for extra in ([], ["--overwrite"]):
        assert train(runs, "run.name=new", f"checkpoint.dir={other_ckpts}", *extra) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: checkpoint.dir={other_ckpts} lies inside another llmforge run, "
                              f"{(runs / 'other').resolve()}; its checkpoints are that run's to keep"), err
    # a run inside another run's folder (whose --overwrite would delete it) is refused
    assert train(runs / "other", "run.name=inner") == 2
    assert capsys.readouterr().err.startswith(f"error: run.name: {runs / 'other' / 'inner'} lies inside "
                                              f"another llmforge run, {(runs / 'other').resolve()}")
    assert files(tmp_path) == before


def test_a_foreign_folder_with_a_config_and_metrics_is_not_a_run(tmp_path, capsys):
    """Any project may hold ``config.yaml`` beside ``metrics.jsonl``; only the config llmforge
    saved for that folder's run makes an unmarked folder an (old) llmforge run."""
    mine = tmp_path / "runs" / "r"
    mine.mkdir(parents=True)
    (mine / "config.yaml").write_text("lr: 0.1\nlayers: 3\n")
    (mine / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.9}\n')
    before = files(mine)
    assert not is_run_dir(mine)
    assert train(tmp_path / "runs", "run.name=r", "--overwrite") == 2
    assert "is not empty and is not an llmforge run" in capsys.readouterr().err
    assert files(mine) == before
    (mine / "config.yaml").write_text("run: {name: r}\nmodel: {name: llama3}\ntrainer: {max_steps: 3}\n")
    assert is_run_dir(mine)  # what llmforge before the mark saved
