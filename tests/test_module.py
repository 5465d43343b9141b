"""Gradient accumulation: normalized by the target tokens of the whole window."""

import torch
from omegaconf import OmegaConf

from llmforge.config.schema import TrainConfig
from llmforge.config.validate import plan_batch
from llmforge.events import IGNORE_INDEX
from llmforge.training.module import LLMModule


def make_module(micro, global_):
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model.merge_with({"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 50,
                          "multiple_of": 16, "max_seq_len": 16})
    cfg.trainer.merge_with({"micro_batch_size": micro, "global_batch_size": global_, "seq_len": 8})
    module = LLMModule(cfg, plan_batch(cfg, 1))
    module.configure_model()
    return module


def grads(module):
    return {n: p.grad.clone() for n, p in module.model.named_parameters()}


def test_accumulation_equals_one_big_batch_with_uneven_targets():
    torch.manual_seed(0)
    batch = torch.randint(0, 50, (4, 9))
    # mask many targets in the first micro-batch only: micro-batches have unequal target counts
    masked = batch.clone()
    masked[:2, 1:7] = IGNORE_INDEX  # labels are batch[:, 1:]; inputs keep real ids below
    inputs_ok = batch[:, :-1]

    acc = make_module(micro=2, global_=4)
    big = make_module(micro=4, global_=4)
    assert acc.plan.gradient_accumulation_steps == 2 and big.plan.gradient_accumulation_steps == 1
    big.model.load_state_dict(acc.model.state_dict())

    def run(module):
        return module.forward_backward({"input_ids": inputs_ok, "labels": masked[:, 1:]})

    loss_a, n_a = run(acc)
    loss_b, n_b = run(big)
    assert n_a.item() == n_b.item() == 4 * 8 - 2 * 6
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-5)
    ga, gb = grads(acc), grads(big)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-6, msg=name)

    # reference: mean cross-entropy over all real targets, computed by hand
    ref = make_module(micro=4, global_=4)
    ref.model.load_state_dict(acc.model.state_dict())
    logits = ref.model(inputs_ok)
    labels = masked[:, 1:]
    keep = labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    loss.backward()
    for name, p in ref.model.named_parameters():
        torch.testing.assert_close(ga[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_meta_build_is_deterministic_under_seed():
    a, b = make_module(2, 2), make_module(2, 2)
    for (n, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(pa, pb), n
    assert not any(p.is_meta for p in a.model.parameters())


def test_evaluate_gives_every_submodule_its_own_mode_back():
    """A submodule held in eval mode (frozen, dropout fixed) stays so; the rest trains again."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    module = make_module(2, 2)
    batches = [torch.randint(0, 50, (2, 9))]
    loader = SimpleNamespace(eval_dataloader=lambda: batches)
    module._trainer = SimpleNamespace(datamodule=loader, strategy=None,
                                      precision_plugin=SimpleNamespace(forward_context=nullcontext))
    module.model.train()
    held = module.model.layers[0].attention
    held.eval()
    seen = []
    hook = module.model.register_forward_pre_hook(lambda m, a: seen.append(
        [x.training for x in m.modules()]))
    out = module.evaluate()
    hook.remove()
    assert out is not None and out["eval/loss"] > 0
    assert seen and not any(seen[0])  # everything in eval mode during the evaluation
    assert not held.training and not any(m.training for m in held.modules())
    others = [m for m in module.model.modules() if not any(m is h for h in held.modules())]
    assert others and all(m.training for m in others)
