"""`llmforge data prepare` and `data.source: prepared`: token shards written once, checked against
their manifest, read memory-mapped; exact O(1) resume on any world size; bad input exits 2."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import DEMO, TINY_OVERRIDES
from helpers.prepared import prepare, write_corpus
from llmforge.cli import main


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One corpus prepared once (in this process, shards of 25 documents)."""
    root = tmp_path_factory.mktemp("prepared")
    source = write_corpus(root / "corpus")
    assert prepare(source, root / "tokens") == 0
    return source, root / "tokens"


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_shards_hold_the_runs_tokenization_and_the_manifest_counts(prepared):
    from omegaconf import OmegaConf

    from llmforge.config.schema import DataConfig
    from llmforge.data.packing import pack_documents
    from llmforge.data.prepared import tokenizer_fingerprint
    from llmforge.data.sources import load_documents
    from llmforge.data.tokenizers import load_saved

    source, out = prepared
    m = manifest(out)
    tok = load_saved(out / "tokenizer")
    assert m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert [s["path"].rsplit("/", 1)[1] for s in m["sources"]] == ["part0.jsonl", "part1.jsonl", "part2.jsonl"]
    assert all(len(s["sha256"]) == 64 and s["bytes"] > 0 for s in m["sources"])
    cfg = OmegaConf.structured(DataConfig(source="files", path=source, streaming=True))
    docs = load_documents(cfg, 1234)  # the documents and hold-out a run of this seed reads
    for split, ds in (("train", docs.train), ("val", docs.val)):
        want = pack_documents(tok.encode_batch([r["text"] for r in ds]), tok.bos_id, tok.eos_id)
        got = np.concatenate([np.fromfile(out / s["file"], dtype=m["dtype"]) for s in m["splits"][split]["shards"]])
        assert np.array_equal(got, want), split
        assert m["splits"][split]["tokens"] == len(want)
    assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 180
    assert len(m["splits"]["train"]["shards"]) == -(-m["splits"]["train"]["documents"] // 25)


def test_a_long_document_is_encoded_in_bounded_pieces_with_the_same_ids(prepared):
    import random

    from llmforge.data.packing import encode_packed, text_pieces
    from llmforge.data.tokenizers import load_saved

    tok = load_saved(prepared[1] / "tokenizer")
    rng = random.Random(0)
    words = ["w17", "doth", "king,", "the", "\n\n", "  ", "lord."]
    long = "".join(rng.choice(words) + rng.choice([" ", "  ", "\n", ""]) for _ in range(4000))
    pieces = list(text_pieces(long, 1000))
    assert "".join(pieces) == long and len(pieces) >= len(long) // 1000
    assert all(len(p) <= 1000 for p in pieces)
    assert all(p.startswith(" ") and not q[-1].isspace() for q, p in zip(pieces, pieces[1:]))
    calls = []

    class Spy:
        vocab_size, bos_id, eos_id = tok.vocab_size, tok.bos_id, tok.eos_id

        def encode_batch(self, texts):
            calls.append(sum(map(len, texts)))
            return tok.encode_batch(texts)

    dtype = np.dtype(np.uint16)
    got = encode_packed(Spy(), ["short one", long, "", "last"], dtype, max_chars=1000)
    whole = [tok.bos_id, *tok.encode_batch(["short one"])[0], tok.eos_id, tok.bos_id,
             *tok.encode_batch([long])[0], tok.eos_id, tok.bos_id, *tok.encode_batch(["last"])[0], tok.eos_id]
    assert got.tolist() == whole  # the pieces' ids are the whole document's
    assert max(calls) <= 1000 and len(calls) == len(pieces) + 2


def test_a_shard_is_written_piece_by_piece_in_memory_flat_in_the_documents_length(tmp_path):
    """write_shard holds one piece's ids, whatever the document's length (issue 26.4): the
    traced peak (Python objects and numpy arrays) of a 4x longer document is the same."""
    import hashlib
    import tracemalloc

    from llmforge.data.packing import encode_packed
    from llmforge.data.shard_writer import write_shard

    class Chars:  # one id per 4 characters: cheap, and the ids are checkable
        vocab_size, bos_id, eos_id = 300, 298, 299

        def encode_batch(self, texts):
            return [[ord(c) % 256 for c in t[::4]] for t in texts]

    peaks = []
    for n in (100_000, 400_000):
        text = ("word " * n)[:4 * n]
        tracemalloc.start()
        entry = write_shard(Chars(), ["a b", text], tmp_path / f"shard_{n}.bin", max_chars=8000)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        want = encode_packed(Chars(), ["a b", text], np.dtype(np.uint16), max_chars=8000)
        data = (tmp_path / f"shard_{n}.bin").read_bytes()
        assert data == want.tobytes() and entry["tokens"] == len(want) > n + 5
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert peaks[1] < peaks[0] + 20_000, peaks  # not + the 150,000 more ids (300 KB)


def train(tmp_path, capsys, *extra):
    code = main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path / 'runs'}", "run.name=p",
                 "trainer.max_steps=2", "trainer.eval_every=0", "trainer.eval_batches=1",
                 "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "data.source=prepared",
                 *extra])
    return code, capsys.readouterr().err


