"""Paged-attention kernels: Triton on CUDA tensors, the plain-torch reference otherwise.

Importing this package never imports triton; the Triton module loads on the first CUDA call.
"""
from __future__ import annotations

import functools

import torch

from . import reference

__all__ = ["write_kv", "paged_attention", "decode_step", "decode_rows", "stack_rows", "triton_available"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when `kernels.triton_kernels` (hence triton) imports on this machine."""
    try:
        from . import triton_kernels  # noqa: F401
    except Exception:  # ImportError, or a triton build that fails at import time
        return False
    return True


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: key/value [T, Hkv, D] -> caches [NB, bs, Hkv, D] at slot_mapping [T] (< 0: skip)."""
    if _use_triton(key_cache):
        from . import triton_kernels
        triton_kernels.write_kv(key_cache, value_cache, key, value, slot_mapping)
    else:
        from . import cpu_ext   # takes CPU fp32/bf16 pools; False: the reference stores the rows
        if not cpu_ext.write_kv(key_cache, value_cache, key, value, slot_mapping):
            reference.write_kv(key_cache, value_cache, key, value, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, seq_lens_cpu: list[int] | None = None,
                    query_start_loc_cpu: list[int] | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                    memo: dict | None = None) -> torch.Tensor:
    """query [T, H, D] over paged KV -> [T, H, D]; see docs/ARCHITECTURE.md "KV pool and kernels".

    `seq_lens_cpu` / `query_start_loc_cpu` (plain lists, optional) let the CPU reference
    skip reading the tensors back; the Triton path never reads them back. On CUDA a sliding
    window or logit soft-cap (Mistral-style / Gemma 2 models) goes to the reference: the Triton
    kernel does not implement them yet. `key` / `value` (this step's, optional) let the
    reference skip gathering a sequence whose whole context is in this step. On CPU the decode
    rows go to the C kernel of kernels/cpu_ext.py when it built (the reference serves otherwise),
    and so do prompts whose whole context is this step's (one call for all of them).
    `memo` (optional, a dict per step shared by its layers) spares the reference recomputing the
    step's row bookkeeping at every layer.
    """
    if _use_triton(query) and sliding_window is None and soft_cap is None:
        from . import triton_kernels
        return triton_kernels.paged_attention(query, key_cache, value_cache, block_tables,
                                              seq_lens, query_start_loc, scale)
    return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, seq_lens_cpu=seq_lens_cpu,
                                     query_start_loc_cpu=query_start_loc_cpu,
                                     sliding_window=sliding_window, soft_cap=soft_cap,
                                     key=key, value=value, decode=_cpu_decode(query, key_cache),
                                     prefill=_cpu_prefill(query), memo=memo)


def _cpu_decode(query: torch.Tensor, key_cache: torch.Tensor):
    """kernels/cpu_ext.decode_attention when it serves this pool, else None."""
    if query.device.type != "cpu":
        return None
    from . import cpu_ext
    if not cpu_ext.supports(key_cache) or cpu_ext.load() is None:
        return None
    return cpu_ext.decode_attention


def _cpu_prefill(query: torch.Tensor):
    """kernels/cpu_ext.prefill_attention for CPU queries (it declines what it cannot take), else None."""
    if query.device.type != "cpu":
        return None
    from . import cpu_ext
    return cpu_ext.prefill_attention if cpu_ext.load() is not None else None


def decode_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, scale: float, *, seq_lens_cpu: list[int] | None,
                query_start_loc_cpu: list[int] | None, sliding_window: int | None = None,
                memo: dict | None = None) -> torch.Tensor | None:
    """A CPU decode step's attention in one C call (kernels/cpu_ext.decode_fused): q/k rotated by
    cos/sin in place, k/v stored at slot_mapping, attention over the pools -> [T, H, D]; the same
    values as apply_rotary_ + write_kv + paged_attention. None (nothing changed) unless every
    sequence feeds one row and the kernel takes these tensors: the caller goes that way instead."""
    if query.device.type != "cpu":
        return None
    from . import cpu_ext
    if cpu_ext.load() is None or not cpu_ext.supports(key_cache):
        return None
    rows = decode_rows(slot_mapping, block_tables, seq_lens, query_start_loc, seq_lens_cpu, query_start_loc_cpu,
                       key_cache.shape[1], query.shape[0], query.device, memo)
    if rows is None:
        return None
    slots, tables, lens = rows
    return cpu_ext.decode_fused(query, key, value, cos, sin, key_cache, value_cache, slots, tables, lens, scale,
                                sliding_window)


def stack_rows(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens_cpu: list[int] | None, query_start_loc_cpu: list[int] | None,
               block_size: int, t: int, device, memo: dict | None = None):
    """For a step of T rows whose sequences each decode one row (those first) or feed a whole prompt
    of several rows (its context is its rows of this step): (slots int64 [T], the decoding
    sequences' block tables int32 [B, W] and context lengths int32 [B], the prompts' first rows,
    lengths and order longest first as int64 [3, P]); None for any other step (a chunk of a longer
    prompt, a decode row after a prompt) or without the host-side row lists."""
    if (seq_lens_cpu is None or query_start_loc_cpu is None or not seq_lens_cpu
            or query_start_loc_cpu[0] != 0 or query_start_loc_cpu[-1] != t):
        return None
    qsl, lens = query_start_loc_cpu, seq_lens_cpu
    nq = [qsl[s + 1] - qsl[s] for s in range(len(lens))]
    b = 0
    while b < len(nq) and nq[b] == 1:
        b += 1
    if any(n < 2 or n != ctx for n, ctx in zip(nq[b:], lens[b:])):
        return None
    if b:
        p = reference.step_plan(memo, block_tables, seq_lens, query_start_loc, seq_lens_cpu, query_start_loc_cpu,
                                block_size, t, device)
        tables, dec_lens = p["dec_tables"], p["dec_lens"]
    else:
        tables, dec_lens = _NO_TABLES, _NO_LENS
    from . import cpu_ext
    return _slots(slot_mapping, memo), tables, dec_lens, cpu_ext.prompt_table(qsl[b:-1], nq[b:])


_NO_TABLES, _NO_LENS = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)


def _slots(slot_mapping: torch.Tensor, memo: dict | None) -> torch.Tensor:
    """The step's KV slots as int64, made once per step (kept in `memo`)."""
    slots = memo.get("slots") if memo is not None else None
    if slots is None:
        slots = slot_mapping.to(torch.int64).contiguous()
        if memo is not None:
            memo["slots"] = slots
    return slots


def decode_rows(slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens_cpu: list[int] | None, query_start_loc_cpu: list[int] | None,
                block_size: int, t: int, device, memo: dict | None = None):
    """For a step of T rows where every sequence feeds one row: the C kernels' inputs (slots int64 [T],
    block tables int32 [T, W], context lengths int32 [T]), kept in `memo` for the step's other
    layers; None for any other step (or without the host-side row lists)."""
    if (seq_lens_cpu is None or query_start_loc_cpu is None or len(seq_lens_cpu) != t
            or query_start_loc_cpu[0] != 0 or query_start_loc_cpu[-1] != t):
        return None
    p = reference.step_plan(memo, block_tables, seq_lens, query_start_loc, seq_lens_cpu, query_start_loc_cpu,
                            block_size, t, device)
    if not p["all_decode"]:
        return None
    return _slots(slot_mapping, memo), p["dec_tables"], p["dec_lens"]
