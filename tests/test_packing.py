import numpy as np
import pytest
import torch

from llmforge.data.packing import PackedWindows, ShardedSampler, num_windows, pack_documents


def test_pack_adds_bos_eos_and_skips_empty():
    arr = pack_documents([[5, 6], [], [7]], bos_id=1, eos_id=2)
    assert arr.tolist() == [1, 5, 6, 2, 1, 7, 2]


def test_window_count_and_label_shift():
    tokens = np.arange(23, dtype=np.uint32)
    ds = PackedWindows(tokens, seq_len=4)  # windows of 5 tokens
    assert len(ds) == num_windows(23, 4) == 4
    w = ds[1]
    assert w.dtype == torch.long and w.tolist() == [5, 6, 7, 8, 9]
    inputs, labels = w[:-1], w[1:]
    assert inputs.tolist() == [5, 6, 7, 8] and labels.tolist() == [6, 7, 8, 9]
    with pytest.raises(IndexError):
        ds[4]  # tokens 20..22 do not fill a window: dropped


def take(it, n):
    return [next(it) for _ in range(n)]


def steps(sampler, n_steps):
    it = iter(sampler)
    return [take(it, sampler.local_batch) for _ in range(n_steps)]


def test_sampler_shards_are_disjoint_and_cover_epoch():
    samplers = [ShardedSampler(10, rank=r, world_size=3, seed=7) for r in range(3)]
    shards = [take(iter(s), 3) for s in samplers]
    flat = sum(shards, [])
    assert len(set(flat)) == 9 and set(flat) <= set(range(10))


def test_sampler_order_fixed_by_seed_and_epochs_differ():
    a = take(iter(ShardedSampler(50, seed=3)), 100)
    b = take(iter(ShardedSampler(50, seed=3)), 100)
    c = take(iter(ShardedSampler(50, seed=4)), 100)
    assert a == b and a != c
    assert sorted(a[:50]) == list(range(50)) and a[:50] != a[50:]


def test_global_batches_do_not_depend_on_world_size():
    one = steps(ShardedSampler(40, seed=1, local_batch=8), 12)  # crosses 2 epoch boundaries
    for world in (2, 4):
        per_rank = [steps(ShardedSampler(40, rank=r, world_size=world, seed=1, local_batch=8 // world), 12)
                    for r in range(world)]
        for s in range(12):
            assert sum((per_rank[r][s] for r in range(world)), []) == one[s]


def test_resume_with_another_world_size_sees_every_sample_once():
    """2 ranks for 3 steps, then 1 or 4 ranks: the union equals the uninterrupted run."""
    full = steps(ShardedSampler(64, seed=5, local_batch=8), 7)
    before = [i for r in range(2) for st in steps(ShardedSampler(64, r, 2, seed=5, local_batch=4), 3) for i in st]
    for world in (1, 4):
        after = [i for r in range(world)
                 for st in steps(ShardedSampler(64, r, world, seed=5, start_step=3, local_batch=8 // world), 4)
                 for i in st]
        assert sorted(before + after) == sorted(i for st in full for i in st)


def test_sampler_resume_mid_stream():
    full = take(iter(ShardedSampler(20, rank=1, world_size=2, seed=1, local_batch=3)), 30)
    resumed = take(iter(ShardedSampler(20, rank=1, world_size=2, seed=1, local_batch=3, start_step=4)), 18)
    assert resumed == full[12:]


def test_finite_sampler_in_order():
    s = ShardedSampler(7, rank=1, world_size=2, shuffle=False, infinite=False, local_batch=3)
    assert list(s) == [3, 4, 5] and len(s) == 3
