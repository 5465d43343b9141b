"""FSDP2 reductions on 2 real processes (gloo) against one process: uneven target counts, global
gradient norm, clipping, tied embeddings, shard sizes. The worker is tests/dist/fsdp_worker.py."""

import json

import pytest
from helpers.dist import torchrun, worker


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
