"""Attention backends: one object per process, chosen at load (`backend_for`), one entry point a layer.

  CpuAttention    the C kernels of the chosen instruction set (kernels/cpu/): a decode
                  step's rotary, KV write and attention in one call where every sequence feeds
                  one row; else decode rows read the pool in place, whole prompts go to the
                  prompt kernel, and what neither takes (chunks after cached rows, sliding
                  windows or soft-caps on prompts, prompts with Step.blocks) to the torch math
                  (kernels/torch_paged.py)
  TorchAttention  plain torch (kernels/torch_paged.py): option.cpu_kernels=torch, a CPU without a
                  kernel build, or CUDA without triton
  TritonAttention CUDA with triton (kernels/triton_kernels.py); a sliding window, a logit
                  soft-cap or a step with blocks attending both ways (Step.blocks: Gemma 3's image runs)
                  goes to kernels/torch_paged.py (the Triton kernel has none of them)

`forward(q, k, v, k_cache, v_cache, step, scale, cos=, sin=, window=, soft_cap=)` is the layer's
attention: q [T, H, D], k/v [T, Hkv, D] (rotated by cos/sin [T, D] first when given: our models;
transformers' have rotated them), k/v stored at the step's slots, attention over the pools (kernels/pool.py
KVPool records; a float pool may be a bare tensor) -> [T, H, D]. `step` is the runner's step metadata (handler/model/attention.py StepMeta, or
kernels.step.Step): its tensors and its `plan` (kernels.step.StepPlan, built once per step).
"""
from __future__ import annotations

import functools
import logging

import torch

from kernels import torch_paged
from kernels.pool import as_pool, as_stored
from kernels.step import StepPlan

log = logging.getLogger(__name__)


