"""Tests of the Llama 3 model, presets, config conversion and sampling (CPU, a few seconds)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from llmforge.models.llama3.config import Llama3Config as ModelConfig
from llmforge.errors import ConfigError
from llmforge.models.llama3.config import PRESETS, llama_args_from_config
from llmforge.models.llama3.model import Llama, LlamaArgs, build_llama
from llmforge.models.llama3.model import Attention, ffn_hidden_dim, precompute_rope, rope_frequencies
from llmforge.models.sampling import generate
from llmforge.registry import models

EXPECTED_PARAMS = {
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
}


def tiny(**kw) -> LlamaArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32,
                max_seq_len=64)
    base.update(kw)
    return LlamaArgs(**base)


# -- presets and shapes ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_preset_param_counts_on_meta(name):
    with torch.device("meta"):
        model = Llama(PRESETS[name])
    assert model.tok_embeddings.weight.device.type == "meta"
    assert model.num_params() == EXPECTED_PARAMS[name]


@pytest.mark.parametrize("name,hidden", [("llama3_8b", 14336), ("llama3_70b", 28672),
                                         ("llama3_405b", 53248), ("llama3_1b", 8192),
                                         ("llama3_3b", 8192)])
def test_swiglu_hidden_sizes(name, hidden):
    a = PRESETS[name]
    assert ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier) == hidden
    with torch.device("meta"):
        model = Llama(dataclasses.replace(a, n_layers=1))
    ff = model.layers[0].feed_forward
    assert ff.w1.weight.shape == (hidden, a.dim) == ff.w3.weight.shape
    assert ff.w2.weight.shape == (a.dim, hidden)


def test_tied_embeddings_counted_once_and_stay_tied():
    untied = Llama(tiny())
    tied = Llama(tiny(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.num_params() == untied.num_params() - 97 * 64
    assert PRESETS["llama3_1b"].tie_embeddings and PRESETS["llama3_3b"].tie_embeddings

    with torch.device("meta"):
        m = Llama(tiny(tie_embeddings=True))
    m.to_empty(device="cpu")
    m.init_weights()
    assert m.output.weight is m.tok_embeddings.weight
    assert len(list(m.parameters())) == len(list(untied.parameters())) - 1
    with torch.no_grad():
        m.tok_embeddings.weight[3].fill_(1.0)
    assert torch.equal(m.output.weight[3], torch.ones(64))
    assert torch.isfinite(m(torch.randint(0, 97, (1, 8)))).all()


# -- RoPE --------------------------------------------------------------------------------------

def test_rope_scaled_frequencies_by_hand():
    hd, theta = 128, 500000.0
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    got = rope_frequencies(hd, theta, scaling).double()
    plain = rope_frequencies(hd, theta, None).double()

    def base(i):
        return 1.0 / theta ** (2 * i / hd)

    # index 0: wavelength 2*pi < 8192/4 -> unchanged
    assert got[0].item() == pytest.approx(base(0), rel=1e-6)
    # last index: wavelength ~2.6e6 > 8192 -> divided by 8
    assert 2 * math.pi / base(63) > 8192
    assert got[63].item() == pytest.approx(base(63) / 8, rel=1e-5)
    # index 30: wavelength between 2048 and 8192 -> smooth interpolation
    f = base(30)
    wl = 2 * math.pi / f
    assert 2048 < wl < 8192
    s = (8192 / wl - 1.0) / (4.0 - 1.0)
    assert 0 < s < 1
    assert got[30].item() == pytest.approx((1 - s) * f / 8 + s * f, rel=1e-5)
    assert plain[30].item() == pytest.approx(f, rel=1e-6)
    # monotone: scaled frequencies never exceed the unscaled ones
    assert (got <= plain * (1 + 1e-6)).all()


def test_rope_table_and_buffer():
    table = precompute_rope(8, 5, 10000.0)
    assert table.shape == (5, 4, 2) and table.dtype == torch.float32
    assert torch.allclose(table[3, 1, 0], torch.tensor(math.cos(3 * 10000.0 ** (-2 / 8))))
    assert torch.allclose(table[3, 1, 1], torch.tensor(math.sin(3 * 10000.0 ** (-2 / 8))))
    model = Llama(tiny())
    assert "rope_cache" not in model.state_dict()
    assert model.rope_cache.shape == (64, 8, 2)


# -- attention, causality, forward -------------------------------------------------------------

def test_gqa_matches_reference_attention():
    torch.manual_seed(0)
    args = tiny(dim=64, n_heads=8, n_kv_heads=2)
    attn = Attention(args)
    B, T, H, K, hd = 2, 7, 8, 2, 8
    x = torch.randn(B, T, 64)
    rope = precompute_rope(hd, T, args.rope_theta)
    out = attn(x, rope)

    # Reference: Meta's complex-number RoPE, repeat_interleave K/V, explicit causal softmax.
    freqs = torch.outer(torch.arange(T).float(),
                        1.0 / args.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    cis = torch.polar(torch.ones_like(freqs), freqs)[None, :, None, :]

    def rot(t):
        c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(c * cis).flatten(3)

    q = rot((x @ attn.wq.weight.T).view(B, T, H, hd)).transpose(1, 2)
    k = rot((x @ attn.wk.weight.T).view(B, T, K, hd)).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(B, T, K, hd).transpose(1, 2)
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    mask = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
    ref = torch.softmax(scores + mask, dim=-1) @ v
    ref = ref.transpose(1, 2).reshape(B, T, H * hd) @ attn.wo.weight.T
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_fused_qkv_projection_and_head_major_rope_equal_the_plain_ones():
    """``project`` runs q, k, v as one matmul over the concatenated weights when all three are
    plain ``nn.Linear`` (issue 30): equal to three matmuls, gradients included, and a wrapped
    projection (a subclass, as LoRA/float8 modules are) takes the three-matmul path. RoPE on the
    head-major layout equals RoPE on ``[B, T, H, hd]`` transposed (to rounding: the complex
    multiply's vector lanes see another order)."""
    from torch import nn
    from llmforge.models.llama3.model import apply_rotary_emb

    torch.manual_seed(0)
    attn = Attention(tiny(dim=64, n_heads=8, n_kv_heads=2))
    x = torch.randn(2, 7, 64, requires_grad=True)
    fused = attn.project(x)
    plain = [(x @ w.weight.T).view(2, 7, -1, 8) for w in (attn.wq, attn.wk, attn.wv)]
    assert [t.shape for t in fused] == [(2, 7, 8, 8), (2, 7, 2, 8), (2, 7, 2, 8)]
    for got, want in zip(fused, plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad(sum(t.square().sum() for t in fused), [x, attn.wq.weight, attn.wv.weight])
    h = torch.autograd.grad(sum(t.square().sum() for t in plain), [x, attn.wq.weight, attn.wv.weight])
    for got, want in zip(g, h):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    class Wrapped(nn.Linear):
        def forward(self, t):
            return super().forward(t) * 2.0

    wrapped = Wrapped(64, 64, bias=False)
    wrapped.weight = attn.wq.weight
    attn.wq = wrapped
    torch.testing.assert_close(attn.project(x)[0], 2.0 * fused[0], rtol=1e-5, atol=1e-6)

    rope = precompute_rope(8, 7, 500000.0)
    q = torch.randn(2, 7, 8, 8)
    want = apply_rotary_emb(q, rope).transpose(1, 2)
    torch.testing.assert_close(apply_rotary_emb(q.transpose(1, 2), rope, heads_first=True), want,
                               rtol=1e-6, atol=1e-6)
    per_row = rope[None].expand(2, -1, -1, -1)  # [B, T, hd/2, 2]: per-row positions
    torch.testing.assert_close(apply_rotary_emb(q.transpose(1, 2), per_row, heads_first=True), want,
                               rtol=1e-6, atol=1e-6)


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    model = Llama(tiny()).eval()
    tokens = torch.randint(0, 97, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 97) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 97
    logits2 = model(changed)
    torch.testing.assert_close(logits[:, :5], logits2[:, :5])
    assert not torch.allclose(logits[:, 5:], logits2[:, 5:])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


# -- init, counts, flops -----------------------------------------------------------------------

def test_init_deterministic_and_meta_path_identical():
    torch.manual_seed(123)
    a = Llama(tiny())
    torch.manual_seed(123)
    b = Llama(tiny())
    torch.manual_seed(123)
    with torch.device("meta"):
        c = Llama(tiny())
    c.to_empty(device="cpu")
    c.init_weights()
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(),
                                  c.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, pc), name
    assert torch.equal(a.rope_cache, c.rope_cache)
    torch.manual_seed(124)
    d = Llama(tiny())
    assert not torch.equal(a.tok_embeddings.weight, d.tok_embeddings.weight)


def test_init_statistics():
    torch.manual_seed(0)
    args = tiny(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=1000)
    m = Llama(args)
    m.init_weights(std=0.05)
    assert m.tok_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert m.layers[0].attention.wq.weight.std().item() == pytest.approx(0.05, rel=0.05)
    out_std = 0.05 / math.sqrt(16)
    assert m.layers[0].attention.wo.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert m.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(out_std, rel=0.05)
    assert torch.equal(m.norm.weight, torch.ones(256))
    assert torch.equal(m.layers[3].ffn_norm.weight, torch.ones(256))


def test_num_params_and_flops_per_token():
    args = tiny()  # dim 64, 2 layers, 4 heads, 2 kv heads, vocab 97, multiple_of 32
    hidden = ffn_hidden_dim(64, 32, None)
    assert hidden == 192  # int(2*4*64/3) = 170 -> rounded up to 192
    hd = 16
    per_layer = 64 * 64 + 2 * 64 * (2 * hd) + 64 * 64 + 3 * 64 * hidden + 2 * 64
    total = 97 * 64 + 2 * per_layer + 64 + 64 * 97
    m = Llama(args)
    assert m.num_params() == total
    assert m.num_params(exclude_embeddings=True) == total - 97 * 64
    n = total - 97 * 64
    assert m.flops_per_token(32) == 6 * n + 12 * 2 * 4 * 16 * 32
    tied = Llama(tiny(tie_embeddings=True))
    # the tied output projection is still a matmul and is counted
    assert tied.flops_per_token(32) == m.flops_per_token(32)
    assert m.blocks() == list(m.layers) and len(m.blocks()) == 2


# -- sampling ----------------------------------------------------------------------------------

def test_generate_greedy_deterministic_and_eos():
    torch.manual_seed(0)
    model = Llama(tiny(max_seq_len=8))
    model.train()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # longer than max_seq_len: context is cropped
    out1 = generate(model, prompt, 6, temperature=0.0)
    out2 = generate(model, prompt, 6, temperature=0.0)
    assert out1 == out2 and len(out1) == 6
    assert model.training  # mode restored
    # greedy equals argmax of a manual forward
    logits = model.eval()(torch.tensor([prompt[-8:]]))
    assert out1[0] == int(logits[0, -1].argmax())
    # stops at eos (included in the output)
    assert generate(model, prompt, 6, temperature=0.0, eos_id=out1[2]) == out1[: out1.index(
        out1[2]) + 1]
    # sampling is reproducible with a generator
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    s1 = generate(model, [1, 2], 5, temperature=1.0, top_k=5, generator=g1)
    s2 = generate(model, [1, 2], 5, temperature=1.0, top_k=5, generator=g2)
    assert s1 == s2 and all(0 <= t < 97 for t in s1)
    assert generate(model, [1], 0) == []


@pytest.mark.parametrize("kwargs,name", [
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=0), "top_k"),
])
def test_generate_validates_arguments(kwargs, name):
    model = Llama(tiny())
    args = dict(prompt_ids=[1, 2], max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        generate(model, **args)


# -- config conversion and registry -----------------------------------------------------------

def test_llama_args_from_config_overrides():
    args = llama_args_from_config(ModelConfig(preset="llama3_8b", n_layers=2, dim=512,
                                              n_heads=8, rope_theta=10000.0))
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads) == (512, 2, 8, 8)
    assert args.rope_theta == 10000.0 and args.vocab_size == 128256
    assert args.rope_scaling["factor"] == 8.0  # null keeps the preset's scaling
    assert PRESETS["llama3_8b"].n_layers == 32  # preset not mutated
    assert llama_args_from_config(ModelConfig(preset="llama3_8b", rope_scaling={})).rope_scaling \
        is None
    debug = llama_args_from_config(ModelConfig())
    assert debug == dataclasses.replace(PRESETS["debug"])


