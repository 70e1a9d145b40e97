"""The test oracle: paged attention, the KV write and rotary as plainly as they can be written,
one token, one head and one key at a time in float64. Nothing on the serving path imports this
module (tests/kernels/test_layout.py checks); the kernels (C, Triton) and the serving path's torch
math (kernels/torch_paged.py) are tested against it.

The pools are kernels/pool.py's records (a float pool may be a bare tensor): that module defines
the layout and the int8 format, which this oracle reads and writes through it.
"""
from __future__ import annotations

import torch

from kernels.pool import KVPool, as_pool, quantize_rows


def write_kv(key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store row i of key/value [T, Hkv, D] at flat slot slot_mapping[i] (negative: skipped); an
    int8 pool stores each (token, head) row quantized with its scale (`quantize_rows`)."""
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        for pool, rows in ((as_pool(key_cache), key), (as_pool(value_cache), value)):
            blk, off = divmod(slot, pool.block_size)
            if pool.int8:
                q, sc = quantize_rows(rows[i:i + 1])
                pool.data[blk, off] = q[0]
                pool.scales[blk, off] = sc[0]
            else:
                pool.data[blk, off] = rows[i].to(pool.dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, Hkv, D] rotated by cos/sin [T, D] (transformers' formula) -> new (q, k)."""
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    c, s = cos[:, None], sin[:, None]
    return q * c + rot(q) * s, k * c + rot(k) * s


def _rows(pool: KVPool) -> torch.Tensor:
    """The pool's values as float64 [NB * bs, Hkv, D], an int8 pool's rows times their scales."""
    nb, bs, hkv, d = pool.shape
    x = pool.data.double()
    if pool.int8:
        x = x * pool.scales.double().unsqueeze(-1)
    return x.reshape(nb * bs, hkv, d)


def paged_attention_f64(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                        sliding_window=None, soft_cap=None) -> torch.Tensor:
    """Causal attention of packed query rows [T, H, D] over paged KV -> float64 [T, H, D]. Sequence s
    owns rows qsl[s]:qsl[s+1] at positions seq_lens[s]-n_s .. seq_lens[s]-1; query head i reads KV
    head i // (H / Hkv). sliding_window W: keys j > pos - W only; soft_cap c: logits -> tanh(logits/c)*c."""
    kp, vp = as_pool(key_cache), as_pool(value_cache)
    t, h, d = query.shape
    bs, hkv = kp.block_size, kp.shape[2]
    if h % hkv:
        raise ValueError(f"num query heads {h} is not a multiple of num kv heads {hkv}")
    group = h // hkv
    flat_k, flat_v = _rows(kp).cpu(), _rows(vp).cpu()
    q64 = query.detach().double().cpu()
    tables, lens, qsl = block_tables.tolist(), seq_lens.tolist(), query_start_loc.tolist()
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for s in range(len(lens)):
        n = qsl[s + 1] - qsl[s]
        if n > lens[s]:
            raise ValueError(f"sequence {s} has {n} query rows but a context of {lens[s]}")
        slots = [tables[s][p // bs] * bs + p % bs for p in range(lens[s])]
        for j in range(n):
            pos, row = lens[s] - n + j, qsl[s] + j
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for head in range(h):
                k = flat_k[slots[first:pos + 1], head // group]      # [keys, D]
                v = flat_v[slots[first:pos + 1], head // group]
                logits = (k @ q64[row, head]) * scale
                if soft_cap is not None:
                    logits = torch.tanh(logits / soft_cap) * soft_cap
                out[row, head] = torch.softmax(logits, dim=0) @ v
    return out


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                    sliding_window=None, soft_cap=None, **_serving_hints) -> torch.Tensor:
    """`paged_attention_f64` in the query's dtype and device. Accepts (and ignores) the serving
    path's hints (seq_lens_cpu, query_start_loc_cpu, key, value, plan): they change no value."""
    out = paged_attention_f64(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              sliding_window, soft_cap)
    return out.to(dtype=query.dtype, device=query.device)
