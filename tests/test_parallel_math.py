"""FSDP2 reductions on 2 real processes (gloo) against one process: uneven target counts, global
gradient norm, clipping, tied embeddings, shard sizes; the docs' DTensor example (GradNoise) on
the sharded gradients. The worker is tests/dist/fsdp_worker.py."""

import json

import pytest
from helpers.dist import torchrun, worker
from helpers.docs_examples import grad_noise


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_math")
    proc = torchrun(worker("fsdp_worker.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_uneven_targets_give_single_process_gradients(reports, variant):
    r0, r1 = (r[variant] for r in reports)
    assert r0["n_targets"] == r1["n_targets"] == 18  # 2 on rank 0, 16 on rank 1, summed
    assert r0["loss_sum_local"] != r1["loss_sum_local"]
    for r in (r0, r1):
        assert r["ref_grad_max"] > 1e-3
        assert r["grad_diff"] <= 1e-6
        assert r["init_weight_diff"] == 0.0  # same full weights as one process


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_global_grad_norm_on_every_rank_and_clipping(reports, variant):
    for r in (x[variant] for x in reports):
        assert r["norm"] == pytest.approx(r["ref_norm"], abs=1e-5)
        assert r["update_diff_after_half_clip"] <= 1e-6


def test_tied_embeddings_stay_one_tensor(reports):
    assert all(r["tied"]["still_tied"] is True for r in reports)


@pytest.mark.parametrize("variant", ["untied", "tied"])
def test_sharded_bytes_are_half_and_match_the_plan(reports, variant):
    for r in (x[variant] for x in reports):
        half = r["full_param_bytes"] / 2
        assert abs(r["local_param_bytes"] - half) <= r["row_bytes_slack"]
        assert r["local_param_bytes"] == pytest.approx(r["estimated_param_bytes"], rel=0.02)


def test_docs_grad_noise_example_on_fsdp2_gradients(reports):
    """Issue 27.6: docs/algorithms/README.md's GradNoise runs on FSDP2's DTensor gradients: N(0,
    0.01^2) per element, other noise on each rank's shard, the same on both replicas of a
    replicated DTensor; a plain tensor mixed in fails as the docs say."""
    noise = [r["grad_noise"] for r in reports]
    for n in noise:
        assert n["all_dtensor"] is True
        assert "aten.add_.Tensor got mixed torch.Tensor and DTensor" in n["mixed_error"]  # the docs' words
        assert n["noise_std"] == pytest.approx(0.01, rel=0.03) and abs(n["noise_mean"]) < 5e-4
        assert n["replica_std"] == pytest.approx(0.01, rel=0.2)  # 128 elements
    assert noise[0]["shard_checksum"] != noise[1]["shard_checksum"]
    assert noise[0]["replica_checksum"] == noise[1]["replica_checksum"]


def test_docs_grad_noise_example_in_one_process():
    """The same example on plain tensors: N(0, std^2) per element, the same for the same step
    and parameter, another for another step."""
    from types import SimpleNamespace

    import torch

    doc = grad_noise()
    model = torch.nn.Linear(200, 100)
    noise = []
    for step in (1, 1, 2):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        doc.GradNoise(std=0.01).before_optimizer_step(SimpleNamespace(model=model, step=step))
        noise.append(model.weight.grad.clone())
    assert abs(noise[0].std().item() - 0.01) < 0.0005 and abs(noise[0].mean().item()) < 0.0005
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert doc.local_piece(model.weight)[1] == ()