def test_llama_args_from_omegaconf_and_no_preset():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.structured(ModelConfig(
        preset=None, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100,
        multiple_of=16, max_seq_len=32, tie_embeddings=True,
        rope_scaling={"factor": 4, "low_freq_factor": 1, "high_freq_factor": 4,
                      "original_max_position_embeddings": 16}))
    args = llama_args_from_config(cfg)
    assert type(args.rope_scaling) is dict and args.rope_scaling["factor"] == 4.0
    assert args.tie_embeddings and args.vocab_size == 100
    assert args.rope_theta == 500000.0 and args.ffn_dim_multiplier is None
    model = build_llama(cfg)
    assert model.vocab_size == 100 and model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("cfg,match", [
    (ModelConfig(preset="llama4"), r"model\.preset.*llama3_8b"),
    (ModelConfig(preset=None, dim=64, n_layers=2), r"model\.n_heads"),
    (ModelConfig(dim=100, n_heads=8), r"model\.dim \(100\).*model\.n_heads \(8\)"),
    (ModelConfig(n_heads=8, n_kv_heads=3), r"model\.n_heads \(8\).*model\.n_kv_heads \(3\)"),
    (ModelConfig(rope_scaling={"factor": 8}), r"model\.rope_scaling.*missing"),
    (ModelConfig(n_layers=0), r"model\.n_layers"),
    # absurd sizes: 10**300 blocks had never finished building, a width of 10**300 overflowed torch
    (ModelConfig(n_layers=10**300), r"model\.n_layers is a 301-digit number: llmforge builds at most 8,192"),
    (ModelConfig(dim=10**300), r"model\.dim is a 301-digit number: llmforge builds at most 16,777,216"),
    (ModelConfig(vocab_size=2**24 + 1), r"model\.vocab_size is 16,777,217: llmforge builds at most"),
    (ModelConfig(dim=-10**40), r"model\.dim must be a positive integer; got a negative 41-digit number"),
    # int() of 0.001 x the width: a SwiGLU of no units had built (torch warned of empty tensors)
    (ModelConfig(dim=64, n_heads=4, n_kv_heads=2, multiple_of=1, ffn_dim_multiplier=0.001),
     r"model\.ffn_dim_multiplier=0\.001 with model\.dim=64 gives a feed-forward width of 0; llmforge builds 1"),
    (ModelConfig(ffn_dim_multiplier=1e300), r"gives a feed-forward width of a 303-digit number; llmforge builds"),
    (ModelConfig(ffn_dim_multiplier=float("nan")), r"model\.ffn_dim_multiplier must be a positive finite number"),
])
def test_llama_args_from_config_errors(cfg, match):
    with pytest.raises(ConfigError, match=match):
        llama_args_from_config(cfg)


def test_registered_factory_builds_on_meta():
    spec = models.get("llama3")  # a ModelSpec: calling it builds, as a bare factory did
    assert spec.get("build") is build_llama and spec.name == "llama3"
    with torch.device("meta"):
        model = models.get("llama3")(ModelConfig(preset="llama3_70b"))
    assert model.num_params() == EXPECTED_PARAMS["llama3_70b"]
    assert model.vocab_size == 128256 and model.max_seq_len == 131072
    with pytest.raises(ConfigError, match="model.kwargs"):
        build_llama(ModelConfig(kwargs={"foo": 1}))
