"""The event contract and the five event algorithms, with exact values (in-process, no trainer).

z-loss against a hand computation; the sequence length of every step of a warmup; EMA weights
against the closed form; the spike guard's decisions; chunked cross-entropy against the full
loss and gradients (1e-6, fp32), standalone and inside LLMModule.
"""

from __future__ import annotations

import math
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from algo_harness import batches, make_module
from llmforge.algorithms.loading import build_algorithms
from conftest import REPO
from llmforge.errors import ConfigError
from llmforge.events import Dispatcher, Event, State
from llmforge.plugin import CheckContext


# ------------------------------------------------------------------ dispatch
class Recorder:
    def __init__(self, name, order, log):
        self.name, self.order, self.log = name, order, log

    def after_loss(self, state):
        self.log.append(self.name)


def test_handlers_run_by_order_then_name_never_by_list_order():
    log: list[str] = []
    a, b, c = Recorder("b", 0, log), Recorder("a", 0, log), Recorder("z", -1, log)
    for plugins in ([a, b, c], [c, b, a], [b, c, a]):
        log.clear()
        Dispatcher(plugins)(Event.AFTER_LOSS, State())
        assert log == ["z", "a", "b"]
    d = Dispatcher([a, object()])
    assert d.has(Event.AFTER_LOSS) and not d.has(Event.BEFORE_FORWARD)


def test_module_runs_the_events_of_a_step_in_the_documented_order():
    module = make_module([])
    seen: list[str] = []

    class All:
        name = "all"

    for e in Event:
        setattr(All, e.value, lambda self, state, e=e: seen.append(e.value))
    module.setup_events([All()])
    module.forward_backward(batches(1, module.cfg.trainer.seq_len)[0])
    per_micro = ["before_forward", "after_forward", "before_loss", "after_loss", "before_backward",
                 "after_backward"]
    assert seen == ["batch_start", *per_micro, *per_micro]  # 2 micro-batches


def test_logits_are_released_before_backward():
    """``state.outputs`` is there in ``BEFORE_BACKWARD`` and gone while backward runs (the loss's
    graph keeps only what it saved), so the backward peak does not hold the logits twice."""
    module = make_module([])
    during: list = []
    seen: list = []

    class Look:
        name = "look"

        def before_backward(self, state):
            seen.append(state.outputs is not None)
            state.loss.register_hook(lambda g: during.append(state.outputs) or g)

    module.setup_events([Look()])
    module.forward_backward(batches(1, module.cfg.trainer.seq_len)[0])
    assert seen == [True, True] and during == [None, None]


def test_a_plugin_may_replace_the_batch_and_the_loss():
    module = make_module([])
    batch = batches(1, module.cfg.trainer.seq_len)[0]

    class Halve:
        name = "halve"

        def batch_start(self, state):
            state.batch = state.batch[:, :9]

        def before_loss(self, state):
            state.loss = torch.zeros((), requires_grad=True) + 7.0

    module.setup_events([Halve()])
    loss, n = module.forward_backward(batch)
    assert module.state.inputs.shape == (2, 8) and n.item() == 4 * 8
    assert loss.item() == 14.0  # two micro-batches, the replaced loss each
    assert module.step_tokens == 4 * 8


# ------------------------------------------------------------------ z_loss
def test_z_loss_term_equals_the_hand_computation_and_stays_out_of_eval():
    from llmforge.algorithms.z_loss import ZLoss

    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]], [[2.0, 2.0, 2.0], [0.0, 0.0, 9.0]]])
    labels = torch.tensor([[0, -100], [2, 1]])
    hand = 0.0
    for (b, t) in [(0, 0), (1, 0), (1, 1)]:
        lse = math.log(sum(math.exp(v) for v in logits[b, t].tolist()))
        hand += lse * lse
    algo = ZLoss(coef=0.5)
    st = State(outputs=logits, labels=labels, loss=torch.tensor(3.0), training=True,
               total_targets=torch.tensor(3.0), module=SimpleNamespace(dp_all_reduce=lambda t: t))
    algo.batch_start(st)
    algo.after_loss(st)
    assert st.loss.item() == pytest.approx(3.0 + 0.5 * hand, rel=1e-6)
    algo.before_optimizer_step(st)
    assert st.metrics["train/z_loss"].item() == pytest.approx(0.5 * hand / 3, rel=1e-6)
    st.training, st.loss = False, torch.tensor(3.0)
    algo.after_loss(st)
    assert st.loss.item() == 3.0  # eval/loss stays the pure cross-entropy
    with pytest.raises(ConfigError, match="z_loss.coef"):
        ZLoss(coef=float("nan"))


