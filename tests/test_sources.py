import json

import pytest
from omegaconf import OmegaConf

from llmforge.config.schema import DataConfig
from llmforge.data.datamodule import LLMDataModule, tokenize_documents
from llmforge.data.sources import clean_text, load_documents
from llmforge.data.tokenizers import train_bpe_tokenizer
from llmforge.errors import DataError


def data_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(DataConfig), kw)


def texts(ds):
    return [r["text"] for r in ds]


def test_clean_text():
    assert clean_text("\ufeffa\r\nb\rc\n") == "a\nb\nc\n"
    assert clean_text(None) == ""


def test_text_files_bom_crlf_bad_bytes_and_empty_docs(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfFirst line\r\nsecond line\r\n")
    (tmp_path / "b.txt").write_bytes(b"bad \xff\xfe bytes here\n")
    (tmp_path / "c.txt").write_bytes(b"  \n\n")  # empty after strip: skipped
    cfg = data_cfg(source="files", path=str(tmp_path / "*.txt"), val_fraction=0.0)
    docs = load_documents(cfg, seed=0)
    got = sorted(texts(docs.train))
    assert got == ["First line\nsecond line\n", "bad \ufffd\ufffd bytes here\n"]
    assert docs.val is None


def test_jsonl_text_field_and_holdout_is_seeded(tmp_path):
    rows = [{"body": f"document number {i}", "id": i} for i in range(40)]
    rows.insert(3, {"body": "", "id": -1})
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = data_cfg(source="files", path=str(tmp_path / "d.jsonl"), text_field="body", val_fraction=0.1)
    a, b = load_documents(cfg, seed=5), load_documents(cfg, seed=5)
    assert texts(a.val) == texts(b.val) and len(texts(a.val)) == 4
    assert len(texts(a.train)) == 36
    assert not set(texts(a.train)) & set(texts(a.val))
    assert load_documents(cfg, seed=6).val["text"] != a.val["text"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["alpha beta", "gamma"]}), tmp_path / "x.parquet")
    docs = load_documents(data_cfg(source="files", path=str(tmp_path / "x.parquet"), val_fraction=0), 0)
    assert sorted(texts(docs.train)) == ["alpha beta", "gamma"]


def test_errors(tmp_path):
    with pytest.raises(DataError, match="no file matches"):
        load_documents(data_cfg(source="files", path=str(tmp_path / "nope*.txt")), 0)
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"column 'text' not found.*\['body'\]"):
        load_documents(data_cfg(source="files", path=str(tmp_path / "d.jsonl"), val_fraction=0), 0)
    (tmp_path / "e.xyz").write_text("x")
    with pytest.raises(DataError, match="data.format"):
        load_documents(data_cfg(source="files", path=str(tmp_path / "e.xyz")), 0)
    with pytest.raises(DataError, match=rf"data.path: '{tmp_path}' is a directory.*\*\.jsonl"):
        load_documents(data_cfg(source="files", path=str(tmp_path)), 0)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_invalid_utf8_names_file_and_line(tmp_path, fmt):
    good, bad = ('{"text": "fine"}', b'{"text": "caf\xe9 au lait"}') if fmt == "jsonl" else \
        ("fine", b"caf\xe9 au lait")
    path = tmp_path / f"d.{fmt}"
    path.write_bytes((("text\n" if fmt == "csv" else "") + f"{good}\n{good}\n").encode() + bad + b"\n")
    line = 4 if fmt == "csv" else 3
    with pytest.raises(DataError, match=rf"{path} line {line} is not valid UTF-8 \(byte 0xe9 at column"):
        load_documents(data_cfg(source="files", path=str(path), val_fraction=0), 0)


