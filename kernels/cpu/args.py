"""What every op wrapper checks of the tensors it hands to C."""
from __future__ import annotations

import torch

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}   # the activation / pool dtype codes of kernels/cpu_api.h


def plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU tensor of `dtype` the kernels may take as input: none that autograd tracks (the kernels
    have no backward; weights are only read, so they may be parameters)."""
    return t.dtype == dtype and t.device.type == "cpu" and not t.requires_grad


def ptr(t: torch.Tensor | None):
    """A tensor's data pointer for C, None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()
