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