class TorchAttention:
    """kernels/torch_paged.py's math on any device."""

    name = "torch"
    needs_plan = True       # the torch math reads the step's row bookkeeping at every layer

    def rotate(self, q, k, cos, sin):
        return torch_paged.apply_rotary(q, k, cos, sin)

    def write(self, key_cache, value_cache, key, value, slots) -> None:
        torch_paged.write_kv(key_cache, value_cache, key, value, slots)

    def attend(self, query, key_cache, value_cache, step, scale: float, window=None, soft_cap=None,
               key=None, value=None) -> torch.Tensor:
        """Attention of this step's rows over the pools (k/v already stored); `key`/`value` this
        step's rows as the pools give them back."""
        return torch_paged.paged_attention(query, key_cache, value_cache, step.block_tables, step.seq_lens,
                                         step.query_start_loc, scale, seq_lens_cpu=step.seq_lens_cpu,
                                         query_start_loc_cpu=step.query_start_loc_cpu, sliding_window=window,
                                         soft_cap=soft_cap, key=key, value=value, plan=step.plan,
                                         blocks=getattr(step, "blocks", None))

    def forward(self, q, k, v, key_cache, value_cache, step, scale: float, *, cos=None, sin=None,
                window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        if cos is not None:
            q, k = self.rotate(q, k, cos, sin)
        kp, vp = as_pool(key_cache), as_pool(value_cache)
        if not kp.int8:   # an int8 pool quantizes the rows as it stores them
            k, v = k.to(kp.dtype), v.to(vp.dtype)
        self.write(kp, vp, k, v, step.slot_mapping)
        k, v = as_stored(kp, k), as_stored(vp, v)   # int8: as read back
        return self.attend(q, kp, vp, step, scale, window, soft_cap, k, v)

    def describe(self) -> str:
        return "plain torch (kernels/torch_paged.py)"


class CpuAttention(TorchAttention):
    """The C kernels of the build kernels/cpu/ loaded (its backend `isa`)."""

    def __init__(self, isa: str):
        from kernels import cpu as cpu_ext
        self.name, self.ext = isa, cpu_ext
        self._told: set[tuple] = set()

    def _in_torch(self, op: str, *tensors) -> None:
        """A call the kernel could not take (a dtype or layout it does not read) runs in torch: said
        once per op and tensor kinds in the log, so a model that never reaches the kernels shows it.
        (Called at every such layer call: the key is plain tuples; only a new one is formatted.)"""
        key = (op, *((t.dtype, t.stride()) for t in tensors))
        if key not in self._told:
            self._told.add(key)
            log.warning("attention: %s in torch (kernels/torch_paged.py): the C kernel does not take %s",
                        op, ", ".join(f"{t.dtype} {tuple(t.stride())}" for t in tensors))

    def rotate(self, q, k, cos, sin):
        if self.ext.rotary_(q, k, cos, sin):
            return q, k
        self._in_torch("rotary", q, k, cos)
        return torch_paged.apply_rotary(q, k, cos, sin)

    def write(self, key_cache, value_cache, key, value, slots) -> None:
        if not self.ext.write_kv(key_cache, value_cache, key, value, slots):
            self._in_torch("the KV write", as_pool(key_cache).data, key)
            torch_paged.write_kv(key_cache, value_cache, key, value, slots)

    def forward(self, q, k, v, key_cache, value_cache, step, scale: float, *, cos=None, sin=None,
                window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        p: StepPlan = step.plan
        if cos is not None and p.all_decode and soft_cap is None and self.ext.supports(key_cache):
            out = self.ext.decode_fused(q, k, v, cos, sin, key_cache, value_cache, p.slots, p.dec_tables,
                                        p.dec_lens, scale, window)
            if out is not None:
                return out
        return super().forward(q, k, v, key_cache, value_cache, step, scale, cos=cos, sin=sin, window=window,
                               soft_cap=soft_cap)

    def attend(self, query, key_cache, value_cache, step, scale: float, window=None, soft_cap=None,
               key=None, value=None) -> torch.Tensor:
        p: StepPlan = step.plan
        t, h, d = query.shape
        dec = p.dec
        if dec and self.ext.supports(key_cache):    # every decode row in one call, reading the pool in place
            o = self.ext.decode_attention(query if p.all_decode else query[p.dec_rows], key_cache, value_cache,
                                          p.dec_tables, p.dec_lens, scale, window, soft_cap)
            if p.all_decode:    # one row per sequence, in order: the kernel's output is the answer
                return o.to(query.dtype)
            out = torch.empty(t, h, d, dtype=query.dtype)
            out[p.dec_rows] = o.to(query.dtype)
            dec = []
        else:
            if dec:
                self._in_torch("decode attention", as_pool(key_cache).data)
            out = torch.empty(t, h, d, dtype=query.dtype)
        torch_paged.decode_into(out, query, key_cache, value_cache, p, dec, scale, window, soft_cap)
        rest = p.chunks
        blocks = getattr(step, "blocks", None)    # rows attending both ways in blocks: the torch math's mask
        if rest and key is not None and window is None and soft_cap is None:
            # prompts and chunks after cached rows in one call (a chunk's earlier keys read from the pools,
            # as the plan gives them); not those whose rows attend both ways in blocks
            keep = [i for i, s in enumerate(rest) if not blocks or s not in blocks]
            seqs = [rest[i] for i in keep]
            ctx = None
            if p.prompt_ctx is not None:
                tables, held = p.prompt_tables, p.prompt_ctx
                if len(keep) < len(rest):
                    tables, held = tables[keep], held[keep]
                ctx = (key_cache, value_cache, tables, held)
            if seqs and self.ext.prefill_attention(query, key, value, [p.qsl[s] for s in seqs],
                                                   [p.qsl[s + 1] - p.qsl[s] for s in seqs], scale, out, ctx):
                rest = [s for s in rest if s not in seqs]
        torch_paged.prompts_into(out, query, key_cache, value_cache, p, rest, scale, window, soft_cap, key, value,
                                 blocks)
        return out

    def describe(self) -> str:
        b = self.ext.backend()
        return f"C kernels, {b.describe() if b is not None else self.name} (kernels/cpu/)"


class TritonAttention(TorchAttention):
    """CUDA: the Triton kernels; the torch math where a layer has a sliding window or a soft-cap."""

    name = "triton"
    needs_plan = False      # only the torch math's layers read it (where the model has windows or soft-caps)

    def write(self, key_cache, value_cache, key, value, slots) -> None:
        from kernels import triton_kernels
        triton_kernels.write_kv(as_pool(key_cache).data, as_pool(value_cache).data, key, value, slots)

    def attend(self, query, key_cache, value_cache, step, scale: float, window=None, soft_cap=None,
               key=None, value=None) -> torch.Tensor:
        if window is None and soft_cap is None and not getattr(step, "blocks", None):
            from kernels import triton_kernels
            return triton_kernels.paged_attention(query, as_pool(key_cache).data, as_pool(value_cache).data,
                                                  step.block_tables, step.seq_lens,
                                                  step.query_start_loc, scale)
        return super().attend(query, key_cache, value_cache, step, scale, window, soft_cap, key, value)

    def describe(self) -> str:
        return "Triton (kernels/triton_kernels.py)"


TORCH = TorchAttention()


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when `kernels.triton_kernels` (hence triton) imports on this machine."""
    try:
        from kernels import triton_kernels  # noqa: F401
    except Exception:  # ImportError, or a triton build that fails at import time
        return False
    return True


def backend_for(device) -> TorchAttention:
    """The attention backend for tensors on `device`: Triton on CUDA where it imports; on CPU the
    C kernels of the build kernels/cpu/ selected, where one loaded; else plain torch."""
    device = torch.device(device)
    if device.type == "cuda":
        return TritonAttention() if triton_available() else TORCH
    if device.type == "cpu":
        from kernels import cpu as cpu_ext
        fn = cpu_ext.load()
        if fn is not None:
            return CpuAttention(fn.backend.isa)
    return TORCH
