import math

import pytest
import torch

from llmforge.models.llama3.model import Llama, LlamaArgs
from llmforge.training.optim import build_optimizer, param_groups
from llmforge.training.schedule import build_scheduler, lr_multiplier


def lrs(name, max_steps=10, warmup=2, m=0.1, decay_fraction=0.5):
    return [lr_multiplier(s, name=name, max_steps=max_steps, warmup_steps=warmup, min_lr_ratio=m,
                          decay_fraction=decay_fraction) for s in range(max_steps)]


def test_warmup_is_linear_from_first_step():
    assert lrs("constant", warmup=4)[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_values():
    got = lrs("cosine")
    # p = (s - 2) / 8 for s >= 2
    want = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 8)) for s in range(2, 10)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[2] == 1.0 and got[6] == pytest.approx(0.55)


def test_linear_values():
    assert lrs("linear") == pytest.approx([0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125])


def test_wsd_stable_then_linear_decay_to_min():
    got = lrs("wsd", max_steps=10, warmup=2, m=0.1, decay_fraction=0.5)
    # 8 post-warmup steps, decay over the last 4: steps 6..9 -> 1-0.9*k/4 for k=1..4
    assert got == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1])


def test_unknown_schedule():
    with pytest.raises(ValueError, match="scheduler.name"):
        lr_multiplier(0, name="cosin", max_steps=10, warmup_steps=0)


def test_scheduler_steps_once_per_optimizer_step():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([p], lr=1.0)

    class C:
        name, warmup_steps, min_lr_ratio, decay_fraction = "linear", 2, 0.0, 0.2

    sched = build_scheduler(opt, C, max_steps=4)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.5])


def test_weight_decay_skips_norms_and_counts_tied_once():
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                     max_seq_len=16, tie_embeddings=True)
    model = Llama(args)
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    decay_ids = {id(p) for p in groups["decay"]["params"]}
    no_decay_ids = {id(p) for p in groups["no_decay"]["params"]}
    for name, p in model.named_parameters():
        if "norm" in name:
            assert id(p) in no_decay_ids and p.ndim == 1, name
        else:
            assert id(p) in decay_ids, name
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    n_listed = sum(p.numel() for g in groups.values() for p in g["params"])
    assert n_listed == model.num_params()
    # 2 blocks x 2 norms + final norm
    assert len(groups["no_decay"]["params"]) == 5


def test_frozen_parameters_left_out():
    model = torch.nn.Linear(4, 4)
    model.weight.requires_grad_(False)

    class C:
        name, lr, betas, eps, weight_decay = "adamw", 1e-3, [0.9, 0.95], 1e-8, 0.1

    opt = build_optimizer(model, C)
    assert [p for g in opt.param_groups for p in g["params"]] == [model.bias]


def test_adamw_kernels_by_implementation():
    """``optimizer.implementation``: ``auto`` is fused on the CPU (torch's kernel exists), the
    explicit values reach torch's flags, and every implementation gives the same update."""
    from omegaconf import OmegaConf

    from llmforge.config.schema import OptimizerConfig
    from llmforge.training.optim import kernel_flags

    w = [torch.nn.Parameter(torch.randn(4, 4))]
    assert kernel_flags(w, "auto") == {"fused": True}
    assert kernel_flags([torch.zeros(3, dtype=torch.int64)], "auto") == {}
    assert kernel_flags(w, "foreach") == {"foreach": True}
    assert kernel_flags(w, "for-loop") == {"foreach": False}
    weights = []
    for impl in ("auto", "fused", "foreach", "for-loop"):
        torch.manual_seed(0)
        model = Llama(LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64,
                                multiple_of=16, max_seq_len=16))
        cfg = OmegaConf.merge(OmegaConf.structured(OptimizerConfig), {"implementation": impl, "lr": 1e-2})
        opt = build_optimizer(model, cfg)
        assert opt.param_groups[0]["fused"] is (impl in ("auto", "fused") or None)
        for _ in range(3):
            model(torch.randint(0, 64, (2, 8))).square().mean().backward()
            opt.step()
            opt.zero_grad()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for got in weights[1:]:
        torch.testing.assert_close(got, weights[0], rtol=1e-5, atol=1e-6)


def test_warmup_from_zero_is_composers_warmup():
    """scheduler.warmup_from_zero: lr = peak * step / warmup (Composer's LinearScheduler inside
    its *_with_warmup schedulers), then the same decay as without it."""
    from llmforge.training.schedule import lr_multiplier

    kw = dict(name="cosine", max_steps=10, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_multiplier(s, warmup_from_zero=True, **kw) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [lr_multiplier(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(7, warmup_from_zero=True, **kw) == lr_multiplier(7, **kw)
