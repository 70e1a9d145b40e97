"""CPU-only speed-ups, applied behind the device check (a CUDA runner never calls them).

Weight prepacking: every `nn.Linear` of the model (the output head included) keeps its weight
reordered once into oneDNN's blocked layout and multiplies with `mkldnn._linear_pointwise`,
as vLLM's CPU backend (`onednn_mm`) and inductor's freezing pass do. The math is the same GEMM;
the packed layout spares the per-call reorder. Measured on the 2-core dev machine, one thread
(`python benchmarks/step_floor.py`'s profile, and the shapes of a 135 M Llama at batch 64):
fp32 576x1536 projections 1.23 -> 1.03 ms, the fp32 49152x576 output head 60 -> 36 ms;
bf16 5-45% (the head 24 -> 19.5 ms, at batch 1 8.1 -> 4.5 ms).

The module keeps being an `nn.Linear` (its class is swapped), so LoRA's wrapping and any code
reading `in_features` keep working. Without LoRA, a weight no other module shares is dropped
after packing (the packed copy replaces it: memory stays the same); a tied output head keeps
the embedding's weight.

Allocator: `python -m handler serve` on a CPU host re-executes itself once with tcmalloc in
LD_PRELOAD when the system has it (Debian: libtcmalloc-minimal4, installed in the image), as
vLLM's CPU recipe does: the engine allocates thousands of short-lived tensors per step.
In process, 100 requests of the cpu-135m mix: 3.21 -> 3.63 req/s (two interleaved pairs).

RMSNorm: a norm module whose forward is, line for line, Llama's (fp32 mean of squares, rsqrt,
weight times the result cast back: Llama, Mistral, Qwen2/3 and the other copies) gets a forward
calling torch's fused `F.rms_norm` on the same input, then the same weight product: one kernel
instead of seven small ops per norm, the same values (bit for bit in fp32, checked in
tests/test_cpu.py; bf16 rows go to the C kernel of kernels/cpu_ext.py, since torch has no fused bf16
CPU rms_norm: an element may land one bf16 step away).
Norms written otherwise (Gemma's 1 + weight, ...) keep their own forward.

Escape hatches (and the A/B switches of benchmarks/step_floor.py): LMI_CPU_PREPACK=0 keeps the
plain nn.Linear; LMI_CPU_FUSED_NORM=0 keeps the models' own RMSNorm forward; LMI_CPU_KV_LAYOUT=token keeps the CPU KV pool token-major like the GPU's;
LMI_CPU_MALLOC=system keeps the C library's allocator.
"""
from __future__ import annotations

import functools
import glob
import inspect
import logging
import os
import textwrap
import types

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("lmi.cpu")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads `packed` (oneDNN's layout of the weight)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed.dtype:   # e.g. a float32 caller of a bf16 model: as F.linear would refuse
            raise RuntimeError(f"PackedLinear: input dtype {x.dtype} != weight dtype {self.packed.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _setting(name: str, default: str = "1") -> str:
    """An environment switch, lower-cased."""
    return os.environ.get(name, default).strip().lower()


def head_major_kv() -> bool:
    """The CPU KV pool's layout: head-major (default) or token-major (LMI_CPU_KV_LAYOUT=token)."""
    return _setting("LMI_CPU_KV_LAYOUT", "head") != "token"


TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


def find_tcmalloc(dirs=TCMALLOC_DIRS) -> str | None:
    for d in dirs:
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            hits = sorted(glob.glob(os.path.join(d, name)))
            if hits:
                return hits[0]
    return None


def preload_env(env, dirs=TCMALLOC_DIRS) -> dict | None:
    """The environment to re-execute the server with (tcmalloc first in LD_PRELOAD), or None:
    opted out (LMI_CPU_MALLOC=system), already preloaded, or no tcmalloc on this system."""
    if env.get("LMI_CPU_MALLOC", "tcmalloc").strip().lower() == "system":
        return None
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload:
        return None
    lib = find_tcmalloc(dirs)
    if lib is None:
        return None
    return dict(env, LD_PRELOAD=f"{lib}:{preload}" if preload else lib)


def can_prepack(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


def prepack_linears(model: nn.Module, keep_weights: bool = False) -> int:
    """Swap every plain nn.Linear on CPU for a PackedLinear; returns how many were packed.
    keep_weights: leave the original weights in place (LoRA reads their shape and dtype)."""
    tied = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)}
    if _setting("LMI_CPU_PREPACK") in ("0", "false", "no", "off"):
        return 0
    done = 0
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or m.weight.device.type != "cpu" or not can_prepack(m.weight.dtype):
            continue
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
        except RuntimeError as e:   # a shape or build oneDNN refuses: this layer stays as it was
            log.debug("not prepacking %s: %s", name, e)
            continue
        m.__class__ = PackedLinear
        m.packed = packed
        if not keep_weights and id(m.weight) not in tied:
            # The packed copy replaces it; an empty tensor keeps dtype/device for readers.
            m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        done += 1
    return done


@functools.lru_cache(maxsize=None)
def _forward_source(cls) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):   # defined where no source is kept
        return None


def _llama_rms_forward_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return _forward_source(LlamaRMSNorm)


def _fused_rms_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm in one kernel: bf16 rows through the C kernel of kernels/cpu_ext.py,
    others through torch's fused rms_norm, then the same weight product."""
    if hidden_states.dtype == torch.bfloat16:
        from kernels import cpu_ext
        out = cpu_ext.rms_norm_bf16(hidden_states, self.weight, self.variance_epsilon)
        if out is not None:
            return out
    return self.weight * F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=self.variance_epsilon)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm module whose forward is Llama's the fused forward; returns how many."""
    if _setting("LMI_CPU_FUSED_NORM") in ("0", "false", "no", "off"):
        return 0
    want = _llama_rms_forward_source()
    done = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(w, torch.Tensor) and w.dim() == 1 and hasattr(m, "variance_epsilon")
                and _forward_source(type(m)) == want):
            m.forward = types.MethodType(_fused_rms_forward, m)
            done += 1
    return done
