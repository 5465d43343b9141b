"""The token cache of in-memory sources (``data.token_cache``): tokenized once, memory-mapped
at later starts without reading the documents, missed when the files or the tokenizer change,
and written again when damaged."""

import os

import numpy as np
from conftest import DEMO, REPO, TINY_OVERRIDES
from omegaconf import OmegaConf

from llmforge.config.schema import DataConfig
from llmforge.data.datamodule import LLMDataModule, tokenize_documents
from llmforge.data.sources import load_documents
from llmforge.data import token_cache
from llmforge.data.token_cache import entry_name, lookup
from llmforge.data.tokenizers import train_bpe_tokenizer


def corpus(tmp_path):
    for i, line in enumerate(["the quick brown fox jumps over the lazy dog. ",
                              "pack my box with five dozen liquor jugs. ",
                              "how vexingly quick daft zebras jump. "]):
        (tmp_path / f"{i}.txt").write_text(line * 120)
    return OmegaConf.structured(DataConfig(source="files", path=str(tmp_path / "*.txt"),
                                           val_fraction=0.34))


def module(cfg, tok, cache):
    docs = load_documents(cfg, 0, lazy=True)
    dm = LLMDataModule(docs, tok, seq_len=16, local_batch_size=2, micro_batch_size=2,
                       eval_batches=1, seed=0, num_workers=0, dp_rank=0, dp_size=1, token_cache=cache)
    dm.setup()
    return docs, dm


def test_second_start_reads_the_cache_not_the_documents(tmp_path):
    cfg = corpus(tmp_path)
    tok = train_bpe_tokenizer([(tmp_path / "0.txt").read_text()], 300, tmp_path / "tok", "")
    cache = tmp_path / "cache"
    docs, first = module(cfg, tok, cache)
    assert docs.loaded
    want_train = tokenize_documents(docs.train, tok)
    want_val = tokenize_documents(docs.val, tok)
    assert len(list(cache.glob("*.json"))) == 1 and len(list(cache.glob("*.npy"))) == 2

    docs, again = module(cfg, tok, cache)
    assert not docs.loaded  # the documents were never read
    assert isinstance(again.train_windows.tokens, np.memmap)
    np.testing.assert_array_equal(again.train_windows.tokens, want_train)
    np.testing.assert_array_equal(again.val_windows.tokens, want_val)
    assert again.train_tokens == first.train_tokens == len(want_train)

    # another tokenizer (other ids) is another entry
    other = train_bpe_tokenizer([(tmp_path / "1.txt").read_text()], 280, tmp_path / "tok2", "")
    docs, _ = module(cfg, other, cache)
    assert docs.loaded and len(list(cache.glob("*.json"))) == 2


def test_the_trainer_reads_the_ids_once(tmp_path, monkeypatch):
    """The trainer reads (or tokenizes and stores) the ids once, before the run directory is
    written (``cached_tokens``), and hands them to the data module, which reads nothing more:
    on a miss, one failed read and the entry written; on a hit, one read and the documents
    never opened."""
    from llmforge import Trainer, load_config

    corpus(tmp_path)
    monkeypatch.setenv("LLMFORGE_CACHE", str(tmp_path / "llmforge-cache"))
    cfg = load_config(DEMO, [*TINY_OVERRIDES, f"run.output_dir={tmp_path / 'runs'}", "data.source=files",
                             f"data.path={tmp_path / '*.txt'}", "data.val_fraction=0.34",
                             "variables.seq_len=16", "trainer.global_batch_size=2",
                             "trainer.micro_batch_size=2"])
    tok = train_bpe_tokenizer([(tmp_path / "0.txt").read_text()], 300, tmp_path / "tok", "")
    reads, real = [], token_cache.read_entry
    monkeypatch.setattr(token_cache, "read_entry", lambda *a, **k: reads.append(a) or real(*a, **k))
    trainer = Trainer(cfg)
    cache = trainer.token_cache()

    def setup():  # Trainer.setup's data steps, in its order
        docs = trainer.build_documents()
        ids = trainer.cached_tokens(docs, tok)
        dm = trainer.build_datamodule(docs, tok, ids)
        dm.setup()
        return docs, dm

    docs, first = setup()
    assert len(reads) == 1 and docs.loaded and (cache / f"{entry_name(docs.key, tok)}.json").exists()
    docs, again = setup()
    assert len(reads) == 2 and not docs.loaded
    assert isinstance(again.train_windows.tokens, np.memmap)
    np.testing.assert_array_equal(again.train_windows.tokens, first.train_windows.tokens)
    np.testing.assert_array_equal(again.val_windows.tokens, first.val_windows.tokens)
    assert lookup(None, docs.key, tok) == (None, None) and lookup(cache, "", tok) == (None, None)


