"""Element-wise and row ops in C (kernels/cpu_exact.c, cpu_layer.c): RMSNorm, rotary, SiLU x up, the
sampler's row statistics, the read-stream probe. Each returns None / False where it cannot take its
tensors, and the caller's torch ops serve; the fp32 ones give torch's values bit for bit (the widths
torch sums and exponentiates in are found once per backend by kernels/cpu/probes.py)."""
from __future__ import annotations

import functools
import logging

import torch

from kernels.cpu import probes
from kernels.cpu.args import KV_DTYPES, plain as _plain
from kernels.cpu.lib import load
from kernels.cpu.probes import TORCH_GRAIN

log = logging.getLogger("lmi.kernels")

def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Llama's RMSNorm of bf16 x [..., H] by weight [H] (bf16), or None when the kernel cannot
    take them (then the caller's own path serves). torch's rms_norm has no fused bf16 CPU kernel
    (it decomposes into ~7 ops with fp32 copies). fp32 has its own kernel, `rms_norm_f32`, which
    sums in torch's order so that its values stay transformers' bit for bit."""
    fn = load()
    h = x.shape[-1]
    if (fn is None or not _plain(x, torch.bfloat16) or weight.dtype != torch.bfloat16
            or weight.device.type != "cpu" or weight.shape != (h,) or not x.is_contiguous()
            or not weight.is_contiguous()):
        return None
    out = torch.empty_like(x)
    fn.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, float(eps),
                     torch.get_num_threads())
    return out


_RMS_F32_LANES: dict[int, int] = {}   # hidden size -> the vector width whose sum order is torch's (0: none)


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """`weight * F.rms_norm(x, (H,), eps=eps)` for fp32 x [..., H] in one call, bit for bit
    torch's values (kernels/cpu_exact.c sums in torch's order); None when it does not apply
    (then the caller's torch ops serve): not fp32 / not contiguous, rows x H at or over torch's
    parallel grain (where torch's own order may split), or no vector width reproduced torch's
    sums at the first-use check for this H. torch's summing width is found by trying: on this
    build's AVX-512 hosts its sum kernel runs 8-lane vectors. The point is the call count: torch's
    CPU rms_norm runs ~7 ops, ~25 us a call at a decode step's few rows."""
    fn = load()
    h = x.shape[-1]
    if (fn is None or not _plain(x, torch.float32) or not x.is_contiguous() or x.numel() == 0
            or x.numel() >= TORCH_GRAIN or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.shape != (h,) or not weight.is_contiguous()):
        return None
    lanes = rms_norm_f32_lanes(h)
    return _rms_f32(fn, x, weight, eps, lanes) if lanes else None


def rms_norm_f32_lanes(h: int) -> int:
    """The summing width with which rms_norm_f32 gives torch's values over rows of `h` (found once),
    0 where none does or the kernel is not built."""
    fn = load()
    if fn is None:
        return 0
    lanes = _RMS_F32_LANES.get(h)
    if lanes is None:
        lanes = _RMS_F32_LANES[h] = probes.sum_lanes(functools.partial(_rms_f32, fn), h)
    return lanes


def _rms_f32(fn, x, weight, eps, lanes):
    h = x.shape[-1]
    out = torch.empty_like(x)
    scratch = torch.empty(h, dtype=torch.float32)
    fn.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, float(eps), lanes,
                    scratch.data_ptr())
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """In place, Llama's rotary embedding of q [T, H, D] and k [T, Hkv, D] (each token's heads
    contiguous) by cos/sin [T, D], all fp32 or all bf16, rounded exactly as transformers'
    `apply_rotary_pos_emb` rounds; False (nothing changed) when the kernel cannot take them."""
    fn = load()
    dt = q.dtype
    if fn is None or dt not in KV_DTYPES or not all(_plain(t, dt) for t in (q, k, cos, sin)):
        return False
    t, h, d = q.shape
    if (k.dim() != 3 or k.shape[0] != t or k.shape[2] != d or d % 2 or cos.shape != (t, d)
            or sin.shape != (t, d) or cos.stride() != sin.stride() or cos.stride(1) != 1
            or q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1)):
        return False
    fn.rotary(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h, k.shape[1], d,
              q.stride(0), k.stride(0), cos.stride(0), KV_DTYPES[dt], torch.get_num_threads())
    return True


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For fp32 logits [R, V] (CPU, rows contiguous), in one read of each row: (argmax [R] int64,
    the first index of each row's maximum as torch.argmax picks it; max [R]; logsum [R], the log of
    sum exp(x - max)), so that log_softmax(x)[r, t] = (x[r, t] - max[r]) - logsum[r]. None when the
    kernel cannot take them (another device or dtype, no kernel) or a row holds a NaN or infinite
    logit (then torch's own ops serve, with their semantics)."""
    if not _plain(logits, torch.float32) or logits.dim() != 2 or logits.stride(1) != 1 or 0 in logits.shape:
        return None
    fn = load()
    if fn is None:
        return None
    r, v = logits.shape
    idx = torch.empty(r, dtype=torch.int64)
    m, logsum = torch.empty(r, dtype=torch.float32), torch.empty(r, dtype=torch.float32)   # float* in C
    fn.row_stats(logits.data_ptr(), r, v, logits.stride(0), idx.data_ptr(), m.data_ptr(), logsum.data_ptr(),
                 torch.get_num_threads())
    if not bool(torch.isfinite(logsum).all()):
        return None
    return idx, m, logsum


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """In place gate <- silu(gate) * up (contiguous, both fp32 or both bf16) by kernels/cpu_layer.c,
    meant to round as `F.silu(gate, inplace=True).mul_(up)` does; False (nothing changed) where it
    cannot run (no kernel, torch's Sleef not found, or torch's vectors another width than the
    build's). `silu_exact()` says whether it does."""
    fn = load()
    dt = gate.dtype
    if (fn is None or dt not in KV_DTYPES or up.dtype != dt or up.shape != gate.shape or not gate.is_contiguous()
            or not up.is_contiguous() or not _plain(gate, dt) or not _plain(up, dt) or not _silu_ready()):
        return False
    fn.silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), KV_DTYPES[dt], torch.get_num_threads())
    return True


@functools.lru_cache(maxsize=None)
def _silu_ready() -> bool:
    """Hands torch's Sleef exp to the loaded build; False where its width is not the build's
    (an avx2 build beside torch's AVX512 kernels: set ATEN_CPU_CAPABILITY=avx2 to pair them)."""
    fn = load()
    found = probes.sleef_expf()
    if fn is None or found is None:
        return False
    fn.set_sleef_expf(*found)
    return bool(fn.silu_available())


@functools.lru_cache(maxsize=None)
def silu_exact(threads: int) -> bool:
    """Whether silu_mul_ gives torch's values bit for bit at `threads` threads (checked once)."""
    return probes.silu_matches(silu_mul_)


def stream_read(x: torch.Tensor, ahead: int = 0) -> float | None:
    """Sum a contiguous fp32 tensor with kernels/cpu_gemm.c's read-stream probe over torch's threads
    (what `bench floor` times), prefetching `ahead` floats early (0: none); None where the C kernels
    do not load."""
    fn = load()
    if fn is None:
        return None
    return fn.stream_read(x.data_ptr(), x.numel(), ahead, torch.get_num_threads())


def forget() -> None:
    """Drop the per-backend answers (kernels.cpu.select chose another backend)."""
    _silu_ready.cache_clear()
    silu_exact.cache_clear()
    _RMS_F32_LANES.clear()
