"""The CPU kernels (kernels/*.c): built on this host for one instruction set, loaded with ctypes.

Backends (kernels/isa.py): avx512, avx2, neon, or torch (no C kernels), chosen once per process
(`select`, from option.cpu_kernels; else LMI_CPU_KERNELS; else the best the CPU runs). One library
per backend, built by one `cc` call per source of about a second (no torch headers): the target
flags from kernels/isa.py (`-march=native` on AVX-512 hosts, `-march=x86-64-v3` for avx2,
`-march=armv8.2-a+dotprod` for neon), `-ffast-math` for vectorised exp/tanh (glibc's libmvec) and
reassociated dot products in the attention kernels (compile step only: see LINK), `-fopenmp`
whose libgomp.so.1 resolves at load time to the one torch already loaded (same soname), so the
kernels share torch's thread pool. The panel GEMMs sum each output in k order by FMAs from 0 on
every backend, so their values do not depend on the instruction set (tests compare the builds).

Decode rows read the paged pool in place instead of gathering their blocks into a copy that a
batched matmul then reads again (kernels/reference.py). The sampler gets each row's argmax and
log-sum-exp in one read of the logits (`row_stats`). kernels/cpu_exact.c and the GEMM and layer
sources round exactly as transformers' torch ops do: compiled without -ffast-math and without
FMA contraction.

The shared object is cached under $LMI_CPU_EXT_CACHE (default ~/.cache/lmi-serve/kernels),
named by the backend and a hash of the sources, the flags, the compiler and the CPU's model and
flags (a cache carried to another CPU is rebuilt, never run with instructions it lacks), written
to a temporary file and renamed, so concurrent workers and tensor-parallel ranks can build at once.

No compiler, a failed build or the `torch` backend: `load()` returns None and the reference path
serves (a failed build warns once, saying why). `handler.model.runner` selects and loads the
backend at start-up so no request pays for the build.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import mmap
import os
import re
import shutil
import subprocess
import tempfile
import weakref

import torch

from kernels import isa as _isa
from kernels import reference
from kernels.step import prompt_table

log = logging.getLogger("lmi.kernels")

_HERE = os.path.dirname(os.path.abspath(__file__))
# The target (-march=...) comes from the backend (kernels/isa.py compile_flags).
FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC"]
# Element-wise ops that must round as torch's do (rotary): no fast-math, no FMA contraction.
EXACT_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC"]
SOURCES = [(os.path.join(_HERE, "cpu_decode.c"), FLAGS), (os.path.join(_HERE, "cpu_exact.c"), EXACT_FLAGS),
           (os.path.join(_HERE, "cpu_gemm.c"), EXACT_FLAGS), (os.path.join(_HERE, "cpu_gemm_i8.c"), EXACT_FLAGS),
           (os.path.join(_HERE, "cpu_gemm_q4.c"), EXACT_FLAGS),
           (os.path.join(_HERE, "cpu_gemm_bf16.c"), EXACT_FLAGS), (os.path.join(_HERE, "cpu_layer.c"), EXACT_FLAGS)]
HEADERS = sorted(os.path.join(_HERE, f) for f in os.listdir(_HERE) if f.endswith(".h"))   # in the cache key
# Linked without -ffast-math: given at link time, gcc adds crtfastmath.o, whose constructor sets
# flush-to-zero for the whole process on load (every float op of torch and Python would change).
LINK = ["-shared", "-fopenmp", "-lm"]
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> str:
    return os.environ.get("LMI_CPU_EXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                "lmi-serve", "kernels")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            keep = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        import platform
        return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return _isa.cpu_flags()


# ---------------------------------------------------------------------------- the bindings, from kernels/cpu_api.h
_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float,
            "double": ctypes.c_double}


def _parse_api(text: str) -> tuple[dict, dict, dict]:
    """kernels/cpu_api.h -> ({entry point: (restype, argtypes)}, {struct name: ctypes.Structure},
    {enum constant: value}). Pointers of any type are c_void_p (callers pass data_ptr()s)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    enums = {k: int(v) for body in re.findall(r"enum\s*\{([^}]*)\}", text)
             for k, v in re.findall(r"(\w+)\s*=\s*(-?\d+)", body)}
    structs: dict = {}

    def ctype(decl: str):
        words = decl.replace("const ", " ").split()
        if "*" in decl:
            return ctypes.c_void_p
        base = words[0]
        if base in structs:
            return structs[base]
        if base not in _C_TYPES:
            raise ValueError(f"kernels/cpu_api.h: no ctypes type for {decl!r}")
        return _C_TYPES[base]

    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+);", text, flags=re.S):
        fields = []
        for line in body.split(";"):
            line = line.strip()
            if not line:
                continue
            base, _, names = line.replace("const ", "").partition(" ")
            for n in names.split(","):
                n = n.strip()
                fields.append((n.lstrip("*"), ctype(f"{base} {n}")))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"kernels/cpu_api.h's {name}"})
    api = {}
    for ret, name, args in re.findall(r"^\s*(int|void|float)\s+(lmi_\w+)\(([^)]*)\);", text, flags=re.M):
        params = [a.strip() for a in args.split(",") if a.strip() not in ("", "void")]
        api[name] = (None if ret == "void" else _C_TYPES[ret], [ctype(a) for a in params])
    return api, structs, enums


