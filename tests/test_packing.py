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


def test_sampler_start_resumes_mid_stream():
    full = take(iter(ShardedSampler(20, rank=1, world_size=2, seed=1)), 25)
    resumed = take(iter(ShardedSampler(20, rank=1, world_size=2, seed=1, start=13)), 12)
    assert resumed == full[13:]


def test_finite_sampler_in_order():
    s = ShardedSampler(7, rank=0, world_size=2, shuffle=False, infinite=False)
    assert list(s) == [0, 2, 4] and len(s) == 3
