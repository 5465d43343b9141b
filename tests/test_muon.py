"""optimizer.name: muon — Newton-Schulz against a reference, the parameter split, the combined step
against torch's own Muon and AdamW, the state through a DCP checkpoint, a short training run, a
Qwen3-MoE's expert matrices each orthogonalized on its own (their sharding under expert
parallelism: tests/test_expert_parallel.py), and FSDP2, HSDP and tensor parallel on 4 real processes (tests/dist/muon_worker.py) against one
process, and the 4-process FSDP2 checkpoint resumed in one process."""

import importlib.util
import json

import pytest
import torch
from conftest import DEMO, TINY_OVERRIDES
from helpers.dist import torchrun, worker

from llmforge.checkpoint.dcp import load_training_state, save_checkpoint
from llmforge.cli import main
from llmforge.config.validate import plan_batch
from llmforge.training.module import LLMModule
from llmforge.models.llama3.model import Llama, LlamaArgs
from llmforge.models.qwen3_moe.config import Qwen3MoeArgs
from llmforge.models.qwen3_moe.model import Qwen3Moe
from llmforge.training.muon import MuonAdamW, match_rms_adamw_scale, newton_schulz
from llmforge.training.optim import build_optimizer, muon_param_groups



def _load(path: str):
    spec = importlib.util.spec_from_file_location("muon_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _load(worker("muon_worker.py"))  # its config and batches, for the 2 -> 1 process resume


class Cfg:
    name, lr, betas, eps, weight_decay = "muon", 1e-2, (0.9, 0.95), 1e-8, 0.1
    muon_lr, muon_momentum, muon_nesterov, muon_ns_steps = 2e-2, 0.95, True, 5
    muon_ns_dtype = "bfloat16"  # torch.optim.Muon's, for the comparisons with it


def reference_ns(g, steps=5, a=3.4445, b=-4.7750, c=2.0315, clamp=False):
    """Keller Jordan's zeropower_via_newtonschulz5 (github.com/KellerJordan/Muon), in float32
    (``clamp``: the norm floored at 1e-7 as torch.optim.Muon does, rather than 1e-7 added, which
    matters for a small gradient)."""
    x = g.float()
    if g.size(0) > g.size(1):
        x = x.T
    x = x / (x.norm().clamp(min=1e-7) if clamp else x.norm() + 1e-7)
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if g.size(0) > g.size(1) else x


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64)])
def test_newton_schulz_equals_reference(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    got = newton_schulz(g, dtype=torch.float32)
    assert (got - reference_ns(g)).abs().max().item() < 1e-5
    s = torch.linalg.svdvals(got)
    # the quintic is tuned to push singular values into about [0.7, 1.2] (a random square matrix
    # keeps its very smallest ones small after 5 steps), never above
    assert s.max() < 1.3 and 0.7 < s.median() < 1.2


def test_bf16_newton_schulz_is_torch_muons_update():
    g = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    p = torch.nn.Parameter(torch.zeros(40, 24))
    p.grad = g.clone()
    torch.optim.Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0, adjust_lr_fn="match_rms_adamw").step()
    want = -match_rms_adamw_scale((40, 24)) * newton_schulz(g).float()
    assert torch.equal(p.detach(), want)


def tiny(tie=False, seed=0):
    torch.manual_seed(seed)
    m = Llama(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                        max_seq_len=16, tie_embeddings=tie))
    m.init_weights()
    return m


@pytest.mark.parametrize("tie", [False, True])
def test_hidden_matrices_to_muon_rest_to_adamw(tie):
    m = tiny(tie)
    opt = build_optimizer(m, Cfg)
    names = {id(p): n for n, p in m.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    assert [g["lr"] for g in opt.param_groups] == [2e-2, 1e-2, 1e-2]
    assert len(groups["muon"]) == 14 and all(".attention.w" in n or ".feed_forward.w" in n for n in groups["muon"])
    assert groups["decay"] == (["tok_embeddings.weight"] if tie else ["output.weight", "tok_embeddings.weight"])
    assert len(groups["no_decay"]) == 5  # 2 norms per block + the final norm


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)


