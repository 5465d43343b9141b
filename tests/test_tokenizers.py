"""Tokenizers: HF tokenizer.json, Llama 3 style tiktoken files, trained+cached BPE, errors.

All assets are built in tmp_path from a small BPE trained here (no network).
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import replace

import pytest

from llmforge.config.schema import TokenizerConfig
from llmforge.data.tokenizers import (
    LLAMA3_PAT_STR,
    LLAMA3_SPECIAL_TOKENS,
    META_FILE,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
    check_vocab,
    load_saved,
    train_bpe_tokenizer,
)
from llmforge.errors import ConfigError

VOCAB = 400
CORPUS = [
    f"Line {i}: the quick brown fox jumps over the lazy dog; 1234567890 and 9876543210.\n"
    f"Café crème, naïve façade — 日本語のテキスト {i % 7} 🙂\n\tIndented  text with  spaces."
    for i in range(200)
] + ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"] * 20

SAMPLES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Café crème — naïve 日本語 🙂 Ω≈ç√",
    "line one\nline two\r\n\n  indented\ttab\n",
    "numbers 1234567 and 42",
    "",
    " leading and trailing spaces  ",
]


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A trained BPE (HF tokenizer.json) and a tiktoken rank file derived from it."""
    root = tmp_path_factory.mktemp("tok")
    bpe = train_bpe_tokenizer(CORPUS, VOCAB, root / "cache", "fp1")
    hf_path = root / "tokenizer.json"
    bpe.save(root / "hf_saved")
    hf_path.write_text((root / "hf_saved" / "tokenizer.json").read_text())
    merges = json.loads(hf_path.read_text())["model"]["merges"]
    dec = _byte_decoder()
    ranks = [bytes([b]) for b in range(256)]
    for m in merges:
        a, b = m.split(" ") if isinstance(m, str) else m
        ranks.append(bytes(dec[c] for c in a + b))
    assert len(set(ranks)) == len(ranks)
    tk_path = root / "tokenizer.model"
    tk_path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    return {"root": root, "bpe": bpe, "hf_path": hf_path, "tk_path": tk_path,
            "n_base": len(ranks)}


@pytest.fixture(scope="module")
def hf(assets) -> HFTokenizer:
    return HFTokenizer(assets["hf_path"])


@pytest.fixture(scope="module")
def tk(assets) -> TiktokenTokenizer:
    return TiktokenTokenizer(assets["tk_path"])


def test_trained_bpe_shape(assets):
    bpe = assets["bpe"]
    assert isinstance(bpe, Tokenizer) and bpe.type == "huggingface"
    assert bpe.vocab_size == VOCAB
    assert (bpe.bos_id, bpe.eos_id, bpe.pad_id) == (0, 1, 2)


@pytest.mark.parametrize("which", ["bpe", "hf", "tk"])
def test_round_trip_and_batch(which, assets, hf, tk):
    tok = {"bpe": assets["bpe"], "hf": hf, "tk": tk}[which]
    for text in SAMPLES:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    framed = tok.encode("hello", bos=True, eos=True)
    assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id
    assert framed[1:-1] == tok.encode("hello")
    assert tok.encode("hello", eos=True)[-1] == tok.eos_id
    assert tok.encode("hello", bos=True)[0] == tok.bos_id


def test_hf_special_ids(hf):
    assert (hf.bos_id, hf.eos_id, hf.pad_id, hf.vocab_size) == (0, 1, 2, VOCAB)
    assert hf.decode([hf.bos_id]) == "<|begin_of_text|>"


def test_tiktoken_special_ids(tk, assets):
    n = assets["n_base"]
    assert (tk.bos_id, tk.eos_id, tk.pad_id) == (n, n + 1, n + 4)
    assert tk.vocab_size == n + 256 and len(LLAMA3_SPECIAL_TOKENS) == 256
    assert LLAMA3_SPECIAL_TOKENS[10] == "<|python_tag|>" and LLAMA3_SPECIAL_TOKENS[5] == "<|step_id|>"
    assert LLAMA3_SPECIAL_TOKENS[-1] == "<|reserved_special_token_246|>"  # 11 named + 245 reserved
    assert tk.special_tokens["<|eot_id|>"] == n + 9
    assert tk.decode([tk.eos_id]) == "<|end_of_text|>"


