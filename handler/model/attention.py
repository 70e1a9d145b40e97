"""The attention function we register with transformers: reads and writes the paged KV pool.

An unmodified HF model calls `fn(module, query[1,H,T,D], key[1,Hkv,T,D], value, mask, scaling=...)`
with RoPE applied; every extra keyword given to `model(...)` reaches it, so the runner passes
the step's metadata as `lmi_step=StepMeta`. Without it (e.g. `model.generate` on the same
model object) we fall back to SDPA, so the model stays usable on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kernels
from kernels.pool import KVPool
from kernels.step import Step

ATTN_NAME = "lmi_paged"


@dataclass(kw_only=True)
class StepMeta(Step):
    """One step's metadata, built once by the runner and read by every layer: the step's tensors
    and row bookkeeping (kernels.step.Step, its `plan`), the pools and the attention backend
    chosen at load (kernels/backends.py)."""
    kv_cache: list[tuple[KVPool, KVPool]]   # per layer: keys and values (kernels/pool.py)
    backend: kernels.TorchAttention | None = None       # None: the one for the slots' device

    def __post_init__(self):
        if self.backend is None:
            self.backend = kernels.backend_for(self.slot_mapping.device)


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
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = lmi_step.backend.forward(q, k, v, k_cache, v_cache, lmi_step, float(scaling), window=sliding_window,
                                   soft_cap=softcap)
    return out.unsqueeze(0), None    # [1, T, H, D]


AttentionInterface.register(ATTN_NAME, paged_attention_forward)
