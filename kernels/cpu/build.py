"""Compiling the C kernels for one instruction set, cached on disk: the generic layer (kernels/*.c)
and the architecture family's folder (kernels/x86/*.c or kernels/arm/*.c, kernels/isa.py's family).

One `cc` call per source of about a second (no torch headers): the target flags from kernels/isa.py
(`-march=native` on AVX-512 hosts, `-march=x86-64-v3` for avx2, `-march=armv8.2-a+dotprod` for neon),
`-ffast-math` for vectorised exp/tanh (glibc's libmvec) and reassociated dot products in the attention
kernels (compile step only: see LINK), `-fopenmp` whose libgomp.so.1 resolves at load time to the one
torch already loaded (same soname), so the kernels share torch's thread pool. kernels/cpu_exact.c, the
GEMM and layer sources and the architecture folders round exactly as transformers' torch ops do:
compiled without -ffast-math and without FMA contraction.

The shared object is cached under $LMI_CPU_EXT_CACHE (default ~/.cache/lmi-serve/kernels), named by
the backend and a hash of the sources (the generic ones, the family's folder and every header), the flags, the compiler and the CPU's model and flags (a cache
carried to another CPU is rebuilt, never run with instructions it lacks), written to a temporary file
and renamed, so concurrent workers and tensor-parallel ranks can build at once. Plain Python: no torch.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

from kernels import isa as _isa

SRC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # kernels/: the C sources
# The target (-march=...) comes from the backend (kernels/isa.py compile_flags).
FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC"]
# Element-wise ops that must round as torch's do (rotary): no fast-math, no FMA contraction.
EXACT_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC"]
# The generic layer, every build: drivers, layer stack, attention, KV (no instruction-set code).
GENERIC = [(os.path.join(SRC_DIR, "cpu_decode.c"), FLAGS), (os.path.join(SRC_DIR, "cpu_exact.c"), EXACT_FLAGS),
           (os.path.join(SRC_DIR, "cpu_gemm.c"), EXACT_FLAGS), (os.path.join(SRC_DIR, "cpu_gemm_i8.c"), EXACT_FLAGS),
           (os.path.join(SRC_DIR, "cpu_gemm_q4.c"), EXACT_FLAGS),
           (os.path.join(SRC_DIR, "cpu_gemm_bf16.c"), EXACT_FLAGS), (os.path.join(SRC_DIR, "cpu_layer.c"), EXACT_FLAGS),
           (os.path.join(SRC_DIR, "cpu_kv.c"), EXACT_FLAGS)]
HEADERS = sorted(glob.glob(os.path.join(SRC_DIR, "**", "*.h"), recursive=True))   # in the cache key


def arch_dir(isa: str) -> str:
    """kernels/<family>/: the architecture layer backend `isa` compiles (kernels/isa.py's family)."""
    return os.path.join(SRC_DIR, _isa.family(isa))


def sources(isa: str) -> list[tuple[str, list[str]]]:
    """Every source of backend `isa`'s build with its flags: the generic layer, then its family's
    folder (each file in it, rounding exactly as the GEMMs do)."""
    arch = sorted(glob.glob(os.path.join(arch_dir(isa), "*.c")))
    return GENERIC + [(path, EXACT_FLAGS) for path in arch]


# Linked without -ffast-math: given at link time, gcc adds crtfastmath.o, whose constructor sets
# flush-to-zero for the whole process on load (every float op of torch and Python would change).
LINK = ["-shared", "-fopenmp", "-lm"]


def cache_dir() -> str:
    return os.environ.get("LMI_CPU_EXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "lmi-serve", "kernels")


def cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            keep = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        import platform
        return platform.processor() or platform.machine()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(isa: str, out_dir: str | None = None, cc: str | None = None) -> str:
    """Compile the kernels for backend `isa` (kernels/isa.py) with `cc` (default: this host's
    compiler; a cross compiler builds a library this host cannot load), or reuse the cached build;
    returns the .so path. Raises RuntimeError naming what failed."""
    target = _isa.compile_flags(isa)
    srcs = sources(isa)
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    parts = []
    for path in [p for p, _ in srcs] + HEADERS:   # the names too: a file moved is a new build
        with open(path, "rb") as f:
            parts.append(os.path.relpath(path, SRC_DIR).encode() + b"\0" + f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = " | ".join(" ".join(fl) for _, fl in srcs) + " | " + " ".join(LINK + target)
    key = hashlib.sha256(b"\0".join([*parts, flags.encode(), version.encode(),
                                     cpu_signature().encode()])).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"lmi_cpu_{isa}-{key}.so")
    if os.path.isfile(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    objs = [f"{tmp[:-3]}.{i}.o" for i in range(len(srcs))]
    try:
        cmds = [[cc, *fl, *target, "-c", src, "-o", obj] for (src, fl), obj in zip(srcs, objs)]
        for cmd in cmds + [[cc, *objs, *LINK, "-o", tmp]]:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        for f in (tmp, *objs):
            if os.path.exists(f):
                os.unlink(f)
    return path
