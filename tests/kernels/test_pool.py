"""kernels/pool.py: the KV pool record every reader takes, and the int8 format's one definition."""
from __future__ import annotations

import pytest
import torch

from kernels import pool as kv_pool
from kernels import reference, torch_paged


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("lazy", [False, True])
def test_allocate_lays_out_rows_and_scales_alike(head_major, lazy):
    p = kv_pool.allocate((5, 4, 2, 16), torch.int8, head_major=head_major, lazy=lazy)
    assert p.int8 and p.shape == (5, 4, 2, 16) and p.scales.shape == (5, 4, 2) and p.block_size == 4
    assert p.head_major() is head_major and torch_paged.head_major(p.data) is head_major
    assert [s * 16 for s in p.scales.stride()] == list(p.data.stride()[:3])     # a row's scale at its offset / D
    assert not p.data.any() and not p.scales.any()
    f = kv_pool.allocate((5, 4, 2, 16), torch.bfloat16, head_major=head_major, lazy=lazy)
    assert not f.int8 and f.scales is None and f.dtype == torch.bfloat16 and f.tensors() == (f.data,)


def test_an_int8_pool_carries_its_scales_and_only_it_does():
    with pytest.raises(ValueError, match="int8 KV pool carries its row scales"):
        kv_pool.KVPool(torch.zeros(2, 4, 2, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="only an int8 pool"):
        kv_pool.KVPool(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match="laid out as the pool"):   # head-major rows, token-major scales
        data = torch.zeros(2, 2, 4, 8, dtype=torch.int8).transpose(1, 2)
        kv_pool.KVPool(data, torch.zeros(2, 4, 2))
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, kv_heads, head_dim\]"):
        kv_pool.KVPool(torch.zeros(8, 8))
    with pytest.raises(ValueError, match="needs its row scales"):
        kv_pool.as_pool(torch.zeros(2, 4, 2, 8, dtype=torch.int8))
    t = torch.zeros(2, 4, 2, 8)
    assert kv_pool.as_pool(t).data is t and kv_pool.as_pool(kv_pool.as_pool(t)).data is t


def test_copy_blocks_moves_rows_with_their_scales():
    g = torch.Generator().manual_seed(0)
    p = kv_pool.from_rows(torch.randn(6, 4, 2, 8, generator=g))
    before = p.clone()
    p.copy_blocks(torch.tensor([1, 4]), torch.tensor([3, 0]))
    assert torch.equal(p.data[3], before.data[1]) and torch.equal(p.scales[3], before.scales[1])
    assert torch.equal(p.data[0], before.data[4]) and torch.equal(p.scales[0], before.scales[4])
    assert torch.equal(p.data[2], before.data[2]) and not p.equal(before)


def test_the_reference_writes_what_from_rows_holds():
    # The oracle's write and the tools' constructor store the same bytes: one format.
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6 * 4, 2, 8, generator=g)
    written = kv_pool.allocate((6, 4, 2, 8), torch.int8, head_major=True)
    other = kv_pool.allocate((6, 4, 2, 8), torch.int8, head_major=True)
    reference.write_kv(written, other, rows, rows, torch.arange(24))
    assert written.equal(kv_pool.from_rows(rows.view(6, 4, 2, 8), head_major=True))
    deq = kv_pool.dequantize_rows(written.data, written.scales).reshape(24, 2, 8)
    assert torch.equal(deq, kv_pool.as_stored(written, rows).float())
    assert (deq - rows).abs().max() <= rows.abs().amax(-1, keepdim=True).max() / 254 * (1 + 1e-6)
