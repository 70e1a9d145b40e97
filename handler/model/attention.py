"""The attention function we register with transformers: reads and writes the paged KV pool.

An unmodified HF model calls `fn(module, query[1,H,T,D], key[1,Hkv,T,D], value, mask, scaling=...)`
with RoPE applied; every extra keyword given to `model(...)` reaches it, so the runner passes
the step's metadata as `lmi_step=StepMeta`. Without it (e.g. `model.generate` on the same
model object) we fall back to SDPA, so the model stays usable on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kernels

ATTN_NAME = "lmi_paged"


@dataclass
class StepMeta:
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]   # per layer: [NB, bs, Hkv, D] x 2
    slot_mapping: torch.Tensor       # [T] int64
    block_tables: torch.Tensor       # [S, max_blocks] int32
    seq_lens: torch.Tensor           # [S] int32: context length incl. this step's tokens
    query_start_loc: torch.Tensor    # [S+1] int32
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    memo: dict = field(default_factory=dict)   # per-step bookkeeping the layers share (kernels)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            lmi_step: StepMeta | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs):
    if lmi_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, softcap=softcap,
                                      **kwargs)
    k_cache, v_cache = lmi_step.kv_cache[module.layer_idx]
    q = query[0].transpose(0, 1)     # [T, H, D]
    k = key[0].transpose(0, 1)       # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    if k_cache.is_floating_point():   # an int8 pool quantizes the rows as it stores them
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    kernels.write_kv(k_cache, v_cache, k, v, lmi_step.slot_mapping)
    k, v = kernels.reference.as_stored(k_cache, k), kernels.reference.as_stored(v_cache, v)   # int8: as read back
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = kernels.paged_attention(q, k_cache, v_cache, lmi_step.block_tables, lmi_step.seq_lens,
                                  lmi_step.query_start_loc, float(scaling),
                                  seq_lens_cpu=lmi_step.seq_lens_cpu,
                                  query_start_loc_cpu=lmi_step.query_start_loc_cpu,
                                  sliding_window=sliding_window, soft_cap=softcap, key=k, value=v,
                                  memo=lmi_step.memo)
    return out.unsqueeze(0), None    # [1, T, H, D]


AttentionInterface.register(ATTN_NAME, paged_attention_forward)
