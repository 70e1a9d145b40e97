"""Memory for the weights a decode step streams: huge-page-advised CPU tensors, and where tensors'
data sit (smaps accounting, for `bench floor` and the load log)."""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import weakref

import torch

log = logging.getLogger("lmi.kernels")

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
