"""The CPU kernels: C sources in kernels/*.c (the generic layer) and one architecture folder
(kernels/x86/ or kernels/arm/), built on this host for one instruction set and loaded with ctypes. This package is their Python side, one job per module:

  build.py        compile and cache the library for a backend (plain Python)
  bindings.py     kernels/cpu_api.h parsed into ctypes types: entry points, structs, enums
  lib.py          the backend choice (option.cpu_kernels) and the loaded library (`CpuLib`)
  memory.py       huge-page-advised tensors for streamed weights, and where tensors sit
  args.py         what every op wrapper checks of the tensors it hands to C
  probes.py       how torch computes here (summing width, vectorised exp), so kernels can match it
  elementwise.py  RMSNorm, rotary, SiLU x up, the sampler's row statistics
  linear.py       packed weights and the GEMMs over them (fp32, bf16, int8, grouped 4/8-bit), and a
                  mixture-of-experts MLP's experts over a step's rows
  attention.py    paged attention (decode, prompts) and a whole step's layers

The names below are the public surface that the model layer and kernels/backends.py call (`from
kernels import cpu`); tests and tools reach a module's own names through that module.
"""
from __future__ import annotations

from kernels.cpu import elementwise as _elementwise
from kernels.cpu import lib as _lib
from kernels.cpu.args import KV_DTYPES
from kernels.cpu.attention import (decode_attention, decode_fused, encoder_attention,
                                   encoder_attention_available, prefill_attention,
                                   prefill_attention_available, step_layers, supports, write_kv)
from kernels.cpu.bindings import (LIN_BF16, LIN_BF16W, LIN_F32, LIN_I8, LIN_Q, QK_FULL, QK_HEAD, QK_NONE, QS_F16,
                                  QS_F32, QS_I8, Layer, Lin)
from kernels.cpu.elementwise import (rms_norm_bf16, rms_norm_f32, rms_norm_f32_lanes, rotary_, row_stats,
                                     silu_exact, silu_mul_, stream_read)
from kernels.cpu.lib import Backend, CpuLib, backend, cpu_flags, current, load
from kernels.cpu.linear import (PANEL, QPack, gemm, gemm_available, gemm_bf16, gemm_bf16_available,
                                gemm_bf16w_available, gemm_i8, gemm_i8_available, gemm_q, gemm_q_available,
                                moe_experts, moe_route, moe_shared, pack_bf16, pack_i8, pack_panels, q_act8_available,
                                q_row_bytes)
from kernels.cpu.memory import HUGE_PAGE, empty_hugepage, hugepage_placement, hugepages_wanted, thp_mode


def select(choice: str | None) -> tuple[str | None, str]:
    """lib.select (the backend for every later kernel call), and the per-backend checks made at
    first use (SiLU, RMSNorm widths) made again for the new one."""
    picked = _lib.select(choice)
    _elementwise.forget()
    return picked


__all__ = [
    "KV_DTYPES", "decode_attention", "decode_fused", "encoder_attention", "encoder_attention_available",
    "prefill_attention", "prefill_attention_available", "step_layers", "supports", "write_kv", "LIN_BF16", "LIN_BF16W", "LIN_F32",
    "LIN_I8", "LIN_Q", "QK_FULL", "QK_HEAD", "QK_NONE", "QS_F16", "QS_F32", "QS_I8", "Layer", "Lin",
    "rms_norm_bf16", "rms_norm_f32", "rms_norm_f32_lanes", "rotary_", "row_stats", "silu_exact", "silu_mul_",
    "stream_read", "Backend", "CpuLib", "backend", "cpu_flags", "current", "load", "PANEL", "QPack", "gemm",
    "gemm_available", "gemm_bf16", "gemm_bf16_available", "gemm_bf16w_available", "gemm_i8", "gemm_i8_available",
    "gemm_q", "gemm_q_available", "moe_experts", "moe_route", "moe_shared", "pack_bf16", "pack_i8", "pack_panels",
    "q_act8_available", "q_row_bytes", "HUGE_PAGE", "empty_hugepage", "hugepage_placement", "hugepages_wanted",
    "thp_mode", "select",
]
