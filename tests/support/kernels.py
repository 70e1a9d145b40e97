"""Attention oracles for the kernel tests: a naive per-token loop in float64, error measures, pool layouts."""
from __future__ import annotations

import torch

from kernels import reference


def naive_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window=None, soft_cap=None):
    """One query row and one head at a time, keys gathered position by position, float64.
    sliding_window W: keys j > pos - W only; soft_cap c: logits -> tanh(logits / c) * c."""
    t, h, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    group = h // hkv
    flat_k = key_cache.reshape(-1, hkv, d).double()
    flat_v = value_cache.reshape(-1, hkv, d).double()
    tables, lens, qsl = block_tables.tolist(), seq_lens.tolist(), query_start_loc.tolist()
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for s in range(len(lens)):
        n = qsl[s + 1] - qsl[s]
        slots = [tables[s][p // bs] * bs + p % bs for p in range(lens[s])]
        for j in range(n):
            pos = lens[s] - n + j
            row = qsl[s] + j
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for head in range(h):
                k = flat_k[slots[first:pos + 1], head // group]  # [keys, D]
                v = flat_v[slots[first:pos + 1], head // group]
                logits = (k @ query[row, head].double()) * scale
                if soft_cap is not None:
                    logits = torch.tanh(logits / soft_cap) * soft_cap
                out[row, head] = torch.softmax(logits, dim=0) @ v
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs() / (1 + want.double().abs())).max().item()


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in the CPU pool's layout: a [NB, bs, Hkv, D] view of [NB, Hkv, bs, D]."""
    hm = cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert reference.head_major(hm) and torch.equal(hm, cache)
    return hm


def _own_kv(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own keys/values [T, Hkv, D], read from the pool at each row's position."""
    bs = case["key_cache"].shape[1]
    tables, lens, qsl = case["block_tables"].tolist(), case["seq_lens"].tolist(), case["query_start_loc"].tolist()
    slots = [tables[s][p // bs] * bs + p % bs for s in range(len(lens))
             for p in range(lens[s] - (qsl[s + 1] - qsl[s]), lens[s])]
    flat = lambda c: c.reshape(-1, *c.shape[2:])  # noqa: E731
    return flat(case["key_cache"])[slots], flat(case["value_cache"])[slots]
