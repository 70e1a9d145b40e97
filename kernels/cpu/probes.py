"""Probes that find how torch computes on this host, so that a kernel can reproduce it bit for bit:
the vector width of torch's fp32 sums (RMSNorm) and torch's vectorised exp (SiLU). Each takes the
kernel to check as an argument (kernels/cpu/elementwise.py owns the kernels and caches the answers)."""
from __future__ import annotations

import ctypes
import logging
import os

import torch

from kernels import isa as _isa

log = logging.getLogger("lmi.kernels")

TORCH_GRAIN = 32768   # at::internal::GRAIN_SIZE: torch reduces smaller inputs serially


def sum_lanes(rms, h: int) -> int:
    """The vector width (4 on aarch64's NEON torch, 8 on x86, 16) with which `rms(x, w, eps, lanes)`
    (the C RMSNorm) equals torch on random rows of H, or 0."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(h)
    cases = []
    for rows in sorted({1, 3, max(1, (TORCH_GRAIN - 1) // h), 3 * TORCH_GRAIN // h + 5}):   # torch serial, parallel
        for scale in (1e-3, 1.0, 30.0):
            cases.append((torch.randn(rows, h, generator=g) * scale, torch.randn(h, generator=g)))
    for lanes in (8, 16, 4):
        if all(torch.equal(rms(x, w, eps, lanes), w * F.rms_norm(x, (h,), eps=eps))
               for x, w in cases for eps in (1e-5, 1e-6)):
            return lanes
    log.info("fp32 RMSNorm over %d: no vector width reproduced torch's sums; torch's ops serve it", h)
    return 0


def sleef_expf() -> tuple[int, int] | None:
    """torch's Vectorized<float>::exp for the CPU capability it runs (Sleef_expf16_u10 on AVX512,
    Sleef_expf8_u10 on AVX2, Sleef_expf4_u10 on aarch64's NEON build) as (its address in the
    libtorch_cpu this process loaded, its lanes), or None (another capability: SVE, or x86 DEFAULT
    whose vectors call glibc's expf per lane)."""
    names = {("x86_64", "AVX512"): (("Sleef_expf16_u10",), 16), ("x86_64", "AVX2"): (("Sleef_expf8_u10",), 8),
             ("aarch64", "DEFAULT"): (("Sleef_expf4_u10", "Sleef_expf4_u10advsimd"), 4)}
    want = names.get((_isa.machine(), torch.backends.cpu.get_cpu_capability()))
    if want is None:
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    for name in want[0]:
        addr = ctypes.cast(getattr(lib, name, None) or 0, ctypes.c_void_p).value
        if addr:
            return addr, want[1]
    return None


def silu_matches(silu_mul_) -> bool:
    """Whether `silu_mul_` (the C SiLU) gives torch's values bit for bit at the current thread count, on
    rows of every split torch makes (a loop's vector body and scalar tail, one or several chunks) and on
    values whose exp under- or overflows."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for n in (1, 31, 33, 100, 1536, 32768 + 96, 57 * 1536 + 7, 50 * 1536):
            x = (torch.randn(n, generator=g) * 6).to(dt)
            x[:: 97] = 120.0
            x[1:: 89] = -120.0
            u = torch.randn(n, generator=g).to(dt)
            mine = x.clone()
            if not silu_mul_(mine, u):
                return False
            if not torch.equal(mine, F.silu(x.clone(), inplace=True).mul_(u)):
                log.info("kernels/cpu_layer.c's SiLU differs from torch's (%s, %d values): decode layers stay in "
                         "Python", dt, n)
                return False
    return True
