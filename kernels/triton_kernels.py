"""Triton kernels: KV store through a slot mapping, and unified paged attention.

Works on triton 3.6-3.9, on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1
(set before triton is first imported). Semantics are those of kernels/reference.py (the oracle) and kernels/torch_paged.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     HKV: tl.constexpr, D: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr):
    # One program per token: copies its [Hkv, D] key and value rows into slot `slot`.
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, HKV_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        mask = (h < HKV) & (d < D)
        dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
        k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] at slots [T] of [NB, bs, Hkv, D] caches; slot < 0 is skipped."""
    t, hkv, d = key.shape
    if t == 0:
        return
    for x in (key, value, key_cache, value_cache):
        if x.stride(-1) != 1:
            raise ValueError("write_kv needs the head_dim axis contiguous (stride 1)")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share one layout")
    slot_mapping = slot_mapping.to(key_cache.device).contiguous()
    _store_kv_kernel[(t,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HKV=hkv, D=d, BLOCK_SIZE=key_cache.shape[1],
        HKV_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d))


@triton.jit
def _find_seq(qsl_ptr, num_seqs, qblock, BLOCK_Q: tl.constexpr):
    # Last s with qsl[s] // BLOCK_Q + s <= qblock: sequence s owns q blocks starting there.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= qblock:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
                       scale, num_seqs,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_cb, stride_cs, stride_ch, stride_bt,
                       G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                       TILE_N: tl.constexpr, IEEE: tl.constexpr):
    # Program (q block, kv head): BLOCK_Q query tokens of one sequence x the G query heads
    # sharing kv head `kvh`, as BLOCK_M (= BLOCK_Q * G_PAD) rows (row r: token r // G_PAD,
    # head kvh * G + r % G_PAD), against the context in tiles of TILE_N positions.
    qblock = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(qsl_ptr, num_seqs, qblock, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    n_q = tl.load(qsl_ptr + seq + 1) - q_start
    local = (qblock - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first row of this block in seq
    if local < n_q:
        ctx = tl.load(seq_lens_ptr + seq)
        r = tl.arange(0, BLOCK_M)
        tok = local + r // G_PAD  # [M] row index within the sequence's chunk
        head = kvh * G + r % G_PAD
        row_ok = (tok < n_q) & (r % G_PAD < G)
        qpos = ctx - n_q + tok  # absolute position of each query row
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # softmax via exp2
        # Positions this block can see: up to its last row's position (causal).
        kv_end = tl.minimum(ctx, ctx - n_q + local + BLOCK_Q)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(0, kv_end, TILE_N):
            pos = start + tl.arange(0, TILE_N)
            pos_ok = pos < kv_end
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
            kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch  # [N]
            kv_mask = pos_ok[None, :] & d_ok[:, None]
            kt = tl.load(kc_ptr + kv_off[None, :] + d[:, None], mask=kv_mask, other=0.0)  # [D, N]
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = s * qk_scale
            ok = (pos[None, :] <= qpos[:, None]) & pos_ok[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # fully masked rows stay finite
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=pos_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [N, D]
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        acc = acc / l_i[:, None]
        o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, block_q: int | None = None,
                    tile_n: int | None = None) -> torch.Tensor:
    """Unified paged attention (prefill chunks with cached prefixes and decode rows in one launch).

    query [T, H, D]; caches [NB, bs, Hkv, D]; block_tables [S, max_blocks] int32;
    seq_lens [S] int32; query_start_loc [S+1] int32 -> out [T, H, D]. No host sync.
    """
    t, h, d = query.shape
    nb, bs, hkv, _ = key_cache.shape
    s_num = block_tables.shape[0]
    if h % hkv:
        raise ValueError(f"num query heads {h} is not a multiple of num kv heads {hkv}")
    if bs & (bs - 1):
        raise ValueError(f"block_size {bs} must be a power of two")
    for x in (query, key_cache, value_cache):
        if x.stride(-1) != 1:
            raise ValueError("paged_attention needs the head_dim axis contiguous (stride 1)")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share one layout")
    dev = query.device
    # No-ops when the caller already has them on the device as contiguous tensors.
    block_tables = block_tables.to(dev).contiguous()
    seq_lens = seq_lens.to(dev).contiguous()
    query_start_loc = query_start_loc.to(dev).contiguous()
    out = torch.zeros_like(query)  # rows outside every sequence stay zero, as in the reference
    if t == 0 or s_num == 0:
        return out
    g = h // hkv
    g_pad = triton.next_power_of_2(g)
    if block_q is None:
        # Decode-only batches (T <= S, known without a sync) get the smallest tile that
        # tl.dot accepts (>= 16 rows); batches with prefill chunks get 64 rows.
        block_m = max(16, g_pad) if t <= s_num else max(64, g_pad)
        block_q = block_m // g_pad
    if tile_n is None:
        tile_n = 64 if d <= 64 else 32
    if block_q * g_pad < 16 or tile_n < 16 or tile_n & (tile_n - 1) or block_q & (block_q - 1):
        raise ValueError(f"block_q={block_q} (x {g_pad} heads) and tile_n={tile_n} must be powers of "
                         "two giving tl.dot tiles of at least 16")
    d_pad = max(16, triton.next_power_of_2(d))
    grid = (t // block_q + s_num, hkv)
    _paged_attn_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale), s_num,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        G=g, G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_SIZE=bs, BLOCK_Q=block_q,
        BLOCK_M=block_q * g_pad, TILE_N=tile_n,
        IEEE=query.dtype == torch.float32)
    return out
