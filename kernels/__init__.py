"""Paged-attention kernels: Triton on CUDA tensors, the C kernels (kernels/cpu/) or the
plain-torch math (kernels/torch_paged.py) on CPU, behind one backend object per process
(kernels/backends.py: the runner picks it at load, the layers call its `forward`).

`write_kv` and `paged_attention` here pick the backend per call, for callers without a runner
(tests, benchmarks). Importing this package never imports triton; the Triton module loads on the
first CUDA call.
"""
from __future__ import annotations

import torch

from .backends import CpuAttention, TorchAttention, TritonAttention, backend_for, triton_available
from .pool import KVPool
from .step import Step, StepPlan, plan_step

__all__ = ["KVPool", "write_kv", "paged_attention", "triton_available", "backend_for", "plan_step", "Step", "StepPlan",
           "CpuAttention", "TorchAttention", "TritonAttention"]


def write_kv(key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: key/value [T, Hkv, D] -> pools [NB, bs, Hkv, D] (kernels/pool.py) at slot_mapping [T] (< 0: skip)."""
    backend_for(key_cache.device).write(key_cache, value_cache, key, value, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: KVPool | torch.Tensor, value_cache: KVPool | torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, seq_lens_cpu: list[int] | None = None,
                    query_start_loc_cpu: list[int] | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H, D] over paged KV -> [T, H, D] by this device's backend; see docs/ARCHITECTURE.md
    "KV pool and kernels". `seq_lens_cpu` / `query_start_loc_cpu` (plain lists, optional) spare
    reading the tensors back; `key` / `value` (this step's, as stored, optional) let a prompt whose
    whole context is this step's attend to them without a gather."""
    backend = backend_for(query.device)
    step = Step(slot_mapping=None, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
                seq_lens_cpu=seq_lens_cpu, query_start_loc_cpu=query_start_loc_cpu)
    if backend.needs_plan or sliding_window is not None or soft_cap is not None:
        step.plan = plan_step(block_tables, seq_lens, query_start_loc, key_cache.shape[1], rows=query.shape[0],
                              seq_lens_cpu=seq_lens_cpu, query_start_loc_cpu=query_start_loc_cpu,
                              device=query.device)
    return backend.attend(query, key_cache, value_cache, step, scale, sliding_window, soft_cap, key, value)
