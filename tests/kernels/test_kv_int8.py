"""The int8 KV cache's kernels (option.kv_cache_dtype=int8): the row quantizer (kernels/cpu_kv.c
lmi_write_kv_i8 against kernels/pool.py quantize_rows, the format's one definition, byte for byte), the decode attention reading
int8 rows and their scales in place (kernels/cpu_decode.c) against the float64 naive loop over the
dequantized pool, and the torch reference path over the same pools; on every build this CPU runs.

Tolerances: over the dequantized values the kernel is an fp32 computation (rel_err <= 1e-5, as the
fp32/bf16 pools' test); against the unquantized pool the int8 rounding (half a step of max|row| / 127
per element) moves these attention outputs (unit-variance keys, logits of std ~3) by under 1e-1
(measured up to ~5e-2)."""
from __future__ import annotations

import random

import pytest
import torch

import kernels
from kernels import cpu as cpu_ext, pool as kv_pool, reference, torch_paged
from kernels.selfcheck import make_case
from tests.support.kernels import _head_major, each_build_fixture, naive_attention, rel_err

each_build = each_build_fixture()


def _int8_pool(cache: torch.Tensor, head: bool) -> kv_pool.KVPool:
    """A float pool [NB, bs, Hkv, D] as an int8 pool (rows quantized with their scales) in the
    token-major or head-major layout."""
    return kv_pool.from_rows(cache, head_major=head)


def _dequantized(pool: kv_pool.KVPool) -> torch.Tensor:
    return kv_pool.dequantize_rows(pool.data, pool.scales)


def test_quantize_rows_is_symmetric_per_row_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g, dtype=torch.float64) * torch.rand(50, 3, 1, generator=g, dtype=torch.float64) * 10
    x[7, 1] = 0.0                                   # a zero row: zero bytes, zero scale
    q, sc = kv_pool.quantize_rows(x.float())
    assert q.dtype == torch.int8 and sc.dtype == torch.float32 and q.shape == x.shape and sc.shape == x.shape[:2]
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    amax = x.float().abs().amax(-1).double()
    assert torch.allclose(sc.double(), amax / 127, rtol=1e-6, atol=0)
    step = sc.double()[..., None]
    err = (kv_pool.dequantize_rows(q, sc).double() - x.float().double()).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(q[7, 1], torch.zeros(64, dtype=torch.int8)) and sc[7, 1] == 0


@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head", [False, True])
def test_kernel_write_stores_the_reference_bytes_and_scales(each_build, src, head):
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d, t = 9, 4, 2, 80, 23
    pools = [_int8_pool(torch.zeros(nb, bs, hkv, d), head) for _ in range(4)]
    key, value = (torch.randn(t, hkv, d, generator=g) * 3).to(src), torch.randn(t, hkv, d, generator=g).to(src)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[[3, 11]] = -1                                     # skipped rows
    assert cpu_ext.write_kv(pools[0], pools[1], key, value, slots)     # the kernel took it (not the fallback)
    reference.write_kv(pools[2], pools[3], key, value, slots)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert got.equal(want)                              # rows and scales
    written = (pools[0].data != 0).any(-1).sum().item()
    assert written == (t - 2) * hkv                         # every kept row landed, the skipped ones did not
    with pytest.raises(IndexError):
        cpu_ext.write_kv(pools[0], pools[1], key[:2], value[:2], torch.tensor([0, nb * bs]))


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"soft_cap": 1.5}])
def test_kernel_decode_over_int8_matches_the_naive_loop(each_build, head, options):
    rng = random.Random(f"i8-{head}-{options}")
    for _ in range(3):
        case = make_case(rng, num_seqs=rng.randint(1, 9), block_size=rng.choice([1, 4, 16]),
                         hkv=rng.choice([1, 2]), group=rng.choice([1, 3, 4]),
                         head_dim=rng.choice([16, 64, 80, 128]), dtype=torch.float32, max_ctx=70, decode_only=True)
        case["query"] = case["query"] * 3
        exact = naive_attention(**case, **options)
        case["key_cache"], case["value_cache"] = (_int8_pool(case[c], head) for c in ("key_cache", "value_cache"))
        got = cpu_ext.decode_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                                       case["seq_lens"], case["scale"], options.get("sliding_window"),
                                       options.get("soft_cap"))
        deq = dict(case, key_cache=_dequantized(case["key_cache"]), value_cache=_dequantized(case["value_cache"]))
        assert rel_err(got, naive_attention(**deq, **options)) <= 1e-5
        assert 0 < rel_err(got, exact) <= 1e-1            # the int8 rounding shows, within its bound
        # the torch math (option.cpu_kernels=torch) reads the same pools: the same answer
        ref = torch_paged.paged_attention(**case, **options)
        assert rel_err(ref, got) <= 1e-5