with open(os.path.join(_HERE, "cpu_api.h")) as _f:
    API, _STRUCTS, _ENUM = _parse_api(_f.read())


# ---------------------------------------------------------------------------- the backend choice
_choice: str | None = None      # select()'s argument; None: LMI_CPU_KERNELS (default auto)


def select(choice: str | None) -> tuple[str | None, str]:
    """Choose the backend (option.cpu_kernels: auto | avx512 | avx2 | neon | torch; None: back to
    LMI_CPU_KERNELS / auto) for every later kernel call of this process; returns (backend or None
    for torch, why). ValueError (one line) where this CPU cannot run it. The per-backend checks
    made at first use (SiLU, RMSNorm widths) are made again for the new one."""
    global _choice
    picked = _isa.resolve_here(choice if choice is not None else os.environ.get("LMI_CPU_KERNELS"))
    _choice = choice
    _forget()
    _silu_ready.cache_clear()
    silu_exact.cache_clear()
    _RMS_F32_LANES.clear()
    return picked


_current: tuple[str | None, str] | None = None   # current()'s answer until select() or load.cache_clear()


def current() -> tuple[str | None, str]:
    """(the backend load() uses, or None for torch's operators; why); the environment is read once
    (every kernel call asks)."""
    global _current
    if _current is None:
        _current = _current_now()
    return _current


