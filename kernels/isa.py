"""Which instruction set the CPU kernels are built for: one backend per family, chosen once.

Plain Python (no torch): handler/config validates `option.cpu_kernels` with it, kernels/cpu/
builds and loads the library it names.

  avx512   x86-64 with AVX-512 F/BW/VL: today's kernels, built for this CPU (-march=native), so
           VNNI (int8) and AVX512-BF16 (bf16 dot products) are used where the CPU has them
  avx2     x86-64 with AVX2 + FMA (x86-64-v3: AMD Zen 1-3, Intel Haswell and later client CPUs):
           8-lane kernels; AVX-VNNI for int8 where the CPU lists it
  neon     aarch64 (Graviton, Apple Silicon, Ampere): NEON with the dot-product instructions
           (armv8.2-a+dotprod), bf16 / i8mm where the CPU lists them
  torch    no C kernels: PyTorch's own operators serve every layer

`auto` picks the first of avx512, avx2, neon the CPU runs (torch when none).
"""
from __future__ import annotations

import functools
import platform

ISAS = ("avx512", "avx2", "neon")
CHOICES = ("auto", *ISAS, "torch")

# What each backend needs in /proc/cpuinfo's flags (x86) or Features (aarch64).
_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "fma"}, "avx2": {"avx2", "fma"}, "neon": {"asimd"}}
_ARCH = {"avx512": "x86_64", "avx2": "x86_64", "neon": "aarch64"}
# The folder of kernels/ holding each backend's architecture layer (kernels/cpu_arch.h's functions).
_FAMILY = {"avx512": "x86", "avx2": "x86", "neon": "arm"}


def machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them ("flags" on x86, "Features" on Arm;
    empty where it cannot be read); read once (the kernels' callers ask per call)."""
    return frozenset(_read_flags())


def _read_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith(("flags", "Features")):
                    return set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    if machine() == "aarch64":      # macOS and others without /proc: every aarch64 CPU has NEON
        return {"asimd"}
    return set()


def runs(isa: str, flags: set[str] | None = None, arch: str | None = None) -> bool:
    """Whether this CPU (or the given flags / architecture) runs the `isa` build."""
    flags = cpu_flags() if flags is None else flags
    return (arch or machine()) == _ARCH[isa] and _NEEDS[isa] <= flags


def host_isas(flags: set[str] | None = None, arch: str | None = None) -> list[str]:
    """The backends this CPU runs, best first (an AVX-512 host also runs the avx2 build)."""
    return [i for i in ISAS if runs(i, flags, arch)]


def family(isa: str) -> str:
    """The architecture family of backend `isa`: the kernels/<family>/ folder its build compiles."""
    if isa not in _FAMILY:
        raise ValueError(f"unknown instruction set {isa!r}; allowed: {', '.join(ISAS)}")
    return _FAMILY[isa]


def compile_flags(isa: str, flags: set[str] | None = None) -> list[str]:
    """The compiler's target flags for a build of `isa` (the CPU's optional extensions added where
    it lists them)."""
    flags = cpu_flags() if flags is None else flags
    if isa == "avx512":
        return ["-march=native"]
    if isa == "avx2":
        return ["-march=x86-64-v3", "-mtune=generic"] + (["-mavxvnni"] if "avx_vnni" in flags else [])
    if isa == "neon":
        ext = "".join(f"+{e}" for e, flag in (("bf16", "bf16"), ("i8mm", "i8mm")) if flag in flags)
        return [f"-march=armv8.2-a+dotprod{ext}"]
    raise ValueError(f"unknown instruction set {isa!r}; allowed: {', '.join(ISAS)}")


@functools.lru_cache(maxsize=64)
def _resolve_here(choice: str | None) -> tuple[str | None, str]:
    return resolve(choice, cpu_flags())


def resolve_here(choice: str | None) -> tuple[str | None, str]:
    """resolve() for this CPU, remembered (asked on every kernel call); ValueError as resolve."""
    return _resolve_here(choice)


def resolve(choice: str | None, flags: set[str] | None = None, arch: str | None = None) -> tuple[str | None, str]:
    """option.cpu_kernels -> (the backend to build, or None for torch's operators; why), or
    ValueError naming the value and what this CPU runs."""
    c = (choice or "auto").strip().lower()
    avail = host_isas(flags, arch)
    shown = ", ".join(avail + ["torch"])
    if c not in CHOICES:
        raise ValueError(f"option.cpu_kernels={choice!r} is not supported; allowed: {', '.join(CHOICES)}")
    if c == "torch":
        return None, "option.cpu_kernels=torch"
    if c == "auto":
        if not avail:
            return None, f"auto: this CPU ({arch or machine()}) has none of avx512, avx2+fma, neon"
        best = avail[0]
        return best, f"auto: the best this CPU runs (of {shown})"
    if c not in avail:
        raise ValueError(f"option.cpu_kernels={c}: this CPU ({arch or machine()}) cannot run it "
                         f"(needs {' '.join(sorted(_NEEDS[c]))}); it runs: {shown}")
    return c, f"option.cpu_kernels={c}"
