"""What this machine has, for the sizing rules (handler.config.sizing): visible CUDA GPUs, bf16
support, GPU memory. torch is imported lazily, only when the answer can depend on it: with torch
not yet imported and no GPU device node at all (/dev/nvidia*, /dev/nvhost*, /dev/dxg, /dev/kfd)
the answer is "no GPU" without it, so `python -m handler config` and `config --explain` on a CPU
host stay cheap. Once torch is loaded (the runner, tests) torch answers, as the runner always did.
"""
from __future__ import annotations

import glob
import sys

from handler.config import sizing

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