@pytest.mark.parametrize("which", ["hf", "tk"])
def test_special_text_is_ordinary(which, hf, tk):
    tok = {"hf": hf, "tk": tk}[which]
    text = "a<|end_of_text|>b<|begin_of_text|><|pad|><|finetune_right_pad_id|>"
    ids = tok.encode(text)
    assert not {tok.bos_id, tok.eos_id, tok.pad_id} & set(ids)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text]) == [ids]


def test_llama3_split_pattern(tk, hf):
    import regex

    assert tk.encoding._pat_str == LLAMA3_PAT_STR
    assert regex.findall(LLAMA3_PAT_STR, "abc 1234567 I'm\n\n  x") == \
        ["abc", " ", "123", "456", "7", " I", "'m", "\n\n", " ", " x"]

    def pieces(tok, text):
        return [tok.decode([i]) for i in tok.encode(text)]

    # The trained BPE (GPT-2 style splitting) learned merges across 3-digit groups ...
    assert any(len(p.strip()) > 3 and p.strip().isdigit() for p in pieces(hf, " 1234567890"))
    # ... but the Llama 3 pattern splits digits into groups of at most 3 before BPE.
    got = pieces(tk, "1234567890")
    assert "".join(got) == "1234567890"
    bounds, pos = set(), 0
    for p in got:
        pos += len(p)
        bounds.add(pos)
    assert {3, 6, 9} <= bounds and all(len(p) <= 3 for p in got)


def test_train_bpe_cache_skips_texts(tmp_path):
    tok1 = train_bpe_tokenizer(iter(CORPUS), VOCAB, tmp_path, "abc")
    cached = tmp_path / f"bpe-{VOCAB}-abc" / "tokenizer.json"
    assert cached.is_file()
    assert not [p for p in cached.parent.iterdir() if p.name != "tokenizer.json"]

    def boom():
        raise AssertionError("texts must not be iterated on a cache hit")
        yield  # pragma: no cover

    tok2 = train_bpe_tokenizer(boom(), VOCAB, tmp_path, "abc")
    assert tok2.encode(SAMPLES[2]) == tok1.encode(SAMPLES[2])
    cfg = TokenizerConfig(type="train_bpe", vocab_size=VOCAB)
    tok3 = build_tokenizer(cfg, None, tmp_path, fingerprint="abc")  # factory never needed
    assert tok3.vocab_size == VOCAB
    # A different fingerprint trains again (and needs the texts).
    with pytest.raises(AssertionError):
        train_bpe_tokenizer(boom(), VOCAB, tmp_path, "other")


def test_train_bpe_deterministic(tmp_path, assets):
    a = train_bpe_tokenizer(CORPUS, VOCAB, tmp_path / "a", "x")
    b = train_bpe_tokenizer(CORPUS, VOCAB, tmp_path / "b", "x")
    ja = (tmp_path / "a" / f"bpe-{VOCAB}-x" / "tokenizer.json").read_bytes()
    jb = (tmp_path / "b" / f"bpe-{VOCAB}-x" / "tokenizer.json").read_bytes()
    assert ja == jb
    assert a.encode(SAMPLES[1]) == b.encode(SAMPLES[1]) == assets["bpe"].encode(SAMPLES[1])
    # empty fingerprint: no cache written
    c = train_bpe_tokenizer(CORPUS, VOCAB, tmp_path / "c", "")
    assert c.encode(SAMPLES[1]) == a.encode(SAMPLES[1])
    assert not (tmp_path / "c").exists()


def test_build_tokenizer_train_bpe_respects_max_bytes(tmp_path):
    calls = []

    def factory():
        calls.append(1)
        return iter(CORPUS)

    cfg = TokenizerConfig(type="train_bpe", vocab_size=300, train_max_bytes=50)
    tok = build_tokenizer(cfg, factory, tmp_path, fingerprint="small")
    assert calls == [1]
    # 50 bytes of text cannot feed 41 merges
    assert tok.vocab_size < 300
    build_tokenizer(cfg, factory, tmp_path, fingerprint="small")
    assert calls == [1]


