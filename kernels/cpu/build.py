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
the backend and a hash of its sources (the generic ones and its family's folder) and every header,
the flags, the compiler and the CPU's model and flags (cache_key: a cache carried to another CPU is
rebuilt, never run with instructions it lacks), written to a temporary file
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
# The generic layer, every build: drivers, layer stack, attention, KV (no instruction-set code); names
# under kernels/.
GENERIC = [("cpu_decode.c", FLAGS), ("cpu_exact.c", EXACT_FLAGS), ("cpu_gemm.c", EXACT_FLAGS),
           ("cpu_gemm_i8.c", EXACT_FLAGS), ("cpu_gemm_q4.c", EXACT_FLAGS), ("cpu_gemm_bf16.c", EXACT_FLAGS),
           ("cpu_layer.c", EXACT_FLAGS), ("cpu_kv.c", EXACT_FLAGS)]


def headers(root: str = SRC_DIR) -> list[str]:
    """Every header under kernels/ (the generic ones and any in an architecture folder)."""
    return sorted(glob.glob(os.path.join(root, "**", "*.h"), recursive=True))


def sources(isa: str, root: str = SRC_DIR) -> list[tuple[str, list[str]]]:
    """Every source of backend `isa`'s build with its flags: the generic layer, then its family's
    folder kernels/<family>/ (kernels/isa.py's family; each file in it rounding exactly as the GEMMs do)."""
    arch = sorted(glob.glob(os.path.join(root, _isa.family(isa), "*.c")))
    return [(os.path.join(root, name), flags) for name, flags in GENERIC] + [(path, EXACT_FLAGS) for path in arch]


def cache_key(isa: str, cc: str, root: str = SRC_DIR) -> str:
    """The build's name in the cache: a hash of its sources and every header (their paths under
    kernels/ and their bytes: a file changed or moved is a new build), the flags, the compiler's
    version and this CPU (a cache carried to another CPU is rebuilt)."""
    srcs = sources(isa, root)
    parts = []
    for path in [p for p, _ in srcs] + headers(root):
        with open(path, "rb") as f:
            parts.append(os.path.relpath(path, root).encode() + b"\0" + f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = " | ".join(" ".join(fl) for _, fl in srcs) + " | " + " ".join(LINK + _isa.compile_flags(isa))
    return hashlib.sha256(b"\0".join([*parts, flags.encode(), version.encode(),
                                      cpu_signature().encode()])).hexdigest()[:16]


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
    key = cache_key(isa, cc)
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