# --------------------------------------------------------- seq_length_warmup
def test_sequence_length_of_every_step_of_a_warmup():
    from llmforge.algorithms.seq_length_warmup import SeqLengthWarmup

    w = SeqLengthWarmup(duration=8, min_seq_len=16, step_size=8)
    assert [w.length(s, 64) for s in range(1, 12)] == [16, 16, 24, 32, 40, 40, 48, 56, 64, 64, 64]
    st = State(batch=torch.arange(4 * 65).view(4, 65), step=3)
    w.batch_start(st)
    assert st.batch.shape == (4, 25) and st.metrics["train/seq_len"] == 24
    sft = {"input_ids": torch.zeros(2, 64), "labels": torch.zeros(2, 64), "doc_ids": torch.zeros(2, 64)}
    st = State(batch=sft, step=1)
    w.batch_start(st)
    assert all(v.shape == (2, 16) for v in st.batch.values())
    with pytest.raises(ConfigError, match="min_seq_len=16 exceeds trainer.seq_len=8"):
        w.check(CheckContext(SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(seq_len=8))), []))


# ----------------------------------------------------------------------- ema
def test_ema_weights_after_k_steps_equal_the_closed_form():
    from llmforge.algorithms.ema import EMA

    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    model.register_parameter("frozen", frozen)
    w0 = model.weight.detach().clone()
    ema = EMA(decay=0.9)
    ema.attach(model)
    assert set(ema.shadow) == {"weight", "bias"}  # trainable weights only
    trajectory = [torch.full((2, 3), float(i)) for i in range(1, 6)]
    for w in trajectory:
        with torch.no_grad():
            model.weight.copy_(w)
        ema.after_optimizer_step(SimpleNamespace(skip_step=False))
    k, d = len(trajectory), 0.9
    closed = d**k * w0 + sum((1 - d) * d ** (k - i) * w for i, w in enumerate(trajectory, 1))
    torch.testing.assert_close(ema.shadow["weight"], closed, rtol=1e-6, atol=1e-6)
    before = ema.shadow["weight"].clone()
    ema.after_optimizer_step(SimpleNamespace(skip_step=True))  # a skipped step leaves it
    assert torch.equal(ema.shadow["weight"], before)
    ema.before_evaluation(None)
    torch.testing.assert_close(model.weight.detach(), closed)
    ema.after_evaluation(None)
    assert torch.equal(model.weight.detach(), trajectory[-1])  # training continues from raw weights


