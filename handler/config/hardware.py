"""What this machine has, for the sizing rules (handler.config.sizing): visible CUDA GPUs, bf16
support, GPU memory. torch is imported lazily, only when the answer can depend on it: with torch
not yet imported and no GPU device node at all (/dev/nvidia*, /dev/nvhost*, /dev/dxg, /dev/kfd)
the answer is "no GPU" without it, so `python -m handler config` and `config --explain` on a CPU
host stay cheap. Once torch is loaded (the runner, tests) torch answers, as the runner always did.
"""
from __future__ import annotations

import glob
import os
import sys

from handler.config import sizing
from handler.config.switches import switch

_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/nvhost*", "/dev/dxg", "/dev/kfd")


def _torch():
    """torch, or None where no GPU can be visible (or torch is not installed)."""
    if "torch" not in sys.modules and not any(glob.glob(p) for p in _DEVICE_NODES):
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def visible_gpus() -> int:
    """CUDA devices this process sees."""
    torch = _torch()
    return torch.cuda.device_count() if torch is not None else 0


def cuda_available() -> bool:
    torch = _torch()
    return torch is not None and torch.cuda.is_available()


def bf16_supported() -> bool:
    """Whether the visible CUDA device multiplies bf16; True where none is visible (a GPU being
    planned for, as `config --explain --device cuda` on a CPU host does: current GPUs do)."""
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return True
    return torch.cuda.is_bf16_supported()


def cuda_memory(device=None) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    import torch
    return torch.cuda.mem_get_info(device)


def pick_device(device: str) -> str:
    """option.device -> "cpu" | "cuda" on this machine (auto: cuda when one is visible)."""
    return sizing.resolve_device(device, device == "auto" and cuda_available())


def pick_dtype(dtype: str, device: str) -> str:
    """option.dtype on `device` -> "fp32" | "fp16" | "bf16" (auto: fp32 on a CPU; bf16 on a GPU,
    fp16 on one without bf16)."""
    return sizing.resolve_dtype(dtype, device, dtype != "auto" or device != "cuda" or bf16_supported())


_NO_LIMIT = 1 << 60      # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


def _read_int(path: str) -> int | None:
    """An integer file (cgroup); None when absent, unreadable or "max"."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def mem_available(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where there is none."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_room(root: str) -> int | None:
    """Bytes this container may still allocate before its cgroup's OOM killer: memory.max less
    memory.current (cgroup v2; v1: memory.limit_in_bytes less memory.usage_in_bytes); None
    when no limit is set."""
    for limit_f, usage_f in (("memory.max", "memory.current"),
                             ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read_int(os.path.join(root, limit_f))
        if limit is not None and limit < _NO_LIMIT:
            return max(0, limit - (_read_int(os.path.join(root, usage_f)) or 0))
    return None


def cpu_available_memory(root: str | None = None, meminfo: str | None = None) -> int:
    """The memory a CPU server may still take now: the cgroup's room when a limit is set (or
    the host's MemAvailable if that is smaller), else MemAvailable; 0 when neither can be read.
    LMI_CGROUP_ROOT / LMI_MEMINFO point elsewhere (tests)."""
    root = root or switch("LMI_CGROUP_ROOT")
    meminfo = meminfo or switch("LMI_MEMINFO")
    room, avail = cgroup_room(root), mem_available(meminfo)
    known = [x for x in (room, avail) if x is not None]
    return min(known) if known else 0


def _isa_module():
    """kernels/isa.py (plain Python), loaded by path: importing the `kernels` package would import torch."""
    import importlib.util
    mod = sys.modules.get("kernels.isa")
    if mod is not None:
        return mod
    spec = importlib.util.find_spec("kernels")
    path = os.path.join(spec.submodule_search_locations[0], "isa.py")
    spec = importlib.util.spec_from_file_location("lmi_kernels_isa", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cpu_kernels(choice: str) -> tuple[str | None, str]:
    """option.cpu_kernels -> (the CPU kernels' instruction set on this host, None: torch's operators;
    why), or ValueError naming what this CPU runs (kernels/isa.py)."""
    return _isa_module().resolve(choice)