def test_mixed_step_over_int8_pools_matches_the_naive_loop(each_build):
    # Decode rows, chunks over cached prefixes and whole prompts through kernels.paged_attention
    # (the C decode kernel for the decode rows, the gather path for the rest).
    rng = random.Random("i8-mixed")
    for _ in range(4):
        case = make_case(rng, num_seqs=rng.randint(2, 7), block_size=4, hkv=2, group=2, head_dim=64,
                         dtype=torch.float32, max_ctx=40)
        case["key_cache"], case["value_cache"] = (_int8_pool(case[c], True) for c in ("key_cache", "value_cache"))
        got = kernels.paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                                      case["seq_lens"], case["query_start_loc"], case["scale"])
        deq = dict(case, key_cache=_dequantized(case["key_cache"]), value_cache=_dequantized(case["value_cache"]))
        assert rel_err(got, naive_attention(**deq)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_over_int8_is_rotary_write_and_attention(each_build, dtype):
    # lmi_decode_fused_i8 = rotary in place + the int8 write + attention over the pools: the same
    # as those three calls one by one (the unfused path), bytes and scales included.
    g = torch.Generator().manual_seed(4)
    b, h, hkv, d, nb, bs = 3, 4, 2, 64, 12, 4
    lens = torch.tensor([5, 9, 2], dtype=torch.int32)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens.tolist())])
    base = torch.randn(nb, bs, hkv, d, generator=g)
    q, k, v = (torch.randn(b, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))
    cos, sin = torch.randn(b, d, generator=g).to(dtype), torch.randn(b, d, generator=g).to(dtype)
    fused = [_int8_pool(base, True), _int8_pool(base * 0.5, True)]
    plain = [_int8_pool(base, True), _int8_pool(base * 0.5, True)]
    got = cpu_ext.decode_fused(q.clone(), k.clone(), v.clone(), cos, sin, *fused, slots, tables, lens, d ** -0.5)
    assert got is not None and got.dtype == dtype
    q2, k2 = q.clone(), k.clone()
    assert cpu_ext.rotary_(q2, k2, cos, sin)                 # in place, as the unfused path rotates
    reference.write_kv(*plain, k2, v, slots)
    want = cpu_ext.decode_attention(q2, *plain, tables, lens, d ** -0.5).to(dtype)
    for a, c in zip(fused, plain):
        assert a.equal(c)                                   # rows and scales
    assert torch.equal(got, want)


def test_as_stored_is_what_the_pool_gives_back():
    g = torch.Generator().manual_seed(5)
    pool = _int8_pool(torch.zeros(2, 4, 2, 16), True)
    rows = torch.randn(3, 2, 16, generator=g)
    reference.write_kv(pool, _int8_pool(torch.zeros(2, 4, 2, 16), True), rows, rows, torch.tensor([0, 5, 6]))
    back = _dequantized(pool).reshape(8, 2, 16)[[0, 5, 6]]
    assert torch.equal(kv_pool.as_stored(pool, rows), back) and not torch.equal(back, rows)
    fp = torch.zeros(2, 4, 2, 16)
    assert kv_pool.as_stored(kv_pool.as_pool(fp), rows) is rows     # a float pool stores the rows as they are