@pytest.mark.parametrize("bad,want", [
    (b'{"text": "caf\xe9 au lait"}', r"b.jsonl line 2 is not valid UTF-8 \(byte 0xe9 at column 14\)"),
    (b'{"text": "unclosed"', r"cannot read .*a.jsonl, .*b.jsonl: JSON parse error"),
])
def test_a_streaming_source_names_the_file_it_cannot_read(tmp_path, capsys, bad, want):
    """Streaming reads the files only while iterating: the error must still name the file
    (and line), for training, tokenizer training and `data prepare`, not exit 1."""
    from llmforge.cli import main
    from llmforge.data.sources import iter_texts

    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n')
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "fine"}\n' + bad + b"\n")
    docs = load_documents(data_cfg(source="files", path=str(tmp_path / "*.jsonl"), streaming=True,
                                   val_fraction=0), 0)
    assert docs.files == (str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    with pytest.raises(DataError, match=want):
        list(iter_texts(docs.train, None, docs.files))
    capsys.readouterr()  # datasets' own log of the read above
    assert main(["data", "prepare", str(tmp_path / "*.jsonl"), str(tmp_path / "out"), "--workers", "1"]) == 2
    err = capsys.readouterr().err  # the rows are read one at a time: the BPE's training may start first
    lines = [line for line in err.splitlines() if not line.startswith("tokenizer: training")]
    assert lines[0].startswith("error: data: ") and "Traceback" not in err and len(lines) == 1, err


def test_urls_unknown_scheme_missing_driver_file_and_memory(tmp_path, capsys, monkeypatch):
    import fsspec
    from fsspec.registry import known_implementations

    from llmforge.cli import main

    with pytest.raises(DataError, match=r"'s4://x/a.jsonl' has an unknown URL scheme 's4://'"):
        load_documents(data_cfg(source="files", path="s4://x/a.jsonl"), 0)
    # a driver that is not installed (s3fs's message), with the URL's credentials hidden
    monkeypatch.setitem(known_implementations, "nofs", {"class": "nofs_pkg.NoFS", "err": "Install nofs_pkg"})
    with pytest.raises(DataError) as exc:
        load_documents(data_cfg(source="files", path="nofs://KEY:SECRET@bucket/a.jsonl"), 0)
    assert "needs the fsspec driver of nofs://, which is not installed; install it with `pip install nofs_pkg`" \
        in str(exc.value)
    assert "SECRET" not in str(exc.value) and "nofs://***@bucket" in str(exc.value)
    rows = "".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n" for i in range(40))
    (tmp_path / "a.jsonl").write_text(rows)
    with fsspec.open("memory://corpus/a.jsonl", "w") as f:
        f.write(rows)
    for url in (f"file://{tmp_path / 'a.jsonl'}", "memory://corpus/a.jsonl"):
        out = tmp_path / url.split(":")[0]
        assert main(["data", "prepare", url, str(out), "tokenizer.vocab_size=300", "--workers", "1"]) == 0
        sources = json.loads((out / "manifest.json").read_text())["sources"]
        assert [s["bytes"] for s in sources] == [len(rows)] and sources[0]["path"].endswith("a.jsonl")


def test_corpus_too_small_names_sizes(tmp_path):
    (tmp_path / "a.txt").write_text("just a few words of text\n")
    (tmp_path / "b.txt").write_text("and a few more words\n")
    docs = load_documents(data_cfg(source="files", path=str(tmp_path / "*.txt"), val_fraction=0), 0)
    tok = train_bpe_tokenizer(texts(docs.train), 300, tmp_path / "tok", "")
    dm = LLMDataModule(docs, tok, seq_len=64, local_batch_size=4, micro_batch_size=4,
                       eval_batches=1, seed=0, num_workers=0, dp_rank=0, dp_size=1)
    with pytest.raises(DataError, match=r"has \d+ tokens = 0 windows of seq_len\+1=65 tokens.*needs 4"):
        dm.setup()


def test_datamodule_batches(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "b.txt").write_text("pack my box with five dozen liquor jugs. " * 200)
    docs = load_documents(data_cfg(source="files", path=str(tmp_path / "*.txt"), val_fraction=0), 0)
    tok = train_bpe_tokenizer(texts(docs.train), 300, tmp_path / "tok", "")
    packed = tokenize_documents(docs.train, tok)
    assert packed[0] == tok.bos_id and (packed == tok.eos_id).sum() == 2
    dm = LLMDataModule(docs, tok, seq_len=16, local_batch_size=4, micro_batch_size=2,
                       eval_batches=1, seed=0, num_workers=0, dp_rank=0, dp_size=1)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    assert tuple(batch.shape) == (4, 17)
    assert dm.eval_dataloader() is None


def test_by_line_reads_the_rows_the_json_builder_reads(tmp_path):
    """`data prepare` reads local jsonl one line at a time (issue 26: a long line cost ~4x its
    size through datasets' json builder): the same documents in the same order as the builder
    (BOM, CRLF line ends, blank lines, escapes, other columns, null and empty texts), and the
    builder's errors named by file and line."""
    from llmforge.data.sources import read_rows

    (tmp_path / "a.jsonl").write_bytes(
        b'\xef\xbb\xbf{"text": "caf\\u00e9\\r\\nline two", "id": 1, "meta": {"a": 1}}\r\n\r\n'
        b'{"text": null, "id": 2}\n{"id": 3, "meta": {"b": "x"}}\n{"text": "  "}\n' +
        '{"text": "日本 \\"quoted\\" \\\\ tab\\t end", "id": 4}'.encode())
    (tmp_path / "b.jsonl").write_text('{"text": "second file"}\n')
    cfg = data_cfg(source="files", path=str(tmp_path / "*.jsonl"), streaming=True, val_fraction=0)
    want = ["café\nline two", '日本 "quoted" \\ tab\t end', "second file"]
    for by_line in (False, True):
        docs = load_documents(cfg, 0, by_line=by_line)
        assert [r["text"] for r in read_rows(docs.train, docs.files)] == want, by_line

    for body, error in [('{"text": "a"}\n{"text": 1}\n', "data.text_field: found a int value"),
                        ('{"body": "a"}\n', r"column 'text' not found in .*c.jsonl line 1; it has \['body'\]"),
                        ('{"text": "a"}\n\n{"text": "unclosed\n', r"c.jsonl line 3 is not valid JSON")]:
        (tmp_path / "c.jsonl").write_text(body)
        docs = load_documents(data_cfg(source="files", path=str(tmp_path / "c.jsonl"), streaming=True,
                                       val_fraction=0), 0, by_line=True)
        with pytest.raises(DataError, match=error):
            list(read_rows(docs.train, docs.files))
