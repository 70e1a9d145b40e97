"""Which C backend serves this process, and its loaded library.

Backends (kernels/isa.py): avx512, avx2, neon, or torch (no C kernels), chosen once per process
(`select`, from option.cpu_kernels; else LMI_CPU_KERNELS; else the best the CPU runs). `load()` builds
(kernels/cpu/build.py) and loads the chosen backend's library once: a `CpuLib` holding every entry
point of kernels/cpu_api.h, typed, and what it runs on this CPU. No compiler, a failed build or the
`torch` backend: `load()` returns None and torch's operators serve (a failed build warns once, saying
why). `handler.model.runner` selects and loads the backend at start-up so no request pays for the build.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os

from kernels import isa as _isa
from kernels.cpu import build as _build
from kernels.cpu.bindings import API

log = logging.getLogger("lmi.kernels")

_choice: str | None = None      # select()'s argument; None: LMI_CPU_KERNELS (default auto)
_current: tuple[str | None, str] | None = None   # current()'s answer until select() or load.cache_clear()


def cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return _isa.cpu_flags()


def select(choice: str | None) -> tuple[str | None, str]:
    """Choose the backend (option.cpu_kernels: auto | avx512 | avx2 | neon | torch; None: back to
    LMI_CPU_KERNELS / auto) for every later kernel call of this process; returns (backend or None
    for torch, why). ValueError (one line) where this CPU cannot run it. kernels.cpu.select also
    drops the per-backend checks made at first use (SiLU, RMSNorm widths)."""
    global _choice
    picked = _isa.resolve_here(choice if choice is not None else os.environ.get("LMI_CPU_KERNELS"))
    _choice = choice
    _forget()
    return picked


def current() -> tuple[str | None, str]:
    """(the backend load() uses, or None for torch's operators; why); the environment is read once
    (every kernel call asks)."""
    global _current
    if _current is None:
        try:
            _current = _isa.resolve_here(_choice if _choice is not None else os.environ.get("LMI_CPU_KERNELS"))
        except ValueError as e:
            _current = None, str(e)
    return _current


def build(cache_dir: str | None = None, isa: str | None = None, cc: str | None = None) -> str:
    """kernels/cpu/build.py's build for `isa` (default: the backend chosen; avx512 under torch)."""
    return _build.build(isa or current()[0] or "avx512", cache_dir, cc)


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one backend's library runs on this CPU, found once at load."""
    isa: str
    gemm: bool          # fp32 panels (kernels/cpu_gemm.c)
    gemm_bf16: bool     # bf16 dot products (AVX512-BF16 vdpbf16ps)
    gemm_bf16w: bool    # bf16 weights widened in registers, fp32 FMAs
    gemm_i8: bool       # int8 weights and activations (kernels/cpu_gemm_i8.c)
    gemm_q: bool        # grouped 4/8-bit weights (kernels/cpu_gemm_q4.c)

    def describe(self) -> str:
        kinds = [name for name, on in (("fp32", self.gemm), ("bf16 dot", self.gemm_bf16), ("bf16 widened", self.gemm_bf16w),
                                       ("int8", self.gemm_i8), ("4/8-bit", self.gemm_q)) if on]
        return f"{self.isa} ({', '.join(kinds) or 'attention only'})"


class CpuLib:
    """One backend's loaded library: each entry point of kernels/cpu_api.h as an attribute named
    without its `lmi_` prefix (typed from the header), and what it runs here: the `*_available`
    flags and `backend`, their record."""

    def __init__(self, isa: str, path: str):
        self.dll = ctypes.CDLL(path)
        for name, (restype, argtypes) in API.items():
            f = getattr(self.dll, name)
            f.restype, f.argtypes = restype, argtypes
            setattr(self, name.removeprefix("lmi_"), f)
        self.gemm_available = bool(self.dll.lmi_gemm_available())
        self.gemm_i8_available = bool(self.dll.lmi_gemm_i8_available())
        self.gemm_q_available = bool(self.dll.lmi_gemm_q_available())
        self.q_act8_available = bool(self.dll.lmi_gemm_q_act8_available())
        self.gemm_bf16_available = (bool(self.dll.lmi_gemm_bf16_available())
                                    and (isa != "avx512" or "avx512_bf16" in cpu_flags()))
        self.gemm_bf16w_available = bool(self.dll.lmi_gemm_bf16w_available())
        self.backend = Backend(isa, self.gemm_available, self.gemm_bf16_available, self.gemm_bf16w_available,
                               self.gemm_i8_available, self.gemm_q_available)


def load() -> CpuLib | None:
    """The chosen backend's library, or None when torch's operators must serve."""
    isa = current()[0]
    return None if isa is None else _load(isa)


@functools.lru_cache(maxsize=None)
def _load(isa: str) -> CpuLib | None:
    try:
        return CpuLib(isa, build(isa=isa))
    except Exception as e:   # no compiler, read-only cache, a flag this compiler refuses
        log.warning("CPU kernels (%s) unavailable (%s); the plain-torch path serves", isa, e)
        return None


def _forget() -> None:
    global _current
    _current = None


def _clear() -> None:
    """Forget the loaded libraries and the environment read (tests change both)."""
    _forget()
    _load.cache_clear()


load.cache_clear = _clear


def backend() -> Backend | None:
    """The chosen backend's record, or None where torch's operators serve."""
    fn = load()
    return None if fn is None else fn.backend