def step(model, opt, seed):
    x, y = batch(seed)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def test_step_is_torch_muon_plus_torch_adamw():
    a, b = tiny(), tiny()
    opt = build_optimizer(a, Cfg)
    (mg,), adamw_groups = [opt.param_groups[0]], opt.param_groups[1:]
    idx = {id(p): i for i, p in enumerate(a.parameters())}
    bp = list(b.parameters())
    muon = torch.optim.Muon([bp[idx[id(p)]] for p in mg["params"]], lr=2e-2, weight_decay=0.1,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [bp[idx[id(p)]] for p in g["params"]],
                                "weight_decay": g["weight_decay"]} for g in adamw_groups],
                              lr=1e-2, betas=(0.9, 0.95), eps=1e-8)

    class Both:
        def step(self):
            muon.step(), adamw.step()

        def zero_grad(self, set_to_none):
            muon.zero_grad(set_to_none), adamw.zero_grad(set_to_none)

    for s in range(3):
        assert step(a, opt, s) == step(b, Both(), s)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_float32_step_is_the_same_update_with_float32_newton_schulz():
    m = tiny()
    opt = build_optimizer(m, type("C", (Cfg,), {"muon_ns_dtype": None}), precision="fp32")
    assert opt.ns_dtype == torch.float32
    p = opt.param_groups[0]["params"][0]
    before = p.detach().clone()
    x, y = batch(0)
    torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    g = p.grad.clone()
    opt.step()
    # first step: the momentum buffer is (1 - 0.95) g, the Nesterov update g.lerp(buf, 0.95)
    buf = torch.zeros_like(g).lerp_(g, 0.05)
    want = before.mul_(1 - 2e-2 * 0.1).add_(newton_schulz(g.lerp(buf, 0.95), dtype=torch.float32),
                                            alpha=-2e-2 * match_rms_adamw_scale(g.shape))
    assert torch.equal(p.detach(), want)


def test_checkpoint_round_trip_continues_bit_exact(tmp_path):
    a = tiny()
    opt = build_optimizer(a, Cfg)
    for s in range(2):
        step(a, opt, s)
    sd = opt.state_dict()["state"]
    assert set(sd[0]) == {"momentum_buffer"}  # the first group is Muon's
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(sd[14])
    save_checkpoint(tmp_path, 2, a, opt, {"step": 2}, {})  # torch.distributed.checkpoint, as training does
    b = tiny(seed=1)
    opt_b = build_optimizer(b, Cfg)
    load_training_state(tmp_path / "step_00000002", b, opt_b)
    assert [step(a, opt, s) for s in (2, 3)] == [step(b, opt_b, s) for s in (2, 3)]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_muon_lowers_the_loss():
    m = tiny()
    opt = MuonAdamW(*muon_param_groups(m, Cfg))
    losses = [step(m, opt, 0) for _ in range(15)]  # one batch, memorized
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("override, message", [
    ("optimizer.muon_momentum=1.5", "optimizer.muon_momentum must be in [0, 1), e.g. 0.95, got 1.5"),
    ("optimizer.muon_ns_dtype=fp16", "optimizer.muon_ns_dtype must be bfloat16, float32 or null, got 'fp16'")])