@pytest.mark.parametrize("which", ["bpe", "hf", "tk"])
def test_save_load_saved(which, assets, hf, tk, tmp_path):
    tok = {"bpe": assets["bpe"], "hf": hf, "tk": tk}[which]
    tok.save(tmp_path / "saved")
    meta = json.loads((tmp_path / "saved" / META_FILE).read_text())
    assert meta["type"] == tok.type
    back = load_saved(tmp_path / "saved")
    assert type(back) is type(tok)
    assert (back.vocab_size, back.bos_id, back.eos_id, back.pad_id) == \
        (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id)
    assert back.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)
    if which == "tk":
        assert (tmp_path / "saved" / "tokenizer.model").read_bytes() == \
            assets["tk_path"].read_bytes()


@pytest.mark.parametrize("file", ["../elsewhere.json", "/etc/passwd", "sub/tokenizer.json"])
def test_load_saved_refuses_a_file_outside_its_folder(hf, tmp_path, file):
    hf.save(tmp_path / "saved")
    meta = json.loads((tmp_path / "saved" / META_FILE).read_text())
    (tmp_path / "elsewhere.json").write_text((tmp_path / "saved" / meta["file"]).read_text())
    (tmp_path / "saved" / META_FILE).write_text(json.dumps({**meta, "file": file}))
    with pytest.raises(ConfigError, match="is not a file of .*refused"):
        load_saved(tmp_path / "saved")


def test_build_tokenizer_dispatch(assets):
    hf = build_tokenizer(TokenizerConfig(type="huggingface", path=str(assets["hf_path"])), None,
                         assets["root"])
    tk = build_tokenizer({"type": "tiktoken", "path": str(assets["tk_path"])}, None,
                         assets["root"])
    assert isinstance(hf, HFTokenizer) and isinstance(tk, TiktokenTokenizer)


def test_build_tokenizer_omegaconf(assets):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.structured(
        TokenizerConfig(type="tiktoken", path=str(assets["tk_path"])))
    assert isinstance(build_tokenizer(cfg, None, assets["root"]), TiktokenTokenizer)


def test_hf_bos_eos_override_and_detection(tmp_path, assets):
    hf = HFTokenizer(assets["hf_path"], bos_token="<|pad|>", eos_token="<|pad|>",
                     pad_token="<|pad|>")
    assert (hf.bos_id, hf.eos_id, hf.pad_id) == (2, 2, None)  # pad == eos -> no pad
    data = json.loads(assets["hf_path"].read_text())
    for added in data["added_tokens"]:
        added["content"] = {0: "<s>", 1: "</s>", 2: "<unk>"}.get(added["id"], added["content"])
    data["model"]["vocab"] = {
        {"<|begin_of_text|>": "<s>", "<|end_of_text|>": "</s>", "<|pad|>": "<unk>"}.get(k, k): v
        for k, v in data["model"]["vocab"].items()}
    p = tmp_path / "sp.json"
    p.write_text(json.dumps(data))
    t = HFTokenizer(p)
    assert (t.bos_id, t.eos_id, t.pad_id) == (0, 1, None)
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        HFTokenizer(p, bos_token="<nope>")


def test_error_unknown_type(tmp_path):
    cfg = TokenizerConfig(type="sentencepiece")
    with pytest.raises(ConfigError) as e:
        build_tokenizer(cfg, None, tmp_path)
    msg = str(e.value)
    assert "tokenizer.type" in msg and "sentencepiece" in msg
    for valid in ("huggingface", "tiktoken", "train_bpe"):
        assert valid in msg


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken"])
def test_error_missing_path(kind, tmp_path):
    with pytest.raises(ConfigError, match=rf"tokenizer\.path.*required.*{kind}"):
        build_tokenizer(TokenizerConfig(type=kind, path=None), None, tmp_path)


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken"])
def test_error_nonexistent_path(kind, tmp_path):
    missing = tmp_path / "nope" / "tok.file"
    with pytest.raises(ConfigError) as e:
        build_tokenizer(TokenizerConfig(type=kind, path=str(missing)), None, tmp_path)
    assert "tokenizer.path" in str(e.value) and str(missing) in str(e.value)
    assert "does not exist" in str(e.value)