def _current_now() -> tuple[str | None, str]:
    try:
        return _isa.resolve_here(_choice if _choice is not None else os.environ.get("LMI_CPU_KERNELS"))
    except ValueError as e:
        return None, str(e)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(cache_dir: str | None = None, isa: str | None = None, cc: str | None = None) -> str:
    """Compile the kernels for backend `isa` (default: the one chosen; kernels/isa.py) with `cc`
    (default: this host's compiler; a cross compiler builds a library this host cannot load), or
    reuse the cached build; returns the .so path. Raises RuntimeError naming what failed."""
    isa = isa or current()[0] or "avx512"
    target = _isa.compile_flags(isa)
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    parts = []
    for path in [p for p, _ in SOURCES] + HEADERS:
        with open(path, "rb") as f:
            parts.append(f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    flags = " | ".join(" ".join(fl) for _, fl in SOURCES) + " | " + " ".join(LINK + target)
    key = hashlib.sha256(b"\0".join([*parts, flags.encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    out_dir = cache_dir or _cache_dir()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"lmi_cpu_{isa}-{key}.so")
    if os.path.isfile(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    objs = [f"{tmp[:-3]}.{i}.o" for i in range(len(SOURCES))]
    try:
        cmds = [[cc, *fl, *target, "-c", src, "-o", obj] for (src, fl), obj in zip(SOURCES, objs)]
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


def load():
    """The chosen backend's library (a ctypes function with the others as attributes, and
    `.backend`, its Backend record), or None when torch's operators must serve."""
    isa = current()[0]
    return None if isa is None else _load(isa)


@functools.lru_cache(maxsize=None)
def _load(isa: str):
    try:
        lib = ctypes.CDLL(build(isa=isa))
    except Exception as e:   # no compiler, read-only cache, a flag this compiler refuses
        log.warning("CPU kernels (%s) unavailable (%s); the plain-torch path serves", isa, e)
        return None
    fn = lib.lmi_decode_attention
    for name, (restype, argtypes) in API.items():    # every entry point, typed from kernels/cpu_api.h
        f = getattr(lib, name)
        f.restype, f.argtypes = restype, argtypes
        setattr(fn, name.removeprefix("lmi_"), f)
    fn.gemm_available = bool(lib.lmi_gemm_available())
    fn.gemm_i8_available = bool(lib.lmi_gemm_i8_available())
    fn.gemm_q_available = bool(lib.lmi_gemm_q_available())
    fn.q_act8_available = bool(lib.lmi_gemm_q_act8_available())
    flags = _cpu_flags()
    fn.gemm_bf16_available = bool(lib.lmi_gemm_bf16_available()) and (isa != "avx512" or "avx512_bf16" in flags)
    fn.gemm_bf16w_available = bool(lib.lmi_gemm_bf16w_available())
    fn.backend = Backend(isa, fn.gemm_available, fn.gemm_bf16_available, fn.gemm_bf16w_available,
                         fn.gemm_i8_available, fn.gemm_q_available)
    return fn


def _forget() -> None:
    global _current
    _current = None


def _clear() -> None:
    """Forget the loaded libraries and the environment read (tests change both)."""
    _forget()
    _load.cache_clear()


load.cache_clear = _clear


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


def backend() -> Backend | None:
    """The chosen backend's record, or None where torch's operators serve."""
    fn = load()
    return None if fn is None else fn.backend


def supports(key_cache: torch.Tensor) -> bool:
    """Whether the kernel reads this pool: a CPU tensor of fp32/bf16, or int8 with its row scales
    (reference.kv_scale), with the head dim contiguous."""
    if key_cache.device.type != "cpu" or key_cache.stride(-1) != 1:
        return False
    return key_cache.dtype in KV_DTYPES or _i8_pool(key_cache)


def _i8_pool(cache: torch.Tensor) -> bool:
    """An int8 pool [NB, bs, Hkv, D] whose scales [NB, bs, Hkv] lie at its element offsets / D."""
    sc = reference.kv_scale(cache)
    return (cache.dtype == torch.int8 and sc is not None and sc.dtype == torch.float32
            and sc.shape == cache.shape[:3] and all(a * cache.shape[3] == b for a, b in zip(sc.stride(), cache.stride()[:3])))


def _plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU tensor of `dtype` the kernels may take as input: none that autograd tracks (the kernels
    have no backward; weights are only read, so they may be parameters)."""
    return t.dtype == dtype and t.device.type == "cpu" and not t.requires_grad


# ---------------------------------------------------------------------------- weights in huge pages
# A 1-row decode step streams every weight once: ~2 GB of fp32 over ~500k 4 KiB pages, a TLB miss
# each. Where THP is `madvise` (the common default), only memory advised MADV_HUGEPAGE before its
# first touch is faulted in 2 MiB pages, so the packers below allocate what a step streams here
# (benchmarks/results/hugepages/: on 2 Zen 4 cores a plain read loop streams 14-41% faster, the
# 1-row GEMMs of a Qwen 0.5B step 1-10% (fp32) and 8-28% (int8, grouped 4/8-bit)). Faulting them
# in may compact memory first (defrag=madvise): a slower load, about 1 s per GB at worst here.
HUGE_PAGE = 2 << 20
_HP_OFF = ("0", "false", "no", "off")
_HP_ON = ("auto", "1", "true", "yes", "on", "")
_hp_state: dict = {"warned": False, "refused": None}


def hugepages_wanted(env=None) -> bool:
    """LMI_CPU_HUGEPAGES (handler/config/switches.py): `auto` (default) places the weights a step
    streams in huge-page-advised memory where the OS takes the advice (Linux); `0` keeps torch's
    allocator. Another value warns once and keeps auto."""
    raw = (os.environ if env is None else env).get("LMI_CPU_HUGEPAGES", "auto").strip().lower()
    if raw in _HP_OFF:
        return False
    if raw not in _HP_ON and not _hp_state["warned"]:
        _hp_state["warned"] = True
        log.warning("LMI_CPU_HUGEPAGES=%r: allowed values are auto, 0; using auto", raw)
    return hasattr(mmap, "MADV_HUGEPAGE") and _hp_state["refused"] is None


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's THP mode (always | madvise | never: the bracketed word), None where unknown."""
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def empty_hugepage(shape, dtype: torch.dtype = torch.float32, *, advise: bool | None = None) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor for a weight that is streamed every step; the caller
    writes its values. advise None: hugepages_wanted() decides (off: torch.empty). advise True, at
    or over one huge page (2 MiB): its data starts on a 2 MiB boundary of a fresh private anonymous
    mapping whose whole 2 MiB pages are advised MADV_HUGEPAGE before anything touches them; the
    partial tail keeps 4 KiB pages (no huge page half used). advise False: the same mapping advised
    MADV_NOHUGEPAGE (4 KiB pages even where THP is `always`; benchmarks' control arm). Under 2 MiB,
    or without madvise: torch.empty. Where the kernel refuses the advice (no THP) the mapping stays
    as it is, and later calls go to torch.empty (logged once)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if advise is None:
        advise = hugepages_wanted() or None
    if advise is None or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # private: an anonymous MAP_SHARED mapping is shmem, which THP `madvise` leaves in 4 KiB pages
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # 4 KiB aligned
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    off = -base % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE if advise else mmap.MADV_NOHUGEPAGE, off, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError as e:                           # a kernel without THP
        if _hp_state["refused"] is None:
            log.info("huge pages: madvise refused (%s); weights stay in 4 KiB pages", e)
        _hp_state["refused"] = str(e)
    if advise:
        _advised[base + off] = buf          # the advised range [start, start + whole pages), while buf lives
        _advised_len[base + off] = nbytes // HUGE_PAGE * HUGE_PAGE
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=off)   # holds `buf`
    return t.view(dtype).view(shape)


# empty_hugepage's live advised ranges: start -> the mapping (weakly: gone with its last tensor), and
# start -> length. hugepage_placement counts these only: other memory of the process can carry the
# VMA flag too (seen in a long test run: torch's own tensors in `hg` mappings).
_advised: "weakref.WeakValueDictionary[int, mmap.mmap]" = weakref.WeakValueDictionary()
_advised_len: dict[int, int] = {}


def _advised_ranges() -> list[tuple[int, int]]:
    live = sorted(_advised.keys())
    for start in [s for s in _advised_len if s not in _advised]:
        del _advised_len[start]
    return [(s, s + _advised_len[s]) for s in live if s in _advised_len]


def _smaps(path: str = "/proc/self/smaps") -> list[tuple[int, int, bool, int, int]]:
    """This process's mappings: (start, end, advised MADV_HUGEPAGE (VmFlags hg), Rss KiB,
    AnonHugePages KiB), by address; [] where smaps cannot be read (not Linux)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    out, cur = [], None
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            cur = [int(m.group(1), 16), int(m.group(2), 16), False, 0, 0]
            out.append(cur)
        elif cur is not None:
            key, _, val = line.partition(":")
            if key == "Rss":
                cur[3] = int(val.split()[0])
            elif key == "AnonHugePages":
                cur[4] = int(val.split()[0])
            elif key == "VmFlags":
                cur[2] = "hg" in val.split()
    return [tuple(c) for c in out]


def hugepage_placement(tensors, maps=None) -> dict:
    """Where CPU tensors' data sit: {"tensors", "bytes", "advised_bytes" (the part of those bytes in
    mappings advised MADV_HUGEPAGE: empty_hugepage's whole 2 MiB pages), "huge_kib" (AnonHugePages
    of those advised mappings: what the kernel did place in 2 MiB pages), "rss_kib" (of every
    mapping the tensors touch)}. One read of /proc/self/smaps; a mapping counts once."""
    import bisect
    maps = _smaps() if maps is None else maps
    starts = [m[0] for m in maps]
    ours = [r for r in _advised_ranges() if any(a <= r[0] < b and adv for a, b, adv, *_ in maps)]
    res = {"tensors": 0, "bytes": 0, "advised_bytes": 0, "huge_kib": 0, "rss_kib": 0}
    seen: set[int] = set()
    for t in tensors:
        if t is None or t.device.type != "cpu":
            continue
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        res["tensors"] += 1
        res["bytes"] += hi - lo
        for a, b in ours:
            if a < hi and b > lo:
                res["advised_bytes"] += min(b, hi) - max(a, lo)
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(maps) and maps[i][0] < hi:
            a, b, advised, rss, huge = maps[i]
            if b > lo and i not in seen:
                seen.add(i)
                res["rss_kib"] += rss
                mine = advised and any(x < b and y > a for x, y in ours)
                res["huge_kib"] += huge if mine else 0
            i += 1
    return res


PANEL = 32   # output columns per panel of a packed weight (kernels/cpu_gemm.c)


def gemm_available() -> bool:
    """Whether kernels/cpu_gemm.c's fp32 panel GEMM runs here (the avx512, avx2 and neon builds)."""
    fn = load()
    return fn is not None and fn.gemm_available


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's fp32 weight [N, K] -> its panels for `gemm` (a flat fp32 tensor, zero padded
    to a multiple of 32 output columns)."""
    fn = load()
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = empty_hugepage(-(-n // PANEL) * PANEL * k, torch.float32)
    fn.pack_b(w.data_ptr(), n, k, out.data_ptr())
    return out


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 @ the packed weight's transpose (+ bias [N], fp32) -> [..., N] fp32: each
    output summed in k order by fused multiply-adds (kernels/cpu_gemm.c)."""
    k = x.shape[-1]
    if k == 0:      # an empty sum: the bias alone (the kernel sizes its row chunks by k)
        return torch.zeros(*x.shape[:-1], n, dtype=torch.float32) + (0 if bias is None else bias)
    a = x.reshape(-1, k)
    m = a.shape[0]
    if a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        load().gemm(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, panels.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


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


TORCH_GRAIN = 32768   # at::internal::GRAIN_SIZE: torch reduces smaller inputs serially
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
        lanes = _RMS_F32_LANES[h] = _torch_sum_lanes(fn, h)
    return lanes


def _rms_f32(fn, x, weight, eps, lanes):
    h = x.shape[-1]
    out = torch.empty_like(x)
    scratch = torch.empty(h, dtype=torch.float32)
    fn.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // h, h, float(eps), lanes,
                    scratch.data_ptr())
    return out


def _torch_sum_lanes(fn, h: int) -> int:
    """The vector width (4 on aarch64's NEON torch, 8 on x86, 16) with which the C kernel equals torch on
    random rows of H, or 0."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(h)
    cases = []
    for rows in sorted({1, 3, max(1, (TORCH_GRAIN - 1) // h), 3 * TORCH_GRAIN // h + 5}):   # torch serial, parallel
        for scale in (1e-3, 1.0, 30.0):
            cases.append((torch.randn(rows, h, generator=g) * scale, torch.randn(h, generator=g)))
    for lanes in (8, 16, 4):
        if all(torch.equal(_rms_f32(fn, x, w, eps, lanes), w * F.rms_norm(x, (h,), eps=eps))
               for x, w in cases for eps in (1e-5, 1e-6)):
            return lanes
    log.info("fp32 RMSNorm over %d: no vector width reproduced torch's sums; torch's ops serve it", h)
    return 0


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


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Store key/value [T, Hkv, D] at slot_mapping [T] (< 0: skip) in place, as
    reference.write_kv does; False (nothing written) when the kernel cannot take these tensors."""
    fn = load()
    if key_cache.dtype == torch.int8:
        return _write_kv_i8(fn, key_cache, value_cache, key, value, slot_mapping)
    if (fn is None or not supports(key_cache) or key.dtype != key_cache.dtype
            or not _kv_rows_fit(key_cache, value_cache, key, value)):
        return False
    t, hkv, d = key.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (t,):
        return False
    nb, bs = key_cache.shape[:2]
    rc = fn.write_kv(key_cache.data_ptr(), value_cache.data_ptr(), key.data_ptr(), value.data_ptr(),
                     key_cache.element_size(), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                     key.stride(0), key.stride(1), value.stride(0), value.stride(1), slots.data_ptr(),
                     t, hkv, d, bs, nb * bs)
    if rc != 0:
        raise IndexError(f"write_kv: a slot is past the pool's {nb * bs} slots")
    return True


def _kv_rows_fit(key_cache, value_cache, key, value) -> bool:
    """The checks every KV write makes: pools laid out alike, CPU rows of one dtype, contiguous
    in the head dimension, shaped [tokens, kv_heads, head_dim] to fit the pool's rows."""
    return (key_cache.stride() == value_cache.stride() and value.dtype == key.dtype
            and key.device.type == "cpu" and key.stride(-1) == 1 and value.stride(-1) == 1
            and key.shape == value.shape and key.shape[1:] == key_cache.shape[2:])



def _write_kv_i8(fn, key_cache, value_cache, key, value, slot_mapping) -> bool:
    """write_kv into int8 pools: each (token, head) row quantized with its scale
    (kernels/cpu_layer.c lmi_write_kv_i8; reference.quantize_rows's bytes)."""
    if (fn is None or not _i8_pool(key_cache) or not _i8_pool(value_cache) or key.dtype not in KV_DTYPES
            or not _kv_rows_fit(key_cache, value_cache, key, value)):
        return False
    t, hkv, d = key.shape
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (t,):
        return False
    nb, bs = key_cache.shape[:2]
    rc = fn.write_kv_i8(key_cache.data_ptr(), value_cache.data_ptr(), reference.kv_scale(key_cache).data_ptr(),
                        reference.kv_scale(value_cache).data_ptr(), key.data_ptr(), value.data_ptr(),
                        KV_DTYPES[key.dtype], key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                        key.stride(0), key.stride(1), value.stride(0), value.stride(1), slots.data_ptr(),
                        t, hkv, d, bs, nb * bs)
    if rc != 0:
        raise IndexError(f"write_kv: a slot is past the pool's {nb * bs} slots")
    return True


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     tables: torch.Tensor, lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """query [B, H, D] (one row per sequence), pools [NB, bs, Hkv, D], tables [B, W] (block ids,
    entries past a sequence's last block unused), lens [B] -> fp32 [B, H, D]."""
    fn = load()
    if fn is None:
        raise RuntimeError("the CPU decode-attention kernel is not available")
    b, h, d = query.shape
    nb, bs, hkv, _ = key_cache.shape
    if key_cache.stride() != value_cache.stride() or key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value pools must share dtype and layout")
    q = query.to(torch.float32).contiguous()
    tbl = tables.to(torch.int32).contiguous()
    ln = lens.to(torch.int32).contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    if key_cache.dtype == torch.int8:
        if not (_i8_pool(key_cache) and _i8_pool(value_cache)):
            raise ValueError("an int8 KV pool needs its row scales (reference.kv_scale)")
        rc = fn.decode_attention_i8(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                                    reference.kv_scale(key_cache).data_ptr(), reference.kv_scale(value_cache).data_ptr(),
                                    key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                                    tbl.data_ptr(), tbl.shape[1], ln.data_ptr(), b, h, hkv, d, bs, float(scale),
                                    int(sliding_window or 0), float(soft_cap or 0.0), out.data_ptr(),
                                    torch.get_num_threads())
        if rc != 0:
            raise MemoryError("CPU decode attention: scratch allocation failed")
        return out
    rc = fn(q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), KV_DTYPES[key_cache.dtype],
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            tbl.data_ptr(), tbl.shape[1], ln.data_ptr(), b, h, hkv, d, bs, float(scale),
            int(sliding_window or 0), float(soft_cap or 0.0), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU decode attention: scratch allocation failed")
    return out


def decode_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor | None:
    """One decode step's attention for one layer, in one call: rotary_(query, key, cos, sin) in
    place, write_kv(key, value at slots), decode_attention over the pools -> [B, H, D] in the
    activations' dtype (the values of those three calls). query [B, H, D], key/value [B, Hkv, D]
    (each row's heads contiguous: views of one q/k/v product will do), cos/sin [B, D], everything
    fp32 or everything bf16 (the pools too); slots int64 [B], tables int32 [B, W], lens int32 [B].
    None (nothing changed) where the kernel cannot take these tensors."""
    fn = load()
    dt = query.dtype
    i8 = key_cache.dtype == torch.int8
    if (fn is None or dt not in KV_DTYPES or value_cache.dtype != key_cache.dtype
            or (key_cache.dtype != dt and not (i8 and _i8_pool(key_cache) and _i8_pool(value_cache)))):
        return None
    b, h, d = query.shape
    nb, bs, hkv, _ = key_cache.shape
    if (not all(_plain(x, dt) for x in (query, key, value, cos, sin)) or key_cache.stride() != value_cache.stride()
            or key.shape != (b, hkv, d) or value.shape != key.shape or cos.shape != (b, d) or sin.shape != (b, d)
            or cos.stride() != sin.stride() or cos.stride(1) != 1 or d % 2 or h % hkv
            or any(x.stride()[1:] != (d, 1) for x in (query, key, value))
            or slots.dtype != torch.int64 or slots.shape != (b,) or not slots.is_contiguous()
            or tables.dtype != torch.int32 or tables.dim() != 2 or tables.shape[0] != b or not tables.is_contiguous()
            or lens.dtype != torch.int32 or lens.shape != (b,) or not lens.is_contiguous()):
        return None
    out = torch.empty(b, h, d, dtype=dt)
    if i8:
        rc = fn.decode_fused_i8(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
                                value.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), KV_DTYPES[dt],
                                key_cache.data_ptr(), value_cache.data_ptr(), reference.kv_scale(key_cache).data_ptr(),
                                reference.kv_scale(value_cache).data_ptr(), key_cache.stride(0), key_cache.stride(1),
                                key_cache.stride(2), slots.data_ptr(), nb * bs, tables.data_ptr(), tables.shape[1],
                                lens.data_ptr(), b, h, hkv, d, bs, float(scale), int(sliding_window or 0), 0.0,
                                out.data_ptr(), torch.get_num_threads())
    else:
        rc = fn.decode_fused(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
                             value.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), KV_DTYPES[dt],
                             key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
                             key_cache.stride(2), slots.data_ptr(), nb * bs, tables.data_ptr(), tables.shape[1],
                             lens.data_ptr(), b, h, hkv, d, bs, float(scale), int(sliding_window or 0), 0.0,
                             out.data_ptr(), torch.get_num_threads())
    if rc == -1:
        raise IndexError(f"decode_fused: a slot is past the pool's {nb * bs} slots")
    if rc != 0:
        raise MemoryError("CPU decode attention: scratch allocation failed")
    return out