# ----------------------------------------------------------- loss_spike_guard
def test_spike_guard_skips_a_spike_and_stops_after_max_skips_in_a_row():
    from llmforge.algorithms.loss_spike_guard import LossSpikeGuard

    guard = LossSpikeGuard(factor=3.0, window=4, min_history=2, max_skips=2)

    def step(loss, norm, n):
        st = State(metrics={"train/loss": torch.tensor(loss)}, grad_norm=torch.tensor(norm), step=n)
        guard.before_optimizer_step(st)
        return st

    assert not step(2.0, 1.0, 1).skip_step and not step(2.2, 1.1, 2).skip_step
    spiked = step(9.0, 1.0, 3)
    assert spiked.skip_step and spiked.metrics["train/skipped_steps"] == 1
    assert list(guard.history["loss"]) == pytest.approx([2.0, 2.2])  # the spike never enters the median
    assert not step(2.1, 1.0, 4).skip_step
    assert step(2.0, 50.0, 5).skip_step  # a gradient-norm spike alone
    assert not step(2.0, 1.0, 6).skip_step and step(float("nan"), 1.0, 7).skip_step  # NaN spikes
    fresh = LossSpikeGuard(factor=3.0, window=4, min_history=1, max_skips=2)
    fresh.load_state_dict(guard.state_dict())
    assert fresh.state_dict() == guard.state_dict()
    guard2 = LossSpikeGuard(factor=3.0, window=4, min_history=1, max_skips=2)
    guard2.before_optimizer_step(State(metrics={"train/loss": torch.tensor(1.0)}, grad_norm=torch.tensor(1.0)))
    guard2.before_optimizer_step(State(metrics={"train/loss": torch.tensor(9.0)}, grad_norm=torch.tensor(1.0), step=2))
    with pytest.raises(Exception, match="2 steps in a row spiked") as info:
        guard2.before_optimizer_step(State(metrics={"train/loss": torch.tensor(9.0)}, grad_norm=torch.tensor(1.0), step=3))
    assert info.value.exit_code == 2
    with pytest.raises(ConfigError, match="loss_spike_guard.factor"):
        LossSpikeGuard(factor=1.0)


# ------------------------------------------------------- chunked_cross_entropy
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_cross_entropy_equals_the_full_loss_and_gradients(chunk):
    from llmforge.algorithms.chunked_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = (0.5 * torch.randn(2, 7, 16, generator=g)).requires_grad_()
    w = (0.5 * torch.randn(50, 16, generator=g)).requires_grad_()
    labels = torch.randint(0, 50, (2, 7), generator=g)
    labels[0, 2] = labels[1, 6] = -100
    full = F.cross_entropy((h @ w.t()).flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                           reduction="sum")
    scale = 1 / 12  # what the step multiplies by: 1 / target tokens
    gh, gw = torch.autograd.grad(scale * full, (h, w))
    ours, _ = linear_cross_entropy(h, w, None, labels, chunk)
    ch, cw = torch.autograd.grad(scale * ours, (h, w))
    torch.testing.assert_close(ours, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ch, gh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cw, gw, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, None, labels, chunk)[0], full.detach())


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_z_loss_inside_chunked_cross_entropy_equals_z_loss_on_the_full_logits(chunk):
    from llmforge.algorithms.chunked_cross_entropy import linear_cross_entropy
    from llmforge.algorithms.z_loss import z_loss_sum

    g = torch.Generator().manual_seed(1)
    h = (2.0 * torch.randn(2, 7, 16, generator=g)).requires_grad_()  # lse far from 0: a real z term
    w = (0.5 * torch.randn(50, 16, generator=g)).requires_grad_()
    b = (0.5 * torch.randn(50, generator=g)).requires_grad_()
    labels = torch.randint(0, 50, (2, 7), generator=g)
    labels[0, 2] = labels[1, 6] = -100
    coef, scale = 0.05, 1 / 12
    logits = h @ w.t() + b
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    z_full = z_loss_sum(logits, labels)
    full = ce + coef * z_full
    grads = torch.autograd.grad(scale * full, (h, w, b))
    ours, z = linear_cross_entropy(h, w, b, labels, chunk, z_coef=coef)
    assert (coef * z_full / ce).item() > 0.05  # the term is not negligible
    torch.testing.assert_close(ours, full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, z_full.detach(), rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(scale * ours, (h, w, b)), grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, b, labels, chunk, coef)[0], full.detach())


