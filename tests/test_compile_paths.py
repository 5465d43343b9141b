"""What ``compile`` traces (issue 50): Qwen3-MoE compiles in one graph (the expert loop is one
custom operator), Llama's RoPE is real-valued under compile (inductor has no code for complex
operators), and the run says on stderr that the first step waits for the compilation.

The graphs are traced with cheap backends (``aot_eager``, or a backend that only records the
FX graph): the point is what dynamo and AOT autograd see, not inductor's C++ code."""

import pytest
import torch

from algo_harness import make_module
from helpers.moe import moe_module
from llmforge.algorithms.compile import Compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def test_qwen3_moe_compiles_in_one_graph_with_the_eager_loss_and_gradients():
    eager, compiled = moe_module(), moe_module()
    compiled.model.load_state_dict(eager.model.state_dict())
    Compile(backend="aot_eager").apply(compiled.model, None)  # whole model, fullgraph
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for module in (eager, compiled):
        loss, n = module.forward_backward(tokens)
        results.append((loss / n, {k: p.grad for k, p in module.model.named_parameters()}))
    (a, ga), (b, gb) = results
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert b.item() == pytest.approx(a.item(), abs=1e-6)
    assert ga.keys() == gb.keys() and any("experts.w1" in k for k in ga)
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], atol=1e-5, rtol=1e-4, msg=k)