def prefill_attention_available(dtype: torch.dtype) -> bool:
    """Whether prefill_attention's kernels run here for activations of `dtype` (fp32: the panel GEMM;
    bf16: the vdpbf16ps and widened panels)."""
    fn = load()
    if fn is None or dtype not in KV_DTYPES:
        return False
    return bool(fn.gemm_bf16_available and fn.gemm_bf16w_available if dtype == torch.bfloat16 else fn.gemm_available)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: list[int],
                      lens: list[int], scale: float, out: torch.Tensor) -> bool:
    """Causal attention of whole prompts (each prompt's context is its own rows of this step), all
    of them in one call by the panel GEMMs (kernels/cpu_decode.c lmi_prefill_attention): query /
    out [T, H, D], key / value [T, Hkv, D] (any token and head strides, D contiguous), rows
    starts[i] .. starts[i] + lens[i] - 1 of prompt i;
    out's rows of the prompts written in place. fp32 (kernels/cpu_gemm.c) or bf16 (kernels/cpu_gemm_bf16.c:
    Q K^T by vdpbf16ps, P V in fp32 over V widened in registers); False (nothing written) where the
    kernels cannot take them."""
    fn = load()
    dt = query.dtype
    if not lens or not prefill_attention_available(dt):
        return False
    t, h, d = query.shape
    if (not all(_plain(x, dt) for x in (query, key, value, out)) or key.dim() != 3 or key.shape != value.shape
            or key.shape[0] != t or key.shape[2] != d or h % key.shape[1] or out.shape != query.shape or d % 2
            or any(x.stride(2) != 1 for x in (query, key, value, out))):
        return False
    se = prompt_table(starts, lens)
    rc = fn.prefill_attention(query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
                              value.stride(0), query.stride(1), key.stride(1), value.stride(1), out.data_ptr(), out.stride(0),
                              out.stride(1), KV_DTYPES[dt], se[0].data_ptr(),
                              se[1].data_ptr(), se[2].data_ptr(), len(lens), h, key.shape[1], d, float(scale),
                              torch.get_num_threads())
    if rc != 0:
        raise MemoryError("CPU prompt attention: scratch allocation failed")
    return True