def test_z_loss_with_chunked_cross_entropy_in_the_module_equals_z_loss_alone():
    z = {"name": "z_loss", "coef": 0.01}
    plain = make_module([z])
    chunked = make_module([z, {"name": "chunked_cross_entropy", "chunk_size": 24}])
    chunked.model.load_state_dict(plain.model.state_dict())
    metrics = []
    for m in (plain, chunked):
        m.setup_events([a for a in build_algorithms(m.cfg)])
        m.event(Event.FIT_START)
        loss, n = m.forward_backward(batches(1, m.cfg.trainer.seq_len)[0])
        m.event(Event.BEFORE_OPTIMIZER_STEP)
        metrics.append((loss / n, m.state.metrics["train/z_loss"]))
    (la, za), (lb, zb) = metrics
    assert za.item() > 1e-3  # the term is there
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(zb, za, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(plain.model.named_parameters(), chunked.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    chunked.state.training = False  # evaluation: the pure cross-entropy, no z term
    with torch.no_grad():
        ev = chunked.step.micro_batch_loss(0, *chunked.split_batch(batches(1, 32)[0][:2]), None)
        plain.state.training = False
        ref = plain.step.micro_batch_loss(0, *plain.split_batch(batches(1, 32)[0][:2]), None)
    torch.testing.assert_close(ev, ref, rtol=1e-6, atol=1e-5)


def test_chunked_cross_entropy_inside_the_module_equals_the_plain_step():
    plain = make_module([])
    chunked = make_module([{"name": "chunked_cross_entropy", "chunk_size": 24}])
    from llmforge.algorithms.chunked_cross_entropy import ChunkedCrossEntropy, ChunkedLossHead

    assert type(chunked.model.output) is ChunkedLossHead
    chunked.model.load_state_dict(plain.model.state_dict())
    algo = ChunkedCrossEntropy(chunk_size=24)
    chunked.setup_events([algo])
    algo.fit_start(chunked.state)
    batch = batches(1, plain.cfg.trainer.seq_len)[0]
    la, na = plain.forward_backward(batch)
    lb, nb = chunked.forward_backward(batch)
    torch.testing.assert_close(lb, la, rtol=1e-6, atol=1e-5)
    for (name, p), q in zip(plain.model.named_parameters(), chunked.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert chunked.model(batch[:, :-1]).shape[-1] == 256  # without labels: plain logits
    with pytest.raises(ConfigError, match="strategy.tp=2"):
        algo.check(CheckContext(SimpleNamespace(dims=SimpleNamespace(tp=2)), []))


# ------------------------------------------------------------ LoRA is a plugin
def test_no_source_file_outside_the_lora_plugin_names_lora():
    files = subprocess.run(["git", "ls-files", "src"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    # the Foundry converter asks plugins (Algorithm.from_peft_config) instead of naming one
    offenders = [f for f in files if f.endswith(".py") and "/algorithms/" not in f
                 and re.search("lora", (REPO / f).read_text(encoding="utf-8"), re.IGNORECASE)]
    assert offenders == []


def test_built_in_plugins_act_on_events_not_on_lightning_hooks():
    """One bus: no built-in algorithm or callback overrides a Lightning hook (the bridge,
    llmforge.training.bridge, turns Lightning's loop into events), except the one documented
    in docs/algorithms/README.md: the checkpointer's ``setup`` (Lightning installs its SIGTERM
    handler during fit, before any event)."""
    from lightning.pytorch.callbacks import Callback

    import llmforge.callbacks as callbacks
    from llmforge import registry
    from llmforge.data.mixture import MixtureTokens
    from llmforge.job.tracker import RunTracker

    hooks = {n for n in vars(Callback) if n.startswith("on_") or n in ("setup", "teardown")}
    classes = [getattr(callbacks, n) for n in callbacks.__all__] + [MixtureTokens, RunTracker]
    classes += [registry.algorithms.get(n) for n in registry.algorithms.names()]
    overridden = {}
    for cls in classes:
        own = {n for c in cls.__mro__ if c.__module__.startswith("llmforge.") for n in vars(c)} & hooks
        if own:
            overridden[cls.__name__] = sorted(own)
    assert overridden == {"Checkpointer": ["setup"]}
    assert len(classes) > 20
