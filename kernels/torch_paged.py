"""Paged attention and rotary in plain torch, as the serving path runs them: the `torch` backend's
math, and the rows the C kernels do not take (kernels/backends.py). Nothing here calls a C kernel;
kernels/reference.py is the oracle the tests compare this with.

The pools (key_cache, value_cache) are kernels/pool.py's records (a float pool may be a bare tensor):
its docstring gives the layout and the int8 format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.pool import KVPool, as_pool, quantize_rows
from kernels.step import StepPlan, plan_step


def write_kv(key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, Hkv, D] at flat slots slot_mapping [T]; a negative slot is skipped.
    An int8 pool stores each (token, head) row quantized (`quantize_rows`) and its scale."""
    kp, vp = as_pool(key_cache), as_pool(value_cache)
    bs = kp.block_size
    slots = slot_mapping.to(device=kp.device, dtype=torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    blk, off = slots // bs, slots % bs
    if kp.int8:
        for pool, rows in ((kp, key), (vp, value)):
            q, sc = quantize_rows(rows)
            pool.data[blk, off] = q
            pool.scales[blk, off] = sc
        return
    kp.data[blk, off] = key.to(kp.dtype)
    vp.data[blk, off] = value.to(vp.dtype)


def head_major(cache: torch.Tensor) -> bool:
    """True for a [NB, bs, Hkv, D] view of a [NB, Hkv, bs, D] allocation (the CPU pool): there
    a gather of whole blocks yields [B, Hkv, L, D] in one copy, the layout attention reads."""
    return cache.transpose(1, 2).is_contiguous()


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [NB, bs, Hkv, D], tables [B, nblk] long -> keys [B, Hkv, nblk*bs, D] (a view,
    contiguous when the pool is head-major)."""
    nb, bs, hkv, d = cache.shape
    b, nblk = tables.shape
    # embedding() gathers rows ~3x faster on CPU than advanced indexing; reshape is a view
    # (the pool is allocated contiguous in one of the two layouts).
    if head_major(cache):
        idx = tables[:, None, :] * hkv + torch.arange(hkv, device=tables.device)[None, :, None]
        rows = F.embedding(idx, cache.transpose(1, 2).reshape(nb * hkv, bs * d))  # [B, Hkv, nblk, bs*D]
        return rows.view(b, hkv, nblk * bs, d)
    rows = F.embedding(tables, cache.reshape(nb, bs * hkv * d))
    return rows.view(b, nblk * bs, hkv, d).transpose(1, 2)


def _gather_f32(pool: KVPool, tables: torch.Tensor) -> torch.Tensor:
    """`_gather` as fp32 [B, Hkv, nblk*bs, D]; an int8 pool's rows times their scales."""
    k = _gather(pool.data, tables).float()
    if pool.int8:
        k = k * _gather(pool.scales.unsqueeze(-1), tables)
    return k


def length_groups(seqs: list[int], nblks: list[int], min_size: int = 8,
                  slack: float = 0.6) -> list[list[int]]:
    """Decode sequences in groups of similar length, longest first. A batched gather pads every
    sequence to the group's longest; a new group starts (once the current one holds `min_size`)
    when the next sequence needs under `slack` of the current group's blocks, so short
    contexts beside long ones are not gathered and multiplied at the long length."""
    order = sorted(range(len(seqs)), key=lambda i: -nblks[i])
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if not groups or (len(groups[-1]) >= min_size and nblks[i] < slack * width):
            groups.append([])
            width = nblks[i]
        groups[-1].append(seqs[i])
    return groups


def _grouped(q, k, v, keep, scale, soft_cap):
    """Explicit attention with query heads grouped by KV head (no K/V repeat), fp32 logits,
    optionally soft-capped (Gemma 2): tanh(s/cap)*cap. q [..., Hkv, m, D] (m rows of one KV
    head's query heads), k/v [..., Hkv, L, D], keep broadcastable to [..., Hkv, m, L]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap is not None:
        s = torch.tanh(s / soft_cap) * soft_cap
    s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _attend(q, k, v, mask, scale, g, soft_cap):
    """SDPA, or the grouped math when the logits are soft-capped.
    q [H, n, D], k/v [Hkv, L, D], mask [n, L] (True = keep) -> [H, n, D]."""
    if soft_cap is None:   # 4-D inputs: torch's CPU flash kernel (3-D ones take the slower math path)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                              enable_gqa=g > 1)[0]
    h, n, d = q.shape
    o = _grouped(q.reshape(h // g, g * n, d), k, v, mask.repeat(g, 1), scale, soft_cap)
    return o.view(h, n, d)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, D], k [T, Hkv, D] rotated by cos/sin [T, D] (transformers' formula) -> new (q, k)."""
    c, s = cos[:, None], sin[:, None]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def paged_attention(query: torch.Tensor, key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor,
                    block_tables: torch.Tensor, seq_lens, query_start_loc, scale: float, *,
                    seq_lens_cpu: list[int] | None = None,
                    query_start_loc_cpu: list[int] | None = None,
                    sliding_window: int | None = None,
                    soft_cap: float | None = None,
                    key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None,
                    plan: StepPlan | None = None,
                    blocks: dict | None = None) -> torch.Tensor:
    """Causal attention of packed query rows [T, H, D] over paged KV -> [T, H, D].

    Sequence s owns rows qsl[s]:qsl[s+1] (n_s rows) at positions seq_lens[s]-n_s ..
    seq_lens[s]-1. Decode rows (n_s == 1) go through one batched gather and one masked
    attention per group of similar lengths (`length_groups`); prefill chunks (n_s > 1) go
    through SDPA one sequence each.
    `seq_lens_cpu` / `query_start_loc_cpu` spare reading the tensors back. `sliding_window` W:
    a query at position i sees keys j > i - W (transformers' convention); `soft_cap`: Gemma 2's
    attention logit soft-capping. `key` / `value` [T, Hkv, D] (optional): this step's own keys
    and values (already written to the pool); a sequence whose whole context is in this step
    attends to them directly instead of gathering them back. `plan` (optional): the step's
    kernels.step.StepPlan, made once per step by the runner; without it the row bookkeeping is
    worked out here from the arguments above. `blocks` (optional): sequence index -> [(first, end)]
    positions that attend to each other both ways (kernels.step.Step.blocks): a query row in a block
    also sees the block's later keys (with a window: those that pass it; later keys always do).
    """
    t, h, d = query.shape
    _heads(query, key_cache)
    if plan is None:
        plan = plan_step(block_tables, seq_lens, query_start_loc, key_cache.shape[1], rows=t,
                         seq_lens_cpu=seq_lens_cpu, query_start_loc_cpu=query_start_loc_cpu, device=query.device)
    out = torch.empty(t, h, d, dtype=query.dtype, device=query.device)   # every row is written below
    decode_into(out, query, key_cache, value_cache, plan, plan.dec, scale, sliding_window, soft_cap)
    prompts_into(out, query, key_cache, value_cache, plan, plan.chunks, scale, sliding_window, soft_cap, key, value,
                 blocks)
    return out


def _heads(query: torch.Tensor, key_cache) -> int:
    h, hkv = query.shape[1], key_cache.shape[2]
    if h % hkv:
        raise ValueError(f"num query heads {h} is not a multiple of num kv heads {hkv}")
    return h // hkv


def decode_into(out: torch.Tensor, query: torch.Tensor, key_cache: KVPool | torch.Tensor,
                value_cache: KVPool | torch.Tensor,
                plan: StepPlan, seqs: list[int], scale: float, sliding_window: int | None = None,
                soft_cap: float | None = None) -> None:
    """`paged_attention`'s values for the decode rows of sequences `seqs`, written into their rows of out."""
    key_cache, value_cache = as_pool(key_cache), as_pool(value_cache)
    g = _heads(query, key_cache)
    _, h, d = query.shape
    nb, bs, hkv, _ = key_cache.shape
    dev = query.device
    lens, qsl, tables = plan.lens, plan.qsl, plan.tables
    for group in length_groups(seqs, [-(-lens[s] // bs) for s in seqs]):
        nblk = -(-max(lens[s] for s in group) // bs)
        rows = torch.tensor([qsl[s] for s in group], device=dev)
        blen = torch.tensor([lens[s] for s in group], device=dev)
        tbl = tables[torch.tensor(group, device=dev), :nblk]
        # Entries past a sequence's last block may be padding (-1 or stale): any valid id will do.
        tbl = tbl.clamp(0, nb - 1)
        k = _gather_f32(key_cache, tbl)   # [B, Hkv, L, D] (float(): a no-op in fp32)
        v = _gather_f32(value_cache, tbl)
        kpos = torch.arange(nblk * bs, device=dev)[None, :]
        valid = kpos < blen[:, None]  # [B, L]
        if sliding_window is not None:
            valid &= kpos > blen[:, None] - 1 - sliding_window
        # Query head i reads KV head i // g: group the g heads of each KV head as the rows of
        # one small matmul (no repeat of K/V); scores and softmax in fp32.
        q = query[rows].float().view(len(group), hkv, g, d)
        o = _grouped(q, k, v, valid[:, None, None, :], scale, soft_cap)   # [B, Hkv, g, D]
        out[rows] = o.view(len(group), h, d).to(query.dtype)


def prompts_into(out: torch.Tensor, query: torch.Tensor, key_cache: KVPool | torch.Tensor,
                 value_cache: KVPool | torch.Tensor,
                 plan: StepPlan, seqs: list[int], scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None, key: torch.Tensor | None = None,
                 value: torch.Tensor | None = None, blocks: dict | None = None) -> None:
    """`paged_attention`'s values for the rows of sequences `seqs` (each feeding several rows),
    written into their rows of out; `blocks` as paged_attention's."""
    key_cache, value_cache = as_pool(key_cache), as_pool(value_cache)
    g = _heads(query, key_cache)
    bs = key_cache.shape[1]
    dev = query.device
    lens, qsl, tables = plan.lens, plan.qsl, plan.tables
    for s in seqs:
        a, b = qsl[s], qsl[s + 1]
        n, ctx = b - a, lens[s]
        q = query[a:b].transpose(0, 1)  # [H, n, D]
        both = blocks.get(s) if blocks else None
        if ctx == n and key is not None and sliding_window is None and soft_cap is None and not both:
            # The whole context is this step's: attend to its own keys, causally (no gather).
            # 4-D inputs: torch's CPU flash kernel, about 1.5-2x the 3-D math path at 15-160 tokens.
            o = F.scaled_dot_product_attention(q[None], key[a:b].transpose(0, 1)[None],
                                               value[a:b].transpose(0, 1)[None],
                                               is_causal=True, scale=scale, enable_gqa=g > 1)
            out[a:b] = o[0].transpose(0, 1)
            continue
        nblk = -(-ctx // bs)
        tbl = tables[s:s + 1, :nblk]
        k = _gather_f32(key_cache, tbl)[0, :, :ctx]  # [Hkv, L, D]
        v = _gather_f32(value_cache, tbl)[0, :, :ctx]
        qpos = torch.arange(ctx - n, ctx, device=dev)
        kpos = torch.arange(ctx, device=dev)[None, :]
        mask = kpos <= qpos[:, None]  # [n, L]
        for lo, hi in both or ():    # transformers' blockwise overlay: OR(causal, same block)
            mask |= ((qpos >= lo) & (qpos < hi))[:, None] & ((kpos >= lo) & (kpos < hi))
        if sliding_window is not None:  # ... AND the window (sliding layers)
            mask &= kpos > qpos[:, None] - sliding_window
        o = _attend(q.float(), k, v, mask, scale, g, soft_cap)
        out[a:b] = o.transpose(0, 1).to(query.dtype)
