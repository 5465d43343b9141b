"""`llmforge data prepare` at the edges (issue 50.7): a long document reaches the BPE trainer in
bounded pieces (the same merges), and a cache folder that cannot be written leaves the run
uncached instead of stopping it; the tokenizing pool returns results in order and names a worker
that died instead of waiting for it. The SIGTERM-to-the-group case is in tests/test_prepare_kill.py.
All in-process and small: the memory itself is measured by ``benchmarks/data.py --long``."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

from conftest import run_main
from helpers.prepared import TOK, write_corpus
from llmforge.data import jsonl_lines, tokenizer_bpe, tokenizers
from llmforge.data.jsonl_lines import LongText, jsonl_rows
from llmforge.data.prepare import prepare
from llmforge.data.shard_writer import write_shard
from llmforge.data.prepare_pool import ShardPool, WorkerDied
from llmforge.data.sources import _jsonl_rows
from llmforge.errors import DataError
from llmforge.data.tokenizers import _lazy_texts, load_saved, train_bpe_tokenizer

WORDS = ["the", "king,", "doth", "w17", "lord.", "\n\n", "  ", "naïve", "42", "'s"]


def _document(words: int) -> str:
    rng = random.Random(0)
    return "".join(rng.choice(WORDS) + rng.choice([" ", " ", "  ", "\n", ""]) for _ in range(words))


def test_a_long_document_trains_the_bpe_in_bounded_pieces_with_the_same_merges(tmp_path, monkeypatch):
    long = _document(40_000)  # ~180 K characters, one document
    seen: list[int] = []
    real = tokenizer_bpe.text_pieces

    def spy(text, max_chars):
        for piece in real(text, max_chars):
            seen.append(len(piece))
            yield piece

    monkeypatch.setattr(tokenizer_bpe, "text_pieces", spy)
    monkeypatch.setattr(tokenizer_bpe, "TRAIN_PIECE_CHARS", 4096)
    pieced = train_bpe_tokenizer([long], 400, tmp_path, "")
    assert sum(seen) == len(long) and len(seen) >= len(long) // 4096 and max(seen) <= 4096
    monkeypatch.setattr(tokenizer_bpe, "TRAIN_PIECE_CHARS", len(long))  # whole, as before the fix
    whole = train_bpe_tokenizer([long], 400, tmp_path, "")
    assert pieced.vocab_size == whole.vocab_size == 400
    assert pieced._tok.to_str() == whole._tok.to_str()  # the same vocabulary and merges


def test_the_jsonl_reader_splits_bytes_at_newlines_and_names_bad_lines(tmp_path):
    """Lines are read as bytes and decoded whole: a BOM at the file's start dropped, a CR before
    the newline and blank or Unicode-space lines skipped as before, a later key of a first-row
    column missing is a null, a bad line named (read whole, or over the long-line threshold
    parsed in chunks: the same error)."""
    f = tmp_path / "a.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "caf\xc3\xa9", "id": 1}\r\n\n  \n\xe3\x80\x80\n{"id": 2}\n'
                  b'{"text": "x" }\n')
    assert list(_jsonl_rows([str(f)], "text")) == [{"text": "café"}, {"text": None}, {"text": "x"}]
    for long_line in (None, 0):  # read whole, and (0: every line long) parsed in chunks
        f.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
        with pytest.raises(UnicodeDecodeError):  # read_rows names the file and line (not_utf8)
            list(_jsonl_rows([str(f)], "text", long_line))
        deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b', "text": "x"}\n'  # RecursionError in json
        for bad in (b'{"text": \n', b'{"text": "a\\q"}\n', b'{"text": "a"} x\n', b'{"text": "unclosed\n', deep):
            f.write_bytes(b'{"text": "a"}\n' + bad)
            with pytest.raises(DataError, match=f"{f} line 2 is not valid JSON"):
                list(_jsonl_rows([str(f)], "text", long_line))


def test_the_training_byte_budget_is_cut_piece_by_piece_as_before(monkeypatch):
    monkeypatch.setattr("llmforge.data.tokenizers.TRAIN_PIECE_CHARS", 1000)
    long = _document(4000)
    budget = 7_001  # inside a piece, and (naïve: 2 bytes) possibly inside a character
    pieces = list(_lazy_texts(lambda: ["short", long, "never read"], budget))
    assert max(map(len, pieces)) <= 1000 and pieces[0] == "short"
    # the old cut: the whole text encoded, its first bytes of the budget decoded
    assert "".join(pieces[1:]) == long.encode()[:budget - 5].decode("utf-8", errors="ignore")


def test_a_long_line_is_read_in_chunks_into_the_same_shards(tmp_path, monkeypatch):
    """A jsonl line over LONG_LINE_BYTES is parsed from the file in chunks (a LongText read again
    for each use), never held whole. With the threshold and the chunk forced tiny (7 bytes:
    \\n, \\", \\u00e9 and the surrogate pair \\ud83d\\ude00 cut at every place; unpaired ones), a BOM and
    CRLF in the text, 2 workers: the trained BPE, every shard's sha256 and the held-out split
    are those of the whole-line path."""
    from llmforge.cli.data_commands import load_prepare_config

    long = _document(2500).replace("w17", "caf\u00e9 \r\n\"q\" \\ \U0001F600")  # ~12 K chars
    lone = " \ud800 \udc00 end"  # unpaired surrogates (escaped: no UTF-8 for them) become U+FFFD
    rows = [{"text": "\ufeff" + long + lone, "id": [1, {"a": None}]}, {"text": "short one"}, {"id": 3},
            {"meta": "x \\\" y", "text": long[::-1]}, {"text": " \n "}, {"text": long[:3000]}]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=i % 2 == 0) + "\n" for i, r in enumerate(rows)))
    monkeypatch.setattr(tokenizers, "TRAIN_PIECE_CHARS", 1000)  # the trainer's pieces cut too
    got = {}
    for mode in ("whole", "streamed"):
        if mode == "streamed":
            monkeypatch.setattr(jsonl_lines, "LONG_LINE_BYTES", 100)
            monkeypatch.setattr(jsonl_lines, "READ_CHUNK", 7)
        monkeypatch.setenv("LLMFORGE_CACHE", str(tmp_path / f"cache-{mode}"))  # trained each time
        cfg = load_prepare_config(str(src), [*TOK, "data.val_fraction=0.4"])
        m = prepare(cfg, tmp_path / mode, workers=2 if mode == "streamed" else 1, docs_per_shard=2,
                    show_progress=False)
        got[mode] = (m["splits"], (tmp_path / mode / "tokenizer" / "tokenizer.json").read_bytes())
    assert got["streamed"] == got["whole"]
    assert {k: v["documents"] for k, v in got["whole"][0].items()} in ({"train": 3, "val": 1}, {"train": 2, "val": 2})
    streamed = [r["text"] for r in jsonl_rows([str(src)], "text")]
    assert [type(t) for t in streamed] == [LongText, str, type(None), LongText, str, LongText]
    # as clean_text: the BOM dropped, CRLF read as LF, unpaired surrogates U+FFFD
    clean = (long + lone).replace("\r\n", "\n").replace("\ud800", "\ufffd").replace("\udc00", "\ufffd")
    assert "".join(streamed[0].pieces()) == clean and len(streamed[0]) == len(clean) > 3 * 1000
    tok = load_saved(tmp_path / "whole" / "tokenizer")  # iter_packed's cut of a stream: the ids of the str
    a, b = (write_shard(tok, [text], tmp_path / f"{i}.bin", max_chars=1000)
            for i, text in enumerate((clean, streamed[0])))
    assert a["sha256"] == b["sha256"] and a["bytes"] == b["bytes"] == len(clean.encode())


def test_a_source_written_while_it_is_read_gets_no_manifest(tmp_path):
    """A line appended to the source after the first shard: the shards would not match the
    sources the manifest names, so the prepare exits 2 (DataError) naming the file, with no
    manifest written."""
    from llmforge.cli.data_commands import load_prepare_config

    source = write_corpus(tmp_path / "corpus", files=1, docs=30)
    path = next((tmp_path / "corpus").glob("*.jsonl"))

    def append(out, entry):
        with open(path, "a") as fh:
            fh.write(json.dumps({"text": "appended meanwhile"}) + "\n")

    cfg = load_prepare_config(source, [*TOK, "data.val_fraction=0"])
    with pytest.raises(DataError, match=f"data: {path} changed while data prepare read it"):
        prepare(cfg, tmp_path / "out", workers=1, docs_per_shard=10, show_progress=False, on_shard=append)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_cache_that_cannot_be_written_leaves_the_prepare_uncached(tmp_path):
    """$LLMFORGE_CACHE below a regular file (ENOTDIR; a read-only mount gives EROFS, the same
    OSError path): the BPE is trained, one warning line says it is not cached, the prepare
    completes, and nothing is written under the cache."""
    source = write_corpus(tmp_path / "corpus", files=1, docs=20)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    cache = blocker / "cache"
    out = tmp_path / "out"
    r = run_main("data", "prepare", source, str(out), *TOK, "--workers", "1", "--no-progress",
                 env={"LLMFORGE_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(cache / "tokenizers") in warnings[0] and "uncached" in warnings[0], r.stderr
    assert "error" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] > 0
    tok = load_saved(out / "tokenizer")
    assert 262 < tok.vocab_size <= 1024 and tok.decode(tok.encode("file 0 document 3")) == "file 0 document 3"
    assert blocker.read_text() == ""


def _square(x: int) -> int:
    if x == -1:
        raise DataError("task -1 is bad input")
    if x == -9:
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x


def test_the_pool_returns_results_in_order_and_names_a_worker_that_died():
    pool = ShardPool(2, lambda: None, (), _square)
    try:
        for x in (3, 1, 4, 1, 5, -1):
            pool.submit(x)
        assert [pool.result() for _ in range(5)] == [9, 1, 16, 1, 25]
        with pytest.raises(DataError, match="task -1 is bad input"):  # raised here, as in the worker
            pool.result()
        pool.submit(-9)  # the OOM killer's way
        with pytest.raises(WorkerDied, match=r"\(pid \d+\) ended \(signal SIGKILL\) \(the OOM killer"):
            pool.result()
        procs = list(pool._procs)
    finally:
        pool.close()
    assert all(p.exitcode is not None for p in procs)
