"""`llmforge data prepare` on MDS folders (mosaicml-streaming's format, LLM Foundry's data):
text and pre-tokenised `tokens` columns, written by streaming's own MDSWriter, prepared and
trained on; token counts equal the source's."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import DEMO, REPO, TINY_OVERRIDES, run_main
from helpers import mds_fixture


@pytest.fixture(scope="module")
def mds_root(tmp_path_factory) -> Path:
    """The MDS folders: written now by mosaicml-streaming's MDSWriter where it is installed, else
    the copies it wrote (tests/data/mds, see tests/helpers/mds_fixture.py: the package cannot be
    installed beside torch 2.13 and transformers 5)."""
    root = tmp_path_factory.mktemp("mds")
    try:
        mds_fixture.mds_writer()
    except ImportError:
        shutil.copytree(REPO / "tests" / "data" / "mds", root, dirs_exist_ok=True)
    else:
        mds_fixture.write(root)
    return root


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_mds_text_and_tokens_are_prepared_with_the_sources_token_count_and_trained_on(mds_root, tmp_path):
    from llmforge.data.tokenizers import load_saved

    text = tmp_path / "text"
    r = run_main("data", "prepare", str(mds_root / "text"), str(text), "tokenizer.vocab_size=1024",
                 "data.val_split=val", "--workers", "1")
    assert r.returncode == 0, r.stderr
    m = _manifest(text)
    tok = load_saved(text / "tokenizer")
    for split, n, seed in (("train", 60, 5), ("val", 8, 3)):  # [BOS] doc [EOS] of every document
        want = sum(len(tok.encode(d)) + 2 for d in mds_fixture.documents(n, seed=seed))
        assert m["splits"][split]["documents"] == n and m["splits"][split]["tokens"] == want
    assert [Path(s["path"]).parent.name for s in m["sources"]] == ["train", "val"]

    # pre-tokenised rows (LLM Foundry's concat_tokens output) are copied id for id, no BOS/EOS
    tokens = tmp_path / "tokens"
    r = run_main("data", "prepare", str(mds_root / "tokens" / "train"), str(tokens), "tokenizer.type=huggingface",
                 f"tokenizer.path={text / 'tokenizer' / 'tokenizer.json'}", "data.val_fraction=0", "--workers", "1")
    assert r.returncode == 0, r.stderr
    rows = mds_fixture.token_rows(40, seed=3)
    m = _manifest(tokens)
    assert m["splits"]["train"]["tokens"] == sum(len(x) for x in rows) == 1490
    ids = np.fromfile(tokens / m["splits"]["train"]["shards"][0]["file"], dtype=m["dtype"])
    assert np.array_equal(ids, np.concatenate(rows))

    r = run_main("train", DEMO, *TINY_OVERRIDES, "data.source=prepared", f"data.path={text}",
                 "trainer.max_steps=2", "trainer.eval_batches=1", "trainer.log_every=1",
                 f"run.output_dir={tmp_path / 'runs'}", "run.name=mds")
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "mds" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in metrics if "train/loss" in x] == [1, 2]


def test_mds_bad_input_exits_2_naming_the_key(mds_root, tmp_path):
    r = run_main("data", "prepare", str(mds_root / "text"), str(tmp_path / "a"), "data.val_split=test",
                 "--workers", "1")
    assert r.returncode == 2 and "no MDS split 'test'" in r.stderr and "train, val" in r.stderr
    r = run_main("data", "prepare", str(mds_root / "tokens"), str(tmp_path / "b"), "--workers", "1")
    assert r.returncode == 2 and "tokenizer.type" in r.stderr and "token ids" in r.stderr
    from tokenizers import Tokenizer, models

    small = tmp_path / "small.json"  # a tokenizer of 4 ids: the MDS tokens use up to 255
    Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2, "[UNK]": 3}, unk_token="[UNK]")).save(str(small))
    r = run_main("data", "prepare", str(mds_root / "tokens"), str(tmp_path / "d"), "tokenizer.type=huggingface",
                 f"tokenizer.path={small}", "--workers", "1")
    assert r.returncode == 2 and "outside the tokenizer's" in r.stderr, r.stderr
    assert not list((tmp_path / "d").rglob("*.tmp")) and not list((tmp_path / "d").rglob("*.bin"))
    r = run_main("data", "prepare", str(mds_root / "text"), str(tmp_path / "c"), "data.text_field=body",
                 "--workers", "1")
    assert r.returncode == 2 and "data.text_field" in r.stderr and "id, text" in r.stderr


def test_mds_reader_refuses_damaged_or_escaping_folders_with_a_data_error(mds_root, tmp_path):
    """A shared MDS folder is input, not trusted: an index.json whose shard names a file outside
    the folder (``..``, absolute, or a link out) read that file into the shards; a truncated
    shard, an index entry without its fields or nested too deep, and float token ids crashed
    (exit 1) or were truncated into other ids. Each is a DataError naming the folder or shard."""
    from llmforge.data.mds import MDSSplit, iter_samples
    from llmforge.errors import DataError

    def split(name: str, edit=None, shard_bytes=None) -> str:
        folder = tmp_path / name
        shutil.copytree(mds_root / "text" / "val", folder)
        index = json.loads((folder / "index.json").read_text())
        if edit is not None:
            edit(index["shards"][0])
            (folder / "index.json").write_text(json.dumps(index))
        if shard_bytes is not None:
            (folder / "shard.00000.mds").write_bytes(shard_bytes((folder / "shard.00000.mds").read_bytes()))
        return str(folder)

    def refused(folder: str, *needles: str) -> None:
        with pytest.raises(DataError) as info:
            list(iter_samples(folder, ("text",)))
        assert all(n in str(info.value) for n in needles), str(info.value)

    assert len(list(iter_samples(split("good"), ("text",)))) > 0
    (tmp_path / "secret.txt").write_text("not yours")
    refused(split("dotdot", lambda s: s["raw_data"].update(basename="../secret.txt")), "outside the MDS folder")
    refused(split("absolute", lambda s: s["raw_data"].update(basename=str(tmp_path / "secret.txt"))),
            "outside the MDS folder")
    linked = split("link", lambda s: s["raw_data"].update(basename="out.mds"))
    (Path(linked) / "out.mds").symlink_to(tmp_path / "secret.txt")
    refused(linked, "'out.mds', which is outside the MDS folder")
    refused(split("truncated", shard_bytes=lambda b: b[:len(b) // 2]), "is damaged", "shard.00000.mds")
    refused(split("tiny", shard_bytes=lambda b: b[:1]), "is damaged")
    refused(split("no-sizes", lambda s: s.pop("column_sizes")), "index.json shard 0", "column_sizes")
    refused(split("names-text", lambda s: s.update(column_names="text")), "column_names")
    gz = tmp_path / "gz"
    shutil.copytree(mds_root / "text" / "train", gz)
    body = bytearray((gz / "shard.00000.mds.gz").read_bytes())
    body[40:60] = bytes(20)  # bit rot inside the deflate stream, the header intact
    (gz / "shard.00000.mds.gz").write_bytes(bytes(body))
    refused(str(gz), "cannot read MDS shard", "shard.00000.mds.gz")
    refused(split("comp", lambda s: s.update(zip_data={"basename": "shard.00000.mds"}, compression=5)),
            "its compression is 5")
    refused(split("nul", lambda s: s["raw_data"].update(basename="sub/shard\0.mds")), "outside the MDS folder")
    deep = split("deep")
    (Path(deep) / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(deep, "not a readable MDS index")
    floats = tmp_path / "floats"  # a pre-tokenised column of float32 ids
    floats.mkdir()
    sample = np.array([5.7, 6.2], np.float32).tobytes()
    (floats / "shard.00000.mds").write_bytes(np.array([1, 8, 8 + len(sample)], np.uint32).tobytes() + sample)
    (floats / "index.json").write_text(json.dumps({"version": 2, "shards": [{
        "format": "mds", "column_names": ["tokens"], "column_encodings": ["ndarray:float32:2"],
        "column_sizes": [len(sample)], "compression": None, "raw_data": {"basename": "shard.00000.mds"},
        "zip_data": None, "samples": 1}]}))
    with pytest.raises(DataError, match="holds float32 values; token ids are integers"):
        list(MDSSplit(str(floats), "tokens"))


def test_training_on_an_mds_folder_says_to_prepare_it(mds_root, tmp_path):
    """``data.format=mds`` names a folder: the message is the documented `data prepare` one, not
    the file lookup's "name its files with a glob, e.g. FOLDER/*.jsonl"."""
    folder = mds_root / "text"
    r = run_main("train", DEMO, *TINY_OVERRIDES, "data.source=files", f"data.path={folder}", "data.format=mds",
                 f"run.output_dir={tmp_path}")
    assert r.returncode == 2 and r.stderr.startswith("error: data.format: mds is read by `llmforge data "
                                                     f"prepare` only; prepare {folder} once"), r.stderr
    r = run_main("train", DEMO, *TINY_OVERRIDES, "data.source=files", f"data.path={folder}", "data.format=MDS",
                 f"run.output_dir={tmp_path}")  # names are exact: refused with the ones there are
    assert r.returncode == 2 and "data.format: expected one of text, txt, json, jsonl, parquet, csv, mds; " \
        "got 'MDS'" in r.stderr, r.stderr