# ---------------------------------------------------------------------------- int8 (kernels/cpu_gemm_i8.c)
def gemm_i8_available() -> bool:
    """Whether kernels/cpu_gemm_i8.c's int8 GEMM runs here (every build: VNNI, AVX-VNNI, AVX2
    vpmaddubsw/vpmaddwd, NEON sdot)."""
    fn = load()
    return fn is not None and fn.gemm_i8_available


def pack_i8(wq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [N, K] -> (panels for `gemm_i8`, flat int8; per-column sums [N] int32)."""
    fn = load()
    n, k = wq.shape
    w = wq.contiguous()
    out = empty_hugepage(-(-n // PANEL) * PANEL * (-(-k // 4) * 4), torch.int8)
    wsum = torch.empty(n, dtype=torch.int32)
    fn.pack_i8(w.data_ptr(), n, k, out.data_ptr(), wsum.data_ptr())
    return out, wsum


def gemm_i8(x: torch.Tensor, panels: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor, n: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32, each row quantized to int8 by its own scale, @ the packed int8 weight's
    transpose, dequantized by row scale x column scale (+ bias [N] fp32) -> [..., N] fp32."""
    fn = load()
    k = x.shape[-1]
    a = x.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, kp = a.shape[0], -(-k // 4) * 4
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        threads = torch.get_num_threads()
        aq = torch.empty(m, kp, dtype=torch.uint8)
        sa = torch.empty(m, dtype=torch.float32)
        fn.quant_rows(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, aq.data_ptr(), kp, sa.data_ptr(), threads)
        fn.gemm_i8(aq.data_ptr(), m, kp, sa.data_ptr(), panels.data_ptr(), wsum.data_ptr(), scales.data_ptr(), n,
                   None if bias is None else bias.data_ptr(), out.data_ptr(), n, threads)
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------------- grouped 4/8-bit (kernels/cpu_gemm_q4.c)
def stream_read(x: torch.Tensor) -> float | None:
    """Sum a contiguous fp32 tensor with kernels/cpu_gemm.c's read-stream probe over torch's threads
    (what `bench floor` times); None where the C kernels do not load."""
    fn = load()
    if fn is None:
        return None
    return fn.stream_read(x.data_ptr(), x.numel(), torch.get_num_threads())


def q_act8_available() -> bool:
    """Whether this build multiplies grouped weights by int8 activations where a QPack asks for
    them (`act8`, option.cpu_grouped_activations=int8): avx512 with VNNI and VBMI, or avx2."""
    fn = load()
    return fn is not None and fn.q_act8_available


def gemm_q_available() -> bool:
    """Whether kernels/cpu_gemm_q4.c's grouped-weight GEMM runs here (the avx512, avx2 and neon builds)."""
    fn = load()
    return fn is not None and fn.gemm_q_available


@dataclasses.dataclass(frozen=True)
class QPack:
    """A grouped weight in kernels/cpu_gemm_q4.c's layout (its top comment; handler/model/quant_int4.py
    packs it): codes [np][K][row bytes] flat uint8; s, m [np][G][32] in fp32 / fp16 / int8 by smode;
    QS_I8's superblock scales d, e [np][ceil(G / sg)][32] fp32 (None otherwise)."""
    codes: torch.Tensor
    s: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor | None
    e: torch.Tensor | None
    smode: int
    sg: int         # groups per superblock (QS_I8), else 1
    bits: int       # code width: 4, 5, 6 or 8
    group: int      # inputs per group
    act8: bool = False  # int8 activations (option.cpu_grouped_activations=int8; lmi_gemm_q's act8)

    def tensors(self) -> list[torch.Tensor]:
        """What a step streams."""
        out = []
        for t in (self.codes, self.s, self.m, self.d, self.e):
            if t is not None and not any(t is o for o in out):     # s and m may be one table (Q6_K)
                out.append(t)
        return out


def q_row_bytes(bits: int) -> int:
    """Bytes of one packed row k of a 32-column panel (ROW_BYTES in kernels/cpu_gemm_q4.c)."""
    return 32 if bits == 8 else 16 + 4 * (bits - 4)


def gemm_q(x: torch.Tensor, w: QPack, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 @ the grouped quantized weight's transpose (+ bias [N] fp32) -> [..., N] fp32."""
    k = x.shape[-1]
    a = x.reshape(-1, k)
    m = a.shape[0]
    if a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and k:
        load().gemm_q(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, w.codes.data_ptr(), w.s.data_ptr(),
                      w.m.data_ptr(), _ptr(w.d), _ptr(w.e), w.smode, w.sg, w.bits, w.group, n, _ptr(bias),
                      out.data_ptr(), n, int(w.act8), torch.get_num_threads())
    elif m:
        out.zero_()
        if bias is not None:
            out += bias
    return out.view(*x.shape[:-1], n)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


# ---------------------------------------------------------------------------- bf16 (kernels/cpu_gemm_bf16.c)
def gemm_bf16_available() -> bool:
    """Whether kernels/cpu_gemm_bf16.c's vdpbf16ps GEMM runs on this host: built with AVX512-BF16
    and the CPU lists avx512_bf16 (checked at load, not only at compile time)."""
    fn = load()
    return fn is not None and fn.gemm_bf16_available


def gemm_bf16w_available() -> bool:
    """Whether `gemm_bf16(..., widen=True)` runs here: the same bf16 panels widened to fp32 in
    registers and multiplied by fp32 FMAs (AVX-512F/BW; no AVX512-BF16 needed)."""
    fn = load()
    return fn is not None and fn.gemm_bf16w_available


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's bf16 weight [N, K] -> its pair-interleaved panels for `gemm_bf16` (a flat bf16
    tensor [ceil(N/32)][ceil(K/2)][32][2], zero padded)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_bf16: a 2-D bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
    fn = load()
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = empty_hugepage(-(-n // PANEL) * PANEL * (-(-k // 2) * 2), torch.bfloat16)
    fn.pack_bf16(w.data_ptr(), n, k, out.data_ptr())
    return out


def gemm_bf16(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
              out_dtype: torch.dtype = torch.bfloat16, widen: bool = False) -> torch.Tensor:
    """x [..., K] @ the packed bf16 weight's transpose (+ bias [N] fp32), summed in fp32 ->
    [..., N] in out_dtype (bf16: rounded once, to nearest even; or fp32).

    widen=False: vdpbf16ps, x in bf16 (an fp32 x rounded to bf16 first), pairs of products added
    per instruction. widen=True: the weight widened in registers, x in fp32 (a bf16 x widened,
    exact), fp32 FMAs in k order: kernels/cpu_gemm.c's values over the widened weight, bit for bit."""
    if x.dtype not in (torch.bfloat16, torch.float32) or out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemm_bf16: input {x.dtype} -> {out_dtype}; takes bf16/fp32 to bf16/fp32")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gemm_bf16: the bias must be a contiguous fp32 [{n}], not {bias.dtype} {tuple(bias.shape)}")
    fn = load()
    k = x.shape[-1]
    if k == 0:      # an empty sum: the bias alone
        y = torch.zeros(*x.shape[:-1], n, dtype=torch.float32) + (0 if bias is None else bias)
        return y.to(out_dtype)
    a = x.reshape(-1, k)
    m = a.shape[0]
    threads = torch.get_num_threads()
    if widen:
        a = a.float()
        if a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
            a = a.contiguous()
        out = torch.empty(m, n, dtype=out_dtype)
        if m:
            fn.gemm_bf16w(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, panels.data_ptr(), n,
                          None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                          int(out_dtype == torch.bfloat16), threads)
        return out.view(*x.shape[:-1], n)
    if a.dtype == torch.float32:
        if a.stride(-1) != 1:
            a = a.contiguous()
        rows = torch.empty(m, k, dtype=torch.bfloat16)
        if m:
            fn.bf16_rows(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, rows.data_ptr(), k, threads)
        a = rows
    elif a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    out = torch.empty(m, n, dtype=out_dtype)
    if m:
        fn.gemm_bf16(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, panels.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                     int(out_dtype == torch.bfloat16), threads)
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------------- a decode step's layers (kernels/cpu_layer.c)
LIN_F32, LIN_BF16, LIN_BF16W, LIN_I8 = (_ENUM[k] for k in ("LIN_F32", "LIN_BF16", "LIN_BF16W", "LIN_I8"))
LIN_Q = _ENUM["LIN_Q"]          # grouped 4/5/6/8-bit codes (handler/model/quant_int4.py GroupedPack)
QS_F32, QS_F16, QS_I8 = (_ENUM[k] for k in ("QS_F32", "QS_F16", "QS_I8"))   # lmi_gemm_q's scale modes
Lin = _STRUCTS["lmi_lin"]        # one packed linear layer
Layer = _STRUCTS["lmi_layer"]    # a decoder layer's weights and KV pools (q|k|v and gate|up fused: k, v, up n = 0)


def _sleef_expf() -> tuple[int, int] | None:
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
    found = _sleef_expf()
    if fn is None or found is None:
        return False
    fn.set_sleef_expf(*found)
    return bool(fn.silu_available())


@functools.lru_cache(maxsize=None)
def silu_exact(threads: int) -> bool:
    """Whether silu_mul_ gives torch's values bit for bit at `threads` threads, checked once on rows
    of every split torch makes (a loop's vector body and scalar tail, one or several chunks) and on
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


def step_layers(layers, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                tables: torch.Tensor, lens: torch.Tensor, prompts: torch.Tensor, *, heads: int, kv_heads: int,
                head_dim: int, intermediate: int, eps: float, lanes: int, pool: torch.Tensor, scale: float) -> None:
    """Every decoder layer of one step, in place on the residual stream h [T, E] (kernels/cpu_layer.c):
    B = tables.shape[0] decoding sequences in rows 0 .. B-1 (one row each) and whole prompts after
    them. `layers` a ctypes array of Layer, cos/sin [T, D], slots int64 [T], tables int32 [B, W], lens
    int32 [B] (decode_fused's), prompts int64 [3, P] (first rows, lengths, the order longest first:
    prefill_attention's), `pool` one of the layers' KV pools (their shared layout), `lanes`
    rms_norm_f32's summing width (fp32). The caller checked every shape and dtype."""
    fn = load()
    t, e = h.shape
    nb, bs = pool.shape[:2]
    rc = fn.step_layers(ctypes.addressof(layers), len(layers), h.data_ptr(), t, tables.shape[0], e, heads, kv_heads,
                        head_dim, intermediate, float(eps), lanes, int(h.dtype == torch.bfloat16), cos.data_ptr(),
                        sin.data_ptr(), cos.stride(0), slots.data_ptr(), nb * bs, tables.data_ptr(), tables.shape[1],
                        lens.data_ptr(), prompts.shape[1], prompts[0].data_ptr(), prompts[1].data_ptr(),
                        prompts[2].data_ptr(), pool.stride(0), pool.stride(1), pool.stride(2), bs, float(scale),
                        torch.get_num_threads())
    if rc == -1:
        raise IndexError(f"step_layers: a slot is past the pool's {nb * bs} slots")
    if rc != 0:
        raise MemoryError("CPU step layers: scratch allocation failed")
