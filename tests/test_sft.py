"""Supervised fine-tuning data: the Llama 3 chat template, response-only loss, EOS as a target
when padding shares its id, packing with document masking, bad input, and the demo SFT run."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import REPO, TINY_OVERRIDES, run_main
from helpers.dist import torchrun, worker
from llmforge.cli import main
from llmforge.config.schema import DataConfig
from llmforge.data.chat import Llama3ChatTemplate, build_chat_template, render_llama3
from llmforge.data.sft import (Conversation, SFTDataModule, build_rows, encode_examples,
                               load_conversations, read_jsonl)
from llmforge.data.tokenizers import TiktokenTokenizer, train_bpe_tokenizer
from llmforge.errors import ConfigError, DataError
from llmforge.events import IGNORE_INDEX
from llmforge.models.llama3.model import (Llama, LlamaArgs, document_causal_mask, document_positions)

CORPUS = ["What is two plus two? Two plus two is four. Reverse the word apple: elppa. " * 20,
          "Be brief. Answer in one short sentence. The capital letters are HELLO WORLD. " * 20]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": " And three plus three? "},
        {"role": "assistant", "content": "Six."}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_bpe_tokenizer(CORPUS, 320, tmp_path_factory.mktemp("tok"), "")


def data_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(DataConfig), {"task": "sft", "source": "files", **kw})


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------- template
def test_llama3_template_renders_the_exact_format(tok):
    expected = ("<|begin_of_text|>"
                "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nAnd three plus three?<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\nSix.<|eot_id|>")
    assert render_llama3(CHAT) == expected
    prompt = render_llama3(CHAT[:2], add_generation_prompt=True)
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.decode(Llama3ChatTemplate(tok).prompt_ids(CHAT[:2])) == prompt
    ids, _ = Llama3ChatTemplate(tok).tokenize(CHAT)
    assert tok.decode(ids) == expected
    for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert ids.count(tok.token_id(t)) == expected.count(t)  # each is one id


def test_template_ids_equal_tiktoken_encoding_of_the_rendered_string(tmp_path):
    """Piecewise encoding (header, "\\n\\n", content) equals encoding the whole rendered string
    with special tokens parsed, as HF's apply_chat_template does, under Llama 3's split regex."""
    ranks = [bytes([b]) for b in range(256)] + [b"\n\n", b"wo", b"two", b" two", b"Fo", b"Four"]
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % r for r, t in enumerate(ranks)))
    tk = TiktokenTokenizer(path)
    ids, _ = Llama3ChatTemplate(tk).tokenize(CHAT)
    assert ids == tk.encoding.encode(render_llama3(CHAT), allowed_special="all")
    assert tk.token_id("<|eot_id|>") == len(ranks) + 9


def test_template_needs_chat_tokens():
    class NoChat:
        def token_id(self, t):
            return {"<|begin_of_text|>": 0}.get(t)

    with pytest.raises(ConfigError, match=r"lacks \['<\|start_header_id\|>'"):
        Llama3ChatTemplate(NoChat())
    with pytest.raises(ConfigError, match="data.chat_template: unknown template 'vicuna'"):
        build_chat_template("vicuna", NoChat())
    with pytest.raises(ConfigError, match=r"chatml needs the single tokens <\|im_start\|>"):
        build_chat_template("chatml", NoChat())


# --------------------------------------------------------------- loss mask
def test_prompt_tokens_carry_no_loss(tok):
    conv = Conversation([{"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "Two plus two is four."}], "x:1")
    [(inputs, labels)], stats = encode_examples([conv], Llama3ChatTemplate(tok), seq_len=128)
    eot = tok.token_id("<|eot_id|>")
    response = tok.encode("Two plus two is four.")
    targets = labels[labels != IGNORE_INDEX].tolist()
    assert targets == response + [eot]  # the response and the end-of-turn, nothing else
    assert stats.targets == len(response) + 1
    # every position before the response's first token predicts a prompt/header token: no loss
    first = len(inputs) - len(response) - 1  # position predicting the first response token
    assert (labels[:first] == IGNORE_INDEX).all() and (labels[first:] != IGNORE_INDEX).all()
    # train_on_input: the user content and its <|eot_id|> become targets, headers never
    [(_, labels2)], _ = encode_examples([conv], Llama3ChatTemplate(tok), 128, train_on_input=True)
    assert labels2[labels2 != IGNORE_INDEX].tolist() == (
        tok.encode("What is two plus two?") + [eot] + response + [eot])


@pytest.mark.parametrize("pad", ["eos", "eot"])
@pytest.mark.parametrize("packed", [False, True])
def test_eos_is_a_target_when_pad_id_equals_it(tok, tmp_path, pad, packed):
    """data.pad_id configured as the tokenizer's EOS (or the template's stop token <|eot_id|>):
    the real stop token after each response keeps its label, every padding position has none."""
    rows = [{"prompt": "What is two plus two?", "response": "Four."},
            {"prompt": "Reverse the word apple.", "response": "elppa"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    template = Llama3ChatTemplate(tok)
    pad_id = tok.eos_id if pad == "eos" else template.stop_id
    docs = load_conversations(data_cfg(path=str(path), val_fraction=0), seed=0)
    dm = SFTDataModule(docs, tok, template=template, packed=packed, pad_id=pad_id, seq_len=96,
                       local_batch_size=1, micro_batch_size=1, eval_batches=1, seed=0,
                       num_workers=0, dp_rank=0, dp_size=1)
    dm.setup()
    examples, _ = encode_examples(docs.train, template, 96)
    lengths = [len(e[0]) for e in examples]
    row_lengths = [sum(lengths)] if packed else lengths
    assert len(dm.train_windows) == len(row_lengths) and max(row_lengths) < 96  # padding exists
    for r, n in enumerate(row_lengths):
        row = dm.train_windows[r]
        assert (row["input_ids"][n:] == pad_id).all()  # padding uses the configured id ...
        assert (row["labels"][n:] == IGNORE_INDEX).all()  # ... and carries no label
        assert row["labels"][n - 1] == template.stop_id  # the last real position: <|eot_id|>
    labels = torch.cat([dm.train_windows[r]["labels"] for r in range(len(row_lengths))])
    assert (labels == template.stop_id).sum() == 2  # one <|eot_id|> target per response
    assert (labels != IGNORE_INDEX).sum() == dm.stats["train"].targets


# ------------------------------------------------------------------ packing
def test_document_positions_and_mask():
    d = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert document_positions(d).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    m = document_causal_mask(d)[0, 0]
    assert m.shape == (8, 8)
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for lo, hi in [(0, 3), (3, 5), (5, 8)]:
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(m, expected)


def tiny_llama(vocab, max_seq_len=64):
    torch.manual_seed(0)
    return Llama(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                           multiple_of=32, max_seq_len=max_seq_len, init_std=0.2))


def test_one_document_equals_plain_causal(tok):
    model = tiny_llama(tok.vocab_size)
    x = torch.randint(0, tok.vocab_size, (2, 48))
    with torch.no_grad():
        a, b = model(x), model(x, doc_ids=torch.zeros_like(x))
    assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_packed_loss_equals_unpacked_per_example(tok):
    convs = [Conversation([{"role": "user", "content": "What is two plus two?"},
                           {"role": "assistant", "content": "Two plus two is four."}], "a:1"),
             Conversation(CHAT, "a:2"),
             Conversation([{"role": "user", "content": "Reverse the word apple."},
                           {"role": "assistant", "content": "elppa"}], "a:3")]
    examples, _ = encode_examples(convs, Llama3ChatTemplate(tok), seq_len=256)
    packed = build_rows(examples, 256, pad_id=2, packed=True)
    single = build_rows(examples, 256, pad_id=2, packed=False)
    assert len(packed["input_ids"]) == 1 and len(single["input_ids"]) == 3
    assert "doc_ids" not in single
    model = tiny_llama(tok.vocab_size, 256)  # fp32
    t = {k: torch.from_numpy(v.astype(np.int64)) for k, v in packed.items()}
    with torch.no_grad():
        logits = model(t["input_ids"], doc_ids=t["doc_ids"])
        ce = F.cross_entropy(logits[0], t["labels"][0], ignore_index=IGNORE_INDEX, reduction="none")
        for d in range(3):
            row = {k: torch.from_numpy(v[d:d + 1].astype(np.int64)) for k, v in single.items()}
            ce1 = F.cross_entropy(model(row["input_ids"])[0], row["labels"][0],
                                  ignore_index=IGNORE_INDEX, reduction="none")
            sel = t["doc_ids"][0] == d
            n = (row["labels"] != IGNORE_INDEX).sum()
            assert n > 0
            packed_loss = ce[sel].sum() / n
            single_loss = ce1.sum() / n
            assert abs(packed_loss - single_loss) < 1e-5, (d, packed_loss, single_loss)
            # the logits of the example inside the packed row equal those alone
            k = len(examples[d][0])
            assert torch.allclose(logits[0, sel], model(row["input_ids"][:, :k])[0], atol=1e-5)
        # without document masking the packed loss would differ (the test can tell)
        leaky = F.cross_entropy(model(t["input_ids"])[0], t["labels"][0],
                                ignore_index=IGNORE_INDEX, reduction="none")
        sel = t["doc_ids"][0] == 1
        assert abs(leaky[sel].sum() - ce[sel].sum()) > 1e-3


@pytest.mark.parametrize("mode, selective", [("full", "layer"), ("selective", "op")])
def test_doc_ids_pass_through_activation_checkpointing(tok, mode, selective):
    import copy

    from llmforge.algorithms.activation_checkpointing import ActivationCheckpointing, replace_blocks

    model = tiny_llama(tok.vocab_size)
    x = torch.randint(0, tok.vocab_size, (2, 48))
    d = torch.arange(48).div(13, rounding_mode="floor").expand(2, 48)

    def grads(m):
        m.zero_grad()
        m(x, doc_ids=d).pow(2).mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    wrapped = copy.deepcopy(model)
    assert replace_blocks(wrapped, ActivationCheckpointing(mode=mode, selective=selective).wrap) == 2
    for a, b in zip(grads(wrapped), grads(model)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_rows_fill_and_overlong(tok, tmp_path):
    template = Llama3ChatTemplate(tok)
    long = {"prompt": "What is two plus two?", "response": "Four. " * 30}
    long_prompt = {"prompt": "What is two plus two? " * 10, "response": "Four."}
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, long, long_prompt])
    convs = list(read_jsonl(str(path), data_cfg()))
    n_long = len(template.tokenize(convs[1].messages)[0])
    seq = 40
    assert n_long > seq + 1
    kept, stats = encode_examples(convs, template, seq, "drop")
    assert (len(kept), stats.dropped_overlong, stats.first_overlong) == (1, 2, f"{path}:2")
    assert "2 longer than seq_len+1=41 dropped" in stats.summary(seq)
    kept, stats = encode_examples(convs, template, seq, "truncate")
    # the long response is cut to seq_len+1 ids; the long prompt leaves no response: dropped
    assert len(kept) == 2 and stats.truncated == 1 and len(kept[1][0]) == seq
    assert stats.dropped_no_target == 1
    with pytest.raises(DataError, match=rf"{path}:2: the example is {n_long} tokens, longer than "
                                        rf"trainer.seq_len\+1 = 41"):
        encode_examples(convs, template, seq, "error")


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "hi", "response": "yo"', "not valid JSON"),
    ('{"prompt": "hi"}', "missing field 'response'"),
    ('{"prompt": "hi", "response": "  "}', "empty 'response'"),
    ('{"prompt": "hi", "response": 3}', "field 'response' must be a string"),
    ('{"text": "hi"}', "needs 'messages'"),
    ('["a"]', "expected a JSON object"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role 'bot' is not one of"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "has no assistant message"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}',
     "assistant message with empty content"),
    ('{"messages": [{"role": "user"}]}', "must be an object with 'role' and 'content'"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "response": "fine"}, "", line])
    with pytest.raises(DataError) as e:
        load_conversations(data_cfg(path=str(path), val_fraction=0), 0)
    assert f"{path}:3: " in str(e.value) and needle in str(e.value), str(e.value)


def test_holdout_and_other_errors(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"}
                                              for i in range(20)])
    a = load_conversations(data_cfg(path=str(path), val_fraction=0.1), 3)
    b = load_conversations(data_cfg(path=str(path), val_fraction=0.1), 3)
    assert len(a.train) == 18 and len(a.val) == 2
    assert [c.where for c in a.val] == [c.where for c in b.val]
    assert not {c.where for c in a.train} & {c.where for c in a.val}
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match="is not a .jsonl or .parquet file"):
        load_conversations(data_cfg(path=str(tmp_path / "d.txt")), 0)
    with pytest.raises(DataError, match="data.source=files"):
        load_conversations(data_cfg(source="shakespeare"), 0)
    capped = load_conversations(data_cfg(path=str(path), val_fraction=0, max_documents=5), 0)
    assert [c.where for c in capped.train] == [f"{path}:{i}" for i in range(1, 6)]


def test_parquet_rows_and_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            [{"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    docs = load_conversations(data_cfg(path=str(tmp_path / "chat.parquet"), val_fraction=0), 0)
    assert [c.messages for c in docs.train] == msgs
    assert docs.train[1].where == f"{tmp_path / 'chat.parquet'} row 2"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["c", None]}), tmp_path / "pr.parquet")
    with pytest.raises(DataError, match=r"pr.parquet row 2: field 'response' must be a string, "
                                        r"got NoneType"):
        load_conversations(data_cfg(path=str(tmp_path / "pr.parquet"), val_fraction=0), 0)


def test_config_validation_of_sft_keys():
    from llmforge.config.schema import TrainConfig
    from llmforge.config.validate import validate

    def check(**data):
        cfg = OmegaConf.structured(TrainConfig)
        cfg.data.merge_with({"task": "sft", "source": "files", "path": "x.jsonl", **data})
        return validate(cfg)

    check()
    with pytest.raises(ConfigError, match="data.task: expected one of pretrain, sft; got 'chat'"):
        check(task="chat")
    with pytest.raises(ConfigError, match="data.overlong: expected one of drop, truncate, error"):
        check(overlong="cut")
    with pytest.raises(ConfigError, match="set data.source=files"):
        check(source="shakespeare")
    with pytest.raises(ConfigError, match="data.val_split=null"):
        check(val_split="validation")
    check(source="hub", path="org/chats", val_split="test")
    with pytest.raises(ConfigError, match="data.streaming=false"):
        check(streaming=True)


# ------------------------------------------------------------------ the CLI
def sft_args(out, data):
    return [*TINY_OVERRIDES, "variables.seq_len=128", f"run.output_dir={out}",
            f"data.path={data}", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
            "trainer.eval_every=0", "trainer.log_every=1", "trainer.eval_batches=2"]


def records(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def make_instructions(path, n):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mk", REPO / "examples" / "make_instructions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write(path, n=n, seed=1)


def test_demo_sft_yaml_trains_and_loss_decreases(tmp_path):
    data = make_instructions(tmp_path / "instructions.jsonl", 200)
    proc = run_main("train", str(REPO / "yamls" / "demo_cpu_sft.yaml"), *sft_args(tmp_path, data),
                    "trainer.max_steps=25", "optimizer.lr=3e-3", "scheduler.warmup_steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sft train: " in proc.stderr and "target tokens" in proc.stderr
    recs = records(tmp_path / "demo_cpu_sft")
    evals = [r["eval/loss"] for r in recs if "eval/loss" in r]
    train = [r["train/loss"] for r in recs if "train/loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0] - 1.0, evals
    assert np.mean(train[-5:]) < np.mean(train[:5]) - 1.0, train
    # generate --chat: the prompt as a user turn, the answer alone, stopped at <|eot_id|>
    from llmforge.checkpoint.run_dir import load_for_inference
    from llmforge.models.sampling import generate

    run = tmp_path / "demo_cpu_sft"
    gen = run_main("generate", str(run), "--chat", "--prompt", "What is 3 plus 4?",
                   "--temperature", "0", "--max-new-tokens", "40")
    assert gen.returncode == 0, gen.stderr[-2000:]
    model, tok, _ = load_for_inference(run)
    template = Llama3ChatTemplate(tok)
    ids = template.prompt_ids([{"role": "user", "content": "What is 3 plus 4?"}])
    new = generate(model, ids, 40, temperature=0.0, eos_id=template.stop_id)
    answer = tok.decode([i for i in new if i not in (tok.eos_id, template.stop_id)])
    assert gen.stdout.rstrip("\n") == answer and "What is" not in gen.stdout
    assert "<|eot_id|>" not in gen.stdout


def test_sft_from_a_pretrained_run_and_bad_line_exit_2(tmp_path, capsys):
    """A pretraining run's checkpoint and tokenizer start an SFT run (model.init_from); a bad
    jsonl line stops the CLI with exit 2, one error line naming file:line."""
    data = make_instructions(tmp_path / "instructions.jsonl", 60)
    text = tmp_path / "text.txt"  # pretraining text: other instructions of the same kinds, plain
    other = make_instructions(tmp_path / "other.jsonl", 400)
    text.write_text("\n".join(c.text for c in read_jsonl(str(other), data_cfg())))
    # every run in this process (main): no interpreter start per run
    assert main(["train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES,
                 f"run.output_dir={tmp_path}", "run.name=pre", "data.source=files",
                 f"data.path={text}", "data.val_fraction=0", "trainer.max_steps=30",
                 "trainer.eval_every=0", "trainer.log_every=10", "scheduler.warmup_steps=3",
                 "optimizer.lr=3e-3"]) == 0
    tok = tmp_path / "pre" / "tokenizer" / "tokenizer.json"
    common = [*sft_args(tmp_path, data), "tokenizer.type=huggingface", f"tokenizer.path={tok}",
              "trainer.max_steps=2", "scheduler.warmup_steps=0"]
    step0 = {}
    for name, extra in [("fresh", []), ("init", [f"model.init_from={tmp_path / 'pre'}"])]:
        assert main(["train", str(REPO / "yamls" / "demo_cpu_sft.yaml"), *common,
                     f"run.name={name}", *extra]) == 0, name
        first = records(tmp_path / name)[0]
        assert first["step"] == 0
        step0[name] = first["eval/loss"]
    # same data, tokenizer and seed: only the starting weights differ, and the pretrained ones
    # already predict the responses' words and digits much better
    assert step0["init"] < step0["fresh"] - 1.0, step0

    with open(data, "a") as f:
        f.write('{"prompt": "no response here"}\n')
    capsys.readouterr()
    assert main(["train", str(REPO / "yamls" / "demo_cpu_sft.yaml"), *common, "run.name=bad"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"{data}:61: missing field 'response'" in errors[0], errors


@pytest.mark.slow
def test_packed_sft_same_losses_under_tensor_parallel_and_fsdp2(tmp_path):
    """doc_ids (positions + block-diagonal mask) pass through TP (2 processes, sequence
    parallel), FSDP2 (2 processes) and context parallelism (cp=2, both modes: each rank's
    slice keeps its per-document positions and the mask of the whole row) unchanged: the
    losses equal one process within 1e-5. One process runs in this process; the others in ONE
    2-process torchrun launch (tests/dist/train_worker.py runs them in sequence)."""
    data = make_instructions(tmp_path / "instructions.jsonl", 120)
    args = ["train", str(REPO / "yamls" / "demo_cpu_sft.yaml"), *sft_args(tmp_path, data),
            "trainer.max_steps=3", "scheduler.warmup_steps=0", "trainer.micro_batch_size=4",
            "data.val_fraction=0"]
    assert main([*args, "run.name=single"]) == 0
    runs = {"tp2": [*args, "run.name=tp2", "strategy.tp=2"],
            "fsdp2": [*args, "run.name=fsdp2", "strategy.name=fsdp2"],
            "cp2": [*args, "run.name=cp2", "strategy.cp=2"],
            "cp2_ulysses": [*args, "run.name=cp2_ulysses", "strategy.cp=2",
                            "context_parallel.mode=ulysses"]}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    proc = torchrun(worker("train_worker.py"), str(tmp_path), str(tmp_path / "runs.json"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {name: [r["train/loss"] for r in records(tmp_path / name) if "train/loss" in r]
           for name in ("single", *runs)}
    assert len(out["single"]) == 3
    for name in runs:
        assert out[name] == pytest.approx(out["single"], abs=1e-5), (name, out)