def test_changed_files_and_damaged_entries_are_tokenized_again(tmp_path):
    cfg = corpus(tmp_path)
    tok = train_bpe_tokenizer([(tmp_path / "0.txt").read_text()], 300, tmp_path / "tok", "")
    cache = tmp_path / "cache"
    module(cfg, tok, cache)

    # the same size, a later modification time: the key names the file's state
    path = tmp_path / "2.txt"
    path.write_text(path.read_text().replace("zebras", "Zebras"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    docs, dm = module(cfg, tok, cache)
    assert docs.loaded
    np.testing.assert_array_equal(dm.train_windows.tokens, tokenize_documents(docs.train, tok))

    # a truncated entry is read as a miss and replaced
    name = entry_name(load_documents(cfg, 0, lazy=True).key, tok)
    npy = cache / f"{name}.train.npy"
    npy.write_bytes(npy.read_bytes()[:100])
    docs, dm = module(cfg, tok, cache)
    assert docs.loaded and npy.stat().st_size > 100
    docs, dm = module(cfg, tok, cache)
    assert not docs.loaded
    npy.write_bytes(b"")  # emptied (a crash before the data reached the disk)
    docs, dm = module(cfg, tok, cache)
    assert docs.loaded and npy.stat().st_size > 100


def test_a_first_start_says_what_it_does_once(tmp_path, capsys, monkeypatch):
    """The slow first-run steps print one line each on rank 0 (a minute of silence before):
    training the BPE, tokenizing the documents; a second start reads both caches, silently."""
    cfg = corpus(tmp_path)
    tok = train_bpe_tokenizer([(tmp_path / "0.txt").read_text()], 300, tmp_path / "tok", "fp")
    assert capsys.readouterr().err == ("tokenizer: training a byte-level BPE of 300 ids on the training "
                                       f"text (once: cached in {tmp_path / 'tok' / 'bpe-300-fp'})\n")
    module(cfg, tok, tmp_path / "cache")
    assert capsys.readouterr().err == (f"data: tokenizing the documents (once: the ids are cached in "
                                       f"{tmp_path / 'cache'})\n")
    train_bpe_tokenizer([], 300, tmp_path / "tok", "fp")
    module(cfg, tok, tmp_path / "cache")
    monkeypatch.setenv("RANK", "1")  # another rank of the same job says nothing
    module(cfg, tok, tmp_path / "other-cache")
    monkeypatch.delenv("RANK")  # nor a process Lightning's own launcher started (devices=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    module(cfg, tok, tmp_path / "third-cache")
    assert capsys.readouterr().err == ""


def test_an_edited_entry_is_a_miss_not_a_silent_change(tmp_path):
    """A hand-edited json that drops the validation split, or ids past the tokenizer's
    vocabulary, were read as they were (no evaluation; an ``IndexError`` mid-training, exit 1):
    each is now damaged, a miss tokenized again."""
    import json

    cfg = corpus(tmp_path)
    tok = train_bpe_tokenizer([(tmp_path / "0.txt").read_text()], 300, tmp_path / "tok", "")
    cache = tmp_path / "cache"
    _, first = module(cfg, tok, cache)
    name = entry_name(load_documents(cfg, 0, lazy=True).key, tok)
    meta = cache / f"{name}.json"
    kept = meta.read_text()
    meta.write_text(json.dumps({**json.loads(kept), "tokens": {**json.loads(kept)["tokens"], "val": None}}))
    docs, dm = module(cfg, tok, cache)
    assert docs.loaded and dm.val_windows is not None and meta.read_text() == kept

    npy = cache / f"{name}.train.npy"
    ids = np.load(npy).copy()
    ids[3] = tok.vocab_size  # one past the last id
    np.save(npy, ids)
    docs, dm = module(cfg, tok, cache)
    assert docs.loaded and int(dm.train_windows.tokens.max()) < tok.vocab_size
    np.testing.assert_array_equal(dm.train_windows.tokens, first.train_windows.tokens)


def test_off_streaming_and_no_validation(tmp_path):
    cfg = corpus(tmp_path)
    tok = train_bpe_tokenizer([(tmp_path / "0.txt").read_text()], 300, tmp_path / "tok", "")
    docs, dm = module(cfg, tok, None)  # data.token_cache: false
    assert docs.loaded and not (tmp_path / "cache").exists()
    assert load_documents(OmegaConf.merge(cfg, {"streaming": True}), 0, lazy=True).key == ""

    cache = tmp_path / "cache"
    flat = OmegaConf.merge(cfg, {"val_fraction": 0})
    module(flat, tok, cache)
    docs, dm = module(flat, tok, cache)
    assert not docs.loaded and dm.val_windows is None and dm.eval_dataloader() is None


def test_the_trained_tokenizer_is_named_by_the_column_read(tmp_path):
    """A trained BPE is cached by the documents it was trained on: another ``text_field`` (or
    format) of the same files is another tokenizer, not the first one reused."""
    from llmforge import load_config
    from llmforge.data.sources import tokenizer_cache_key

    (tmp_path / "d.jsonl").write_text('{"text": "a b", "body": "c d"}\n' * 4)
    base = ["data.source=files", f"data.path={tmp_path / 'd.jsonl'}"]
    cfg = load_config(REPO / "yamls" / "demo_cpu.yaml", base)
    other = load_config(REPO / "yamls" / "demo_cpu.yaml", [*base, "data.text_field=body"])
    docs = load_documents(cfg.data, 0, lazy=True)
    assert tokenizer_cache_key(cfg, docs) != tokenizer_cache_key(other, load_documents(other.data, 0, lazy=True))
    assert tokenizer_cache_key(cfg, docs) == tokenizer_cache_key(cfg, load_documents(cfg.data, 0, lazy=True))


def test_a_cache_that_cannot_be_written_never_fails(tmp_path):
    """A cache folder where the entry cannot be written (here its part file's name is taken by a
    folder; on a read-only mount even the cleanup's unlink raises) leaves the run uncached."""
    ids = np.arange(10, dtype=np.uint16)
    (tmp_path / f"e.train.{os.getpid()}.part").mkdir()
    token_cache.write_entry(tmp_path, "e", ids, None)
    assert not (tmp_path / "e.json").exists() and token_cache.read_entry(tmp_path, "e", ids.dtype) is None


def test_a_crafted_entry_never_blocks_or_fails_the_read(tmp_path):
    """A json nested deeply (RecursionError, exit 1 before), a FIFO (the read blocked for ever)
    or a link to an endless file in place of an entry's files: each is a miss."""
    ids = np.arange(10, dtype=np.uint16)
    token_cache.write_entry(tmp_path, "e", ids, None)
    assert token_cache.read_entry(tmp_path, "e", ids.dtype) is not None
    meta = tmp_path / "e.json"
    kept = meta.read_text()
    meta.write_text("[" * 100_000 + "]" * 100_000)
    assert token_cache.read_entry(tmp_path, "e", ids.dtype) is None
    meta.unlink()
    meta.symlink_to("/dev/zero")
    assert token_cache.read_entry(tmp_path, "e", ids.dtype) is None
    meta.unlink()
    meta.write_text(kept)
    npy = tmp_path / "e.train.npy"
    npy.unlink()
    os.mkfifo(npy)  # nothing ever writes to it: opening it for reading would wait for ever
    assert token_cache.read_entry(tmp_path, "e", ids.dtype) is None
    token_cache.write_entry(tmp_path, "e", ids, None)  # replaced by a regular file
    np.testing.assert_array_equal(token_cache.read_entry(tmp_path, "e", ids.dtype)[0], ids)