def test_error_unparsable_files(tmp_path, assets):
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("this is not a tokenizer\n")
    with pytest.raises(ConfigError) as e:
        build_tokenizer(TokenizerConfig(type="huggingface", path=str(garbage)), None, tmp_path)
    msg = str(e.value)
    assert "tokenizer.path" in msg and str(garbage) in msg and "tokenizer.json" in msg
    with pytest.raises(ConfigError) as e:
        build_tokenizer(TokenizerConfig(type="tiktoken", path=str(garbage)), None, tmp_path)
    msg = str(e.value)
    assert "tokenizer.path" in msg and str(garbage) in msg and "tiktoken" in msg
    assert "line 1" in msg
    # Swapped formats come with a hint at the right type.
    with pytest.raises(ConfigError, match="tokenizer.type: huggingface"):
        build_tokenizer(TokenizerConfig(type="tiktoken", path=str(assets["hf_path"])), None,
                        tmp_path)
    with pytest.raises(ConfigError, match="tokenizer.type: tiktoken"):
        build_tokenizer(TokenizerConfig(type="huggingface", path=str(assets["tk_path"])), None,
                        tmp_path)
    # A rank file that tiktoken could not use (a byte missing) is rejected.
    partial = tmp_path / "partial.model"
    partial.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(200)))
    with pytest.raises(ConfigError, match="256 single bytes"):
        TiktokenTokenizer(partial)


def test_error_vocab_too_small(tmp_path):
    cfg = replace(TokenizerConfig(), vocab_size=261)
    with pytest.raises(ConfigError) as e:
        build_tokenizer(cfg, lambda: iter(CORPUS), tmp_path, fingerprint="f")
    assert "tokenizer.vocab_size" in str(e.value) and "261" in str(e.value)
    assert "262" in str(e.value)  # 256 bytes + 6 special tokens (bos, eos, pad, 3 chat tokens)
    assert train_bpe_tokenizer(CORPUS, 262, tmp_path, "f").vocab_size == 262


def test_load_saved_errors(tmp_path):
    with pytest.raises(ConfigError, match=META_FILE):
        load_saved(tmp_path)


def test_check_vocab(hf):
    check_vocab(hf, VOCAB)
    check_vocab(hf, VOCAB + 100)
    with pytest.raises(ConfigError) as e:
        check_vocab(hf, VOCAB - 1)
    msg = str(e.value)
    assert str(VOCAB) in msg and str(VOCAB - 1) in msg
    assert "model.vocab_size" in msg and "tokenizer" in msg


def test_hf_endoftext_serves_as_bos_and_eos(tmp_path, assets):
    data = json.loads(assets["hf_path"].read_text())
    names = {"<|begin_of_text|>": "<|endoftext|>", "<|end_of_text|>": "<x>", "<|pad|>": "<y>"}
    for added in data["added_tokens"]:
        added["content"] = names.get(added["content"], added["content"])
    data["model"]["vocab"] = {names.get(k, k): v for k, v in data["model"]["vocab"].items()}
    p = tmp_path / "gpt2ish.json"
    p.write_text(json.dumps(data))
    t = HFTokenizer(p)
    assert (t.bos_id, t.eos_id, t.pad_id) == (0, 0, None)


def test_train_bpe_needs_factory_when_not_cached(tmp_path):
    with pytest.raises(ValueError, match="texts_factory"):
        build_tokenizer(TokenizerConfig(type="train_bpe", vocab_size=300), None, tmp_path, "new")


def test_a_named_pipe_in_a_saved_tokenizer_is_refused_not_waited_on(tmp_path):
    """A shared run's tokenizer folder with a FIFO made generate block for ever on open()."""
    os.mkfifo(tmp_path / "llmforge_tokenizer.json")
    with pytest.raises(ConfigError, match="llmforge_tokenizer.json is not a regular file"):
        load_saved(tmp_path)
    os.unlink(tmp_path / "llmforge_tokenizer.json")
    meta = {"type": "huggingface", "file": "tokenizer.json"}
    (tmp_path / "llmforge_tokenizer.json").write_text(json.dumps(meta))
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="tokenizer.json is not a regular file"):
        load_saved(tmp_path)
