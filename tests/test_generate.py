"""KV-cache generation: the cached and the uncached greedy paths give the same tokens (Llama 3
and Qwen3, past the end of the RoPE window too), research blocks without a cache fall back, and
`llmforge generate` streams the text and reports tokens/s."""

import pytest
import torch
from omegaconf import OmegaConf

from llmforge.models import LLAMA3, QWEN3
from llmforge.models.sampling import KVCache, generate, supports_kv_cache

SHAPES = {"llama3": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                         multiple_of=32, max_seq_len=48),
          "qwen3": dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=32, hidden_dim=96,
                        vocab_size=97, max_seq_len=48)}


@pytest.fixture
def one_thread():
    """Decoding many tiny steps is dominated by thread wake-ups on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(family):
    spec = {"llama3": LLAMA3, "qwen3": QWEN3}[family]
    torch.manual_seed(0)
    return spec(OmegaConf.structured(spec.config_cls(preset=None, **SHAPES[family]))).eval()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cached_and_uncached_greedy_tokens_are_identical(family, one_thread):
    model = tiny(family)
    assert supports_kv_cache(model)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    # 8 + 44 tokens pass max_seq_len=48: the cached path hands over to the sliding window
    cached = generate(model, prompt, 44, temperature=0, use_cache=True)
    plain = generate(model, prompt, 44, temperature=0, use_cache=False)
    assert cached == plain and len(cached) == 44
    with torch.no_grad():  # the logits of one cached step equal a full recompute
        cache = KVCache(2, 48)
        model(torch.tensor([prompt]), cache=cache)
        step = model(torch.tensor([[7]]), cache=cache)[0, -1]
        full = model(torch.tensor([prompt + [7]]))[0, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
    assert cache.length == len(prompt) + 1


def test_research_block_without_cache_falls_back(one_thread):
    from examples.parallel_block_model import build_parallel_llama

    torch.manual_seed(0)
    model = build_parallel_llama(OmegaConf.structured(LLAMA3.config_cls(
        preset=None, **SHAPES["llama3"]))).eval()
    assert not supports_kv_cache(model)
    assert len(generate(model, [1, 2, 3], 5, temperature=0)) == 5


def test_generate_cli_streams_and_reports_speed(tmp_path, capsys, monkeypatch):
    """... with its compute threads chosen by training's rule (here OMP_NUM_THREADS wins)."""
    from conftest import REPO, TINY_OVERRIDES
    from llmforge.cli import main

    assert main(["train", str(REPO / "yamls" / "demo_cpu.yaml"), *TINY_OVERRIDES, "trainer.max_steps=1",
                 "data.max_documents=3", "trainer.eval_every=0", f"run.output_dir={tmp_path}",
                 "run.name=g"]) == 0
    capsys.readouterr()
    outs = {}
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        for flag in ([], ["--no-cache"]):
            torch.set_num_threads(2)
            assert main(["generate", str(tmp_path / "g"), "--prompt", "ROMEO.", "--max-new-tokens",
                         "12", "--temperature", "0", *flag]) == 0
            outs[bool(flag)] = capsys.readouterr()
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "KV cache on, 1 thread)" in outs[False].err
    assert outs[False].out == outs[True].out and outs[False].out.startswith("ROMEO.")
    assert "12 tokens in" in outs[False].err and "KV cache on" in outs[False].err
    assert "tokens/s, KV cache off" in outs[True].err
    # issue 50.6: max_seq_len 64 (TINY_OVERRIDES) and "ROMEO." = BOS + 5 ids: 58 new tokens fit
    assert main(["generate", str(tmp_path / "g"), "--prompt", "ROMEO.", "--max-new-tokens", "300",
                 "--temperature", "0"]) == 0
    long = capsys.readouterr()
    assert long.err.startswith("generate: stopping after 58 new tokens, at the model's context length "
                               "of 64 (max_seq_len; the prompt takes 6), not the 300 asked")
    assert "\n58 tokens in" in long.err and long.out.startswith(outs[False].out.rstrip("\n"))
    assert main(["generate", str(tmp_path / "g"), "--prompt", "ROMEO. " * 70, "--max-new-tokens", "3"]) == 2
    assert "model's context is 64 (its max_seq_len): nothing fits after it" in capsys.readouterr().err


def test_generate_runs_a_compiled_model_eager():
    """A model compiled whole (``compile``'s default in one process) decodes with the KV cache
    past dynamo's recompile limit (8): generation runs it eager (``set_stance``), as the
    ``generate_samples`` callback does in a compiled run; same tokens as the plain model."""
    from llmforge.algorithms.compile import Compile
    from llmforge.models.llama3.model import Llama, LlamaArgs

    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                            multiple_of=16, max_seq_len=32))
    want = generate(model, [1, 2, 3], 12, temperature=0)
    Compile().apply(model, None)
    assert generate(model, [1, 2, 3], 12, temperature=0) == want