def test_bad_muon_key_is_one_error_line(capsys, tmp_path, override, message):
    rc = main(["train", DEMO, *TINY_OVERRIDES, f"run.output_dir={tmp_path}", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"error: {message}"]
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def sharded_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_sharded")
    proc = torchrun(worker("muon_worker.py"), str(out), nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for rep in reports:
        rep["ckpt"] = str(out / "ckpt")
    return reports


def test_fsdp2_on_four_and_two_processes_give_one_process_losses(sharded_reports):
    for rank, rep in enumerate(sharded_reports):
        # random labels: the loss wanders rather than falls, but the weights move every step
        assert len(rep["ref_losses"]) == 10 and len(set(rep["ref_losses"])) == 10
        for name, calls in (("fsdp4", 40 if rank < 2 else 30), ("hsdp", 140)):
            got = rep[name]
            assert got["losses"] == pytest.approx(rep["ref_losses"], abs=1e-5), name
            # 14 block matrices, embeddings, output, norms
            assert len(got["weight_diff"]) == 21 and max(got["weight_diff"].values()) < 1e-5, got["weight_diff"]
            # fsdp4: 14 matrices dealt round-robin (i % 4) over a 1-D mesh, 10 steps; HSDP's mesh is
            # 2-D (replicate x shard): every rank orthogonalizes every matrix
            assert got["newton_schulz_calls"] == calls, name


def test_a_four_process_fsdp2_checkpoint_resumes_on_one_process(sharded_reports, tmp_path_factory):
    cfg = W.make_cfg()
    cfg.strategy.name = "auto"
    mod = LLMModule(cfg, plan_batch(cfg, 1))
    mod.configure_model()
    opt = build_optimizer(mod.model, cfg.optimizer)
    load_training_state(sharded_reports[0]["ckpt"] + f"/step_{W.STEPS:08d}", mod.model, opt)
    for (tokens, labels), want in zip(W.make_batches()[W.STEPS:], sharded_reports[0]["ref_more"]):
        loss, n = mod.forward_backward({"input_ids": tokens, "labels": labels})
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert (loss / n).item() == pytest.approx(want, abs=1e-5)


def test_tensor_parallel_two_gives_one_process_losses(sharded_reports):
    # TP splits the matmuls' sums, so gradients differ from one process by ~1e-7; Newton-Schulz
    # in float32 (fp32 runs) keeps that at ~1e-7 (bf16 rounding flips grew it to 3e-5 in 6 steps)
    for rep in sharded_reports:
        got = rep["tp2"]
        assert got["losses"] == pytest.approx(rep["ref_losses"], abs=1e-5)
        assert got["newton_schulz_calls"] == 140  # a 2-D mesh (dp_shard x tp): every matrix
        assert max(got["weight_diff"].values()) < 1e-5, got["weight_diff"]


def tiny_moe(seed=0):
    """Qwen3-MoE with a sparse layer 0 (4 experts, [E, 24, 32] and [E, 32, 24] stacks) and a dense
    layer 1."""
    torch.manual_seed(seed)
    return Qwen3Moe(Qwen3MoeArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64,
                                 vocab_size=64, max_seq_len=16, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=24, mlp_only_layers=[1]))


F32 = type("C", (Cfg,), {"muon_ns_dtype": "float32"})


def test_expert_matrices_take_muon_and_its_decoupled_decay():
    """One step with loss x 0 (zero gradients): every Muon tensor, the expert stacks included, is
    w (1 - muon_lr wd), every AdamW matrix w (1 - lr wd), norms unchanged; the groups hold
    what docs/optimizers.md says."""
    m = tiny_moe()
    opt = build_optimizer(m, F32)
    names = {id(p): n for n, p in m.named_parameters()}
    groups = {g["name"]: sorted(names[id(p)] for p in g["params"]) for g in opt.param_groups}
    assert list(groups) == ["muon", "muon_experts", "decay", "no_decay"]
    assert groups["muon_experts"] == [f"layers.0.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]
    assert "layers.0.feed_forward.router.weight" in groups["muon"]  # a 2-D hidden matrix
    assert len(groups["muon"]) == 2 * 4 + 1 + 3  # wq wk wv wo x 2, router, dense SwiGLU
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    x, _ = batch(0)
    (m(x).sum() * 0).backward()
    opt.step()
    decay = {"muon": 1 - 2e-2 * 0.1, "muon_experts": 1 - 2e-2 * 0.1, "decay": 1 - 1e-2 * 0.1, "no_decay": 1.0}
    for g in opt.param_groups:
        for p in g["params"]:
            assert p.grad is not None and not p.grad.any()
            assert torch.equal(p.detach(), before[names[id(p)]] * decay[g["name"]]), names[id(p)]


def test_each_expert_update_is_the_orthogonalization_of_its_own_momentum():
    """A real gradient: expert e's step is -lr 0.2 sqrt(max(out, in)) NS(its Nesterov momentum
    [out, in]) after the decay, NS being Keller Jordan's reference on that one matrix."""
    m = tiny_moe()
    opt = build_optimizer(m, F32)
    stacks = opt.param_groups[1]["params"]
    before = [p.detach().clone() for p in stacks]
    x, y = batch(0)
    torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    grads = [p.grad.clone() for p in stacks]
    opt.step()
    for p, w, g in zip(stacks, before, grads):
        assert g.ndim == 3 and all(g[e].abs().sum() > 0 for e in range(4))  # every expert got tokens
        scale = 0.2 * max(g.shape[1:]) ** 0.5
        update = g.lerp(torch.zeros_like(g).lerp_(g, 0.05), 0.95)  # first step's Nesterov momentum
        want = torch.stack([w[e] * (1 - 2e-2 * 0.1) - 2e-2 * scale * reference_ns(update[e], clamp=True)
                             for e in range(4)])
        assert (p.detach() - want).abs().max().item() < 1e-6
        # not the whole stack's (or a flattened matrix's) orthogonalization: each expert alone
        svals = torch.linalg.svdvals((w * (1 - 2e-3) - p.detach()) / (2e-2 * scale))
        assert (svals.max(dim=-1).values < 1.3).all() and (svals.median(dim=-1).values > 0.7).all()


def test_batched_newton_schulz_is_each_matrix_alone():
    g = torch.randn(3, 40, 24, generator=torch.Generator().manual_seed(2))
    got = newton_schulz(g, dtype=torch.float32)
    for e in range(3):
        assert (got[e] - newton_schulz(g[e], dtype=torch.float32)).abs().max().item() < 1e-6
    assert newton_schulz(g, dtype=torch.bfloat16).shape == (3, 40, 24)


def test_a_layout_that_splits_expert_matrices_is_refused_naming_the_key(tmp_path):
    """Expert tensor parallelism (an expert matrix sharded on one of its own dims) leaves no whole
    matrix on a rank: building the optimizer says so, naming optimizer.name and the parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from llmforge.errors import ConfigError

    m = tiny_moe()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        experts = m.layers[0].feed_forward.experts
        w2 = experts.w2.detach()
        experts.w2 = torch.nn.Parameter(distribute_tensor(w2, init_device_mesh("cpu", (1,)), [Shard(2)]))
        with pytest.raises(ConfigError) as err:
            build_optimizer(m, F32)
        assert str(err.value) == (
            "optimizer.name: muon orthogonalizes each expert matrix of layers.0.feed_forward.experts.w2 "
            "(4, 32, 24) on the rank that holds it, but its placements (Shard(dim=2),) split the matrices "
            "(dim 2); use optimizer.name=adamw, or a layout that keeps expert matrices whole")
    finally:
        dist.destroy_process_group()