def test_a_run_trains_from_prepared_shards(prepared, tmp_path, capsys):
    code, err = train(tmp_path, capsys, f"data.path={prepared[1]}")
    assert code == 0, err
    rows = [json.loads(x) for x in (tmp_path / "runs" / "p" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2] and "eval/loss" in rows[-1]


def test_overwrite_keeps_the_old_run_when_the_prepared_corpus_is_too_small(prepared, tmp_path, capsys):
    """The manifest's token counts are checked before ``--overwrite`` deletes the old run: a
    prepared corpus too small for one optimizer step exits 2 and leaves the old run as it was."""
    assert train(tmp_path, capsys, f"data.path={prepared[1]}")[0] == 0
    run = tmp_path / "runs" / "p"
    digests = lambda: {str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest()  # noqa: E731
                       for f in sorted(run.rglob("*")) if f.is_file()}
    before = digests()
    code, err = train(tmp_path, capsys, f"data.path={prepared[1]}", "trainer.global_batch_size=4096",
                      "trainer.micro_batch_size=2", "--overwrite")
    assert code == 2 and "Traceback" not in err, err
    assert "data: the training split has" in err and "one optimizer step needs 4096 per rank" in err, err
    assert digests() == before and "checkpoints" in str(before)


def test_shards_smaller_than_a_window_are_named_as_the_cause(prepared, tmp_path, capsys):
    """One document per shard, each shorter than a window: the corpus has the tokens but no
    window (windows do not cross shards), and the message says to prepare larger shards."""
    out = tmp_path / "one-per-shard"
    assert prepare(prepared[0], out, "--docs-per-shard", "1") == 0
    code, err = train(tmp_path, capsys, f"data.path={out}", "variables.seq_len=128")
    assert code == 2 and "Traceback" not in err, err
    assert "= 0 windows of seq_len+1=129 tokens" in err and "larger --docs-per-shard" in err, err
    assert f"the windows of {out} do not cross its 173 shards" in err, err


def _copy(prepared, tmp_path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(prepared[1], out)
    return out


@pytest.mark.parametrize("damage,want", [
    ("manifest", "{out} has no manifest.json, so it is not a prepared corpus; create it with "
                 "`llmforge data prepare CONFIG_OR_SOURCE {out}`"),
    ("truncate", "shard {shard} is truncated or damaged: {size:,} bytes, the manifest says {want:,}; delete it "
                 "and run `llmforge data prepare` again to rewrite it"),
    ("corrupt", "shard {shard} is corrupt (its sha256 differs from the manifest's); delete it and run "
                "`llmforge data prepare` again"),
    ("interrupted", "{out} is an interrupted `llmforge data prepare`; run the same command again to finish it "
                    "(finished shards are kept)"),
    ("deep", "{out}/manifest.json is not valid JSON (nested too deeply); run `llmforge data prepare` again "
             "into an empty folder"),
    ("vocab", "shard {shard} holds token id 421, outside the tokenizer's vocabulary of 421 ids (the manifest's "
              "tokenizer.vocab_size): it was written by another tokenizer or damaged; delete the folder and "
              "run `llmforge data prepare` again"),
], ids=["manifest", "truncate", "corrupt", "interrupted", "deep", "vocab"])
def test_damaged_prepared_folder_exits_2_naming_the_file(prepared, tmp_path, capsys, damage, want):
    out = _copy(prepared, tmp_path)
    shard = out / "train" / "shard_00001.bin"
    size = shard.stat().st_size
    if damage == "manifest":
        (out / "manifest.json").unlink()
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-2])
    elif damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[10] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "deep":  # parses past Python's recursion limit
        (out / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "vocab":  # an id past the vocabulary, with the manifest's sha256 to match
        from llmforge.data.prepared import file_sha256

        m = manifest(out)
        ids = np.fromfile(shard, dtype=np.uint16)
        ids[5] = m["tokenizer"]["vocab_size"]  # 421: the corpus is too small for 1024
        ids.tofile(shard)
        m["splits"]["train"]["shards"][1]["sha256"] = file_sha256(shard)
        (out / "manifest.json").write_text(json.dumps(m))
    else:
        m = manifest(out)
        m["complete"] = False
        (out / "manifest.json").write_text(json.dumps(m))
    code, err = train(tmp_path, capsys, f"data.path={out}")
    assert code == 2, err
    assert err == "error: data.path: " + want.format(out=out, shard=shard, size=size - 2, want=size) + "\n"
    assert not (tmp_path / "runs" / "p").exists()  # nothing written


def test_a_manifest_nested_deep_but_parsable_exits_2_naming_it(prepared, tmp_path):
    """A field nested 900 deep parses (under the recursion limit) and its message stays short:
    ``repr`` of it could recurse past the limit (a RecursionError, exit 1)."""
    from llmforge.data.prepared import open_prepared
    from llmforge.errors import DataError

    out = _copy(prepared, tmp_path)
    text = (out / "manifest.json").read_text()
    assert '"dtype": "uint16"' in text
    (out / "manifest.json").write_text(text.replace('"dtype": "uint16"', '"dtype": ' + "[" * 900 + "]" * 900))
    with pytest.raises(DataError) as exc:
        open_prepared(out)
    assert str(exc.value) == (f"data.path: {out}/manifest.json: dtype must be uint16 or uint32, got "
                              "[[[[[[[...]]]]]]]; the manifest was edited or damaged: run `llmforge data "
                              "prepare` again into an empty folder")


def _outside(out: Path) -> Path:
    """A file outside the folder whose size and sha256 a crafted manifest claims for a shard."""
    secret = out.parent / "secret.bin"
    secret.write_bytes((out / "train" / "shard_00000.bin").read_bytes())
    return secret


@pytest.mark.parametrize("edit,words", [
    (lambda m, out: m["splits"]["train"]["shards"][0].update(file="../secret.bin"), ["'../secret.bin'", "refused"]),
    (lambda m, out: m["splits"]["train"]["shards"][0].update(file=str(out.parent / "secret.bin")),
     ["secret.bin'", "not a path inside", "refused"]),
    (lambda m, out: (out / "train" / "shard_00000.bin").unlink()
     or (out / "train" / "shard_00000.bin").symlink_to(out.parent / "secret.bin"), ["is a link to", "refused"]),
    (lambda m, out: m.update(dtype="object"), ["dtype must be uint16 or uint32", "'object'"]),
    (lambda m, out: m["splits"]["train"]["shards"][0].update(tokens="4100"), ["splits.train.shards[0].tokens"]),
    (lambda m, out: m.update(splits=[]), ["splits must be an object"]),
    (lambda m, out: m.pop("tokenizer") and None, ["tokenizer must be an object"]),
    (lambda m, out: [m], ["has format 'list'"]),
], ids=["dotdot", "absolute", "symlink-out", "dtype-object", "tokens-str", "splits-list", "no-tokenizer", "list"])
def test_a_crafted_manifest_is_refused_and_reads_nothing_outside(prepared, tmp_path, monkeypatch, edit, words):
    from llmforge.data import prepared as mod
    from llmforge.errors import DataError

    out = _copy(prepared, tmp_path)
    secret = _outside(out)
    m = manifest(out)
    m = edit(m, out) or m  # an edit returns a new manifest or None (edited in place)
    (out / "manifest.json").write_text(json.dumps(m))
    hashed = []
    monkeypatch.setattr(mod, "file_sha256", lambda p, *a: hashed.append(Path(p)) or "x")
    with pytest.raises(DataError) as exc:
        mod.open_prepared(out)
    assert str(exc.value).startswith("data.path: ") and all(w in str(exc.value) for w in words), exc.value
    assert secret not in hashed


def test_a_shard_path_outside_the_folder_exits_2_before_training(prepared, tmp_path, capsys):
    out = _copy(prepared, tmp_path)
    _outside(out)
    m = manifest(out)
    m["splits"]["train"]["shards"][0]["file"] = "train/../../secret.bin"
    (out / "manifest.json").write_text(json.dumps(m))
    code, err = train(tmp_path, capsys, f"data.path={out}")
    assert code == 2 and err.startswith("error: data.path: ") and "refused" in err, err
    assert not (tmp_path / "runs" / "p").exists()


def test_prepare_refuses_a_damaged_progress_file(tmp_path, capsys):
    (tmp_path / "doc.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"}\n')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "progress.json").write_text('{"key": [1, ')  # torn
    assert prepare(str(tmp_path / "doc.jsonl"), tmp_path / "out") == 2
    err = capsys.readouterr().err
    # the last line (a first run trains the BPE before, and says so on the line above)
    assert err.splitlines()[-1].startswith(f"error: {tmp_path / 'out' / 'progress.json'} is damaged")
    assert "Traceback" not in err
    (tmp_path / "out" / "progress.json").write_text('[1, 2]')  # JSON, not a progress file
    assert prepare(str(tmp_path / "doc.jsonl"), tmp_path / "out") == 2
    assert "is not a progress file of `llmforge data prepare`" in capsys.readouterr().err


@pytest.mark.parametrize("over,want", [
    (["data.source=prepared", "data.mixture=[{path: p, weight: 1}]"], "error: data.mixture: `data prepare` prepares one source"),
    (["data.source=prepared", "data.path=p"], "error: data.source=prepared: p is prepared already"),
    (["data.task=sft", "data.source=files", "data.path=x.jsonl"], "error: data.task=sft: `data prepare` writes pretraining"),
])
def test_prepare_of_a_config_it_cannot_prepare_exits_2(tmp_path, capsys, over, want):
    assert main(["data", "prepare", DEMO, str(tmp_path / "out"), *over]) == 2
    assert capsys.readouterr().err.startswith(want) and not (tmp_path / "out").exists()


def test_prepare_to_a_url_never_prints_its_credentials(tmp_path, capsys):
    (tmp_path / "doc.jsonl").write_text('{"text": "a b c"}\n{"text": "d e f"}\n')
    assert prepare(str(tmp_path / "doc.jsonl"), f"memory://KEY:SECRET@bucket/{tmp_path.name}") == 0
    out, err = capsys.readouterr()  # the memory store is process-wide: a folder of its own
    assert f"wrote memory://***@bucket/{tmp_path.name}:" in out and "SECRET" not in out + err


def test_object_store_without_its_driver_exits_2_naming_the_package(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed: the URL would be looked up on S3")
    code, err = train(tmp_path, capsys, "data.path=s3://bucket/tokens")
    assert code == 2 and "error: data.path: s3://bucket/tokens needs the fsspec driver" in err, err
    assert "pip install s3fs" in err and "Traceback" not in err


def test_another_tokenizer_exits_2_before_training(prepared, tmp_path, capsys):
    from llmforge.data.tokenizers import train_bpe_tokenizer

    other = train_bpe_tokenizer(["another text entirely " * 50], 300, tmp_path / "tok", "other")
    path = next((tmp_path / "tok").rglob("tokenizer.json"))
    assert other.vocab_size <= 300
    code, err = train(tmp_path, capsys, f"data.path={prepared[1]}", "tokenizer.type=huggingface",
                      f"tokenizer.path={path}")
    assert code == 2 and "error: tokenizer: tokenizer.type=huggingface" in err, err
    assert f"is not the tokenizer that prepared {prepared[1]}" in err
    assert not (tmp_path / "runs" / "p").exists()


def test_bad_prepare_input_exits_2(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": "   "}\n')
    assert prepare(str(tmp_path / "empty.jsonl"), tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "holds no non-empty document" in err and not (tmp_path / "out").exists()
    (tmp_path / "one.jsonl").write_text('{"text": "hi there"}\n')  # the hold-out's hash picks it
    assert prepare(str(tmp_path / "one.jsonl"), tmp_path / "out") == 2
    assert ("every document was held out for validation (data.val_fraction=0.05); add documents or set "
            "data.val_fraction=0") in capsys.readouterr().err and not (tmp_path / "out").exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "doc.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    assert prepare(str(tmp_path / "doc.jsonl"), tmp_path / "busy") == 2
    assert "is not empty" in capsys.readouterr().err
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert main(["data", "prepare", str(tmp_path / "doc.jsonl"), str(tmp_path / "o"), "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err


def consumed(prepared_dir: Path, world: int, start: int, stop: int) -> list[int]:
    """Window ids the ranks of a ``world``-rank run read in steps [start, stop) after resuming at
    ``start`` (each rank's data module, as its process builds it)."""
    from llmforge.data.datamodule import LLMDataModule
    from llmforge.data.prepared import open_prepared
    from llmforge.data.tokenizers import load_saved

    ids = []
    for rank in range(world):
        dm = LLMDataModule(open_prepared(prepared_dir), load_saved(prepared_dir / "tokenizer"), seq_len=15,
                           local_batch_size=8 // world, micro_batch_size=1, eval_batches=1, seed=7,
                           num_workers=0, dp_rank=rank, dp_size=world, start_step=start)
        dm.setup()
        loader = dm.train_dataloader()
        order, batches = iter(loader.sampler), iter(loader)
        for _ in range(start, stop):
            rows = [next(order) for _ in range(8 // world)]
            batch = next(batches)
            assert all(np.array_equal(batch[j].numpy(), dm.train_windows[i].numpy()) for j, i in enumerate(rows))
            ids += rows
    return ids


def test_resume_on_2_then_1_then_4_ranks_loses_and_repeats_no_window(prepared):
    out = prepared[1]
    straight = consumed(out, 1, 0, 30)  # 240 windows
    resumed = consumed(out, 2, 0, 10) + consumed(out, 1, 10, 20) + consumed(out, 4, 20, 30)
    assert sorted(resumed) == sorted(straight)
    from llmforge.data.prepared import PreparedWindows, open_prepared

    n = len(PreparedWindows(open_prepared(out), "train", 15))
    first_epoch = straight[: n // 8 * 8]
    assert len(set(first_epoch)) == len(first_epoch)  # no window twice within an epoch


def test_a_corpus_with_no_held_out_document_says_so_and_the_run_too(tmp_path, capsys):
    """A newcomer's `data prepare` of the demo held out none of 42 texts (the hold-out is by a
    document's hash), and the run on it skipped evaluation without a word."""
    source = write_corpus(tmp_path / "corpus", files=1, docs=30)
    assert prepare(source, tmp_path / "tokens", "data.val_fraction=0.0001") == 0
    err = capsys.readouterr().err
    assert "note: no document of 30 was held out for validation" in err and "will not evaluate" in err
    code, err = train(tmp_path, capsys, f"data.path={tmp_path / 'tokens'}")
    assert code == 0, err
    assert "the prepared corpus holds 0 validation windows" in err and "does not evaluate" in err
