"""What ``compile`` traces (issue 50): Qwen3-MoE compiles in one graph (the expert loop is one
custom operator), Llama's RoPE is real-valued under compile (inductor has no code for complex
operators), and the run says on stderr that the first step waits for the compilation.

The graphs are traced with cheap backends (``aot_eager``, or a backend that only records the
FX graph): the point is what dynamo and AOT autograd see, not inductor's C++ code."""

from types import SimpleNamespace

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


def graph_targets(graphs) -> set:
    """Every ``call_function`` target in the recorded dynamo graphs and their subgraphs (the
    checkpointed blocks are higher-order-op bodies)."""
    return {n.target for gm in graphs for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("algorithms", [[], [{"name": "float8"}, {"name": "activation_checkpointing"}]],
                         ids=["plain", "float8+full AC"])
def test_llama_under_compile_has_no_complex_op_and_one_graph(algorithms):
    """The slow float8 + full checkpointing + compile of issue 50: one graph, no graph break, no
    recompile, and no complex operator (inductor cannot generate code for them)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager, compiled = make_module(algorithms), make_module(algorithms)
    compiled.model.load_state_dict(eager.model.state_dict())
    Compile(backend=record).apply(compiled.model, None)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    want = eager.model(tokens)
    for _ in range(2):
        got = compiled.model(tokens)
        got.float().mean().backward()
    counters = torch._dynamo.utils.counters
    assert len(graphs) == 1 and not counters["graph_break"] and not counters["recompiles"]
    targets = graph_targets(graphs)
    assert torch.view_as_complex not in targets and torch.view_as_real not in targets
    assert torch.stack in targets  # the real-valued rotation (rotate_pairs) was traced instead
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_compile_says_at_fit_start_that_the_first_step_waits(capsys):
    algo = Compile()
    module = make_module([])
    algo.apply(module.model, None)
    trainer = SimpleNamespace(precision="32-true", is_global_zero=True)
    algo.fit_start(SimpleNamespace(module=module, trainer=trainer))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["compile: torch.compile (inductor) of the whole model runs in the first "
                   "forward; the first step (and an evaluation before it) waits for it"]
