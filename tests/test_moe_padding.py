"""Router statistics without padding: on right-padded SFT rows (``token_mask``) the Qwen3-MoE
load-balancing loss is transformers' masked formulation, the z-loss and the loss-free balancing
bias follow the real tokens, and padding takes no expert capacity. (Pipeline stages and expert
parallelism on padded rows: tests/test_pipeline.py, tests/test_expert_parallel.py.)"""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from helpers.moe import moe_module  # noqa: E402
from llmforge.models.qwen3_moe.moe import MoE  # noqa: E402


def test_router_statistics_leave_padding_out():
    """Right-padded SFT rows (``token_mask`` False on padding): the optimized loss is cross-entropy
    + transformers' masked load-balancing loss (``load_balancing_loss_func`` with the mask as
    ``attention_mask``) + the z-loss over the real tokens, and after the step the balancing bias
    moved by the real tokens' load; both recomputed from the step's router logits."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    module = moe_module(router_aux_loss_coef=0.3, router_z_loss_coef=0.01, router_bias_update_rate=0.1)
    real = torch.tensor([[True] * 5 + [False] * 3, [True] * 2 + [False] * 6])
    ids = torch.where(real, torch.randint(3, 50, (2, 8)), 0)  # padding: id 0, label -100
    labels = torch.where(real, torch.randint(0, 50, (2, 8)), -100)
    logits = []
    layers = [m for _, m in module.model.moe_layers()]
    hooks = [m.router.register_forward_hook(lambda _m, _i, out: logits.append(out.detach())) for m in layers]
    loss_sum, n = module.forward_backward({"input_ids": ids, "labels": labels, "token_mask": real})
    for h in hooks:
        h.remove()
    module.model.eval()  # a forward that counts no load, before the bias moves
    with torch.no_grad():
        ce = F.cross_entropy(module.model(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    module.step.model_after_optimizer_step()
    assert len(logits) == 2 and logits[0].shape == (16, 4)
    mask = real.reshape(-1)
    lb = 0.3 * load_balancing_loss_func(tuple(logits), 4, 2, attention_mask=real)
    lb_all = 0.3 * load_balancing_loss_func(tuple(logits), 4, 2)  # what padding made it before
    z = 0.01 * sum((torch.logsumexp(g, -1) ** 2)[mask].sum() for g in logits) / (2 * mask.sum())
    assert abs(loss_sum.item() / n.item() - (ce + lb + z).item()) < 1e-6
    aux = module.step.aux_step_metrics(n.float())
    assert aux["train/aux/load_balancing"].item() == pytest.approx(lb.item(), abs=1e-6)
    assert aux["train/aux/router_z"].item() == pytest.approx(z.item(), abs=1e-7)
    assert abs(lb - lb_all) > 1e-3  # the padding would change the loss
    moved_differently = False
    for m, g in zip(layers, logits):  # DeepSeek-V3's rule on the real tokens' top-2 load
        top = torch.topk(F.softmax(g.float(), -1), 2).indices  # bias 0 before the first step
        load = torch.zeros(4).index_add_(0, top[mask].reshape(-1), torch.ones(2 * int(mask.sum())))
        assert m.expert_bias.tolist() == (0.1 * torch.sign(load.mean() - load)).tolist()
        load_all = torch.zeros(4).index_add_(0, top.reshape(-1), torch.ones(32))
        moved_differently |= not torch.equal(torch.sign(load.mean() - load), torch.sign(load_all.mean() - load_all))
    assert moved_differently  # counted with padding, the bias would have moved otherwise


def test_padding_takes_no_expert_capacity():
    """Padding is not routed: it takes no capacity (computed from the real tokens), counts in no
    drop and its output is 0."""
    torch.manual_seed(0)
    moe = MoE(dim=32, hidden_dim=16, num_experts=4, top_k=1, capacity_factor=2.0)
    moe.init_weights(0.15, 0.15)
    with torch.no_grad():  # every token to expert 0: capacity ceil(2.0 * 4 real / 4) = 2
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
    x = torch.rand(1, 8, 32) + 0.1
    y = moe(x, token_mask=torch.tensor([[False, True, False, True, True, False, True, False]]))
    assert moe.stats.tokens == 4 and moe.stats.counts.tolist() == [4.0, 0.0, 0.0, 0.0]
    assert int(moe.stats.dropped) == 2  # real tokens 3 and 4 kept (earliest first), 6 and 7 not
    assert y[0, [0, 2, 5, 6, 7]].abs().max() == 0 and y[0, [1, 3]].abs().min() > 0
