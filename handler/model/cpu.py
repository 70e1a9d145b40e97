"""CPU-only speed-ups, applied behind the device check (a CUDA runner never calls them).
What each one gains, measured: docs/PERFORMANCE.md, "CPU fast paths".

Linear layers: a decode step multiplies 1-64 rows by every weight, so it streams all the weights
from memory. Each replacement stays an `nn.Linear` (its class is swapped: LoRA's wrapping and
`in_features` keep working); without LoRA the original weight is dropped once packed, unless
another module shares it (a tied output head keeps the embedding's).
  PackedLinear   oneDNN's blocked layout, packed once (`mkldnn._linear_pointwise`, as vLLM's
                 `onednn_mm` and inductor's freezing do): the same GEMM without a per-call reorder.
  PanelLinear    fp32 (and widened bf16) weights in 32-column panels for kernels/cpu_gemm.c where
                 it runs (AVX-512F, a C compiler; LMI_CPU_GEMM=onednn keeps oneDNN): the next panel
                 streams into L2 while the current one multiplies, so the weight stream hides
                 under the multiplications instead of preceding them. A row's output is its
                 k-ordered FMA sum, independent of the rows beside it.
  WidenedLinear  bf16 values multiplied in fp32 where the CPU's bf16 GEMM is the slower one
                 (AVX-512 BF16 without AMX), chosen by timing both at load (`bf16_gemm_in_fp32`):
                 bf16 products are exact in fp32, so only the sum's order differs from a bf16 GEMM.

Llama-shaped modules (source-checked: the forward must be Llama's line for line, comments aside):
  - RMSNorm -> torch's fused `F.rms_norm` then the same weight product (one kernel instead of
    seven small ops; bit for bit in fp32; bf16 rows go to kernels/cpu_ext.py's C kernel, within
    one bf16 step). Norms written otherwise (Gemma's 1 + weight, ...) keep their own forward.
  - attention and MLP (`fuse_llama_layers`; Mistral's/Qwen2's `sliding_window=` line allowed):
    on a packed engine step, rotary applied in place to q and k by a C kernel that rounds as
    transformers' ops do, paged attention straight on the [T, H, D] views, SiLU and product in
    place; the same logits bit for bit (tests/kernels/test_cpu_kernel.py, tests/model/test_cpu.py).
    Outside an engine step (`model.generate`) the model's own forward runs.
  - the whole model (`lean_forward`), when Llama's from the head down: the engine's step runs the
    same modules' forwards in one plain loop, without transformers' module calls, decorators,
    output capture and a causal mask our attention never reads. The runner keeps it only if its
    logits equal the model's own, bit for bit, on a check step at load.

Allocator: `python -m handler serve` on a CPU host re-executes itself once with tcmalloc in
LD_PRELOAD when the system has it (as vLLM's CPU recipe): a step allocates thousands of
short-lived tensors.

Escape hatches (also the A/B switches of benchmarks/step_floor.py): LMI_CPU_PREPACK=0,
LMI_CPU_FUSED_NORM=0, LMI_CPU_FUSED_LAYERS=0, LMI_CPU_LEAN_FORWARD=0, LMI_CPU_KV_LAYOUT=token
(token-major CPU KV pool, like the GPU's), LMI_CPU_MALLOC=system, LMI_CPU_BF16_GEMM=bf16 | fp32
(instead of timing), LMI_CPU_GEMM=onednn.
"""
from __future__ import annotations

import ast
import functools
import glob
import inspect
import logging
import os
import sys
import textwrap
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from handler.config.switches import switch
from kernels import cpu_ext

log = logging.getLogger("lmi.cpu")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads `packed` (oneDNN's layout of the weight)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed.dtype:   # e.g. a float32 caller of a bf16 model: as F.linear would refuse
            raise RuntimeError(f"PackedLinear: input dtype {x.dtype} != weight dtype {self.packed.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class WidenedLinear(nn.Linear):
    """A bf16 nn.Linear multiplied by oneDNN's fp32 GEMM: `packed` holds the weight widened to
    fp32 (exact), the input is widened (exact), each product of two bf16 values is exact in fp32
    and the sum accumulates in fp32, as a bf16 GEMM does; the output is rounded to bf16 once.
    The same values as the bf16 GEMM up to the order of the fp32 sum, at twice its weight memory;
    chosen where the CPU's bf16 GEMM is the slower one (see bf16_gemm_in_fp32)."""

    packed: torch.Tensor
    bias32: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"WidenedLinear: input dtype {x.dtype} != weight dtype torch.bfloat16")
        y = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, self.bias32, "none", [], "")
        return y.to(torch.bfloat16)


class PanelLinear(nn.Linear):
    """An nn.Linear multiplied by kernels/cpu_gemm.c from `panels` (the weight in 32-column
    panels, fp32): an fp32 weight as it is, a bf16 weight widened to fp32 (`widen`, exact, as
    WidenedLinear: the input widened, the output rounded to bf16 once)."""

    panels: torch.Tensor
    bias32: torch.Tensor | None
    widen: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        want = torch.bfloat16 if self.widen else torch.float32
        if x.dtype != want:
            raise RuntimeError(f"PanelLinear: input dtype {x.dtype} != weight dtype {want}")
        y = cpu_ext.gemm(x.float() if self.widen else x, self.panels, self.out_features, self.bias32)
        return y.to(torch.bfloat16) if self.widen else y


def _switched_off(name: str) -> bool:
    """An on-by-default switch (LMI_CPU_PREPACK, ...; handler/config/switches.py) set to 0 / false / no / off."""
    return not switch(name)


def head_major_kv() -> bool:
    """The CPU KV pool's layout: head-major (default) or token-major (LMI_CPU_KV_LAYOUT=token)."""
    return switch("LMI_CPU_KV_LAYOUT") != "token"


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
    if switch("LMI_CPU_MALLOC", env) == "system":
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


def _linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu"]


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """The best of `reps` timed calls of an [m, k] bf16 input through a bf16 k -> n linear layer
    packed as a model's would be: widened (dtype float32) or in bf16 (oneDNN's, or the plain
    layer's F.linear on a CPU without it)."""
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    prepack_linears(nn.Sequential(lin), widen_bf16=dtype == torch.float32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    best, calls, start = float("inf"), 0, time.perf_counter()
    with torch.inference_mode():
        lin(x)
        # At least `reps` calls and 20 ms: a small GEMM takes tens of microseconds, and one
        # preempted call must not decide.
        while calls < reps or time.perf_counter() - start < 0.02:
            t = time.perf_counter()
            lin(x)
            best = min(best, time.perf_counter() - t)
            calls += 1
    return best


@functools.lru_cache(maxsize=None)
def _bf16_over_fp32(k: int, n: int, rows: tuple) -> tuple:
    """bf16 GEMM time / fp32 GEMM time per row count, measured once per process and shape (the
    CPU does not change: every runner of a process decides alike). Each side's best of three
    rounds, the two alternating, so a burst of other load falls on both."""
    out = []
    for r in rows:
        best = {torch.bfloat16: float("inf"), torch.float32: float("inf")}
        for _ in range(3):
            for dt in best:
                best[dt] = min(best[dt], _gemm_seconds(r, k, n, dt))
        out.append(best[torch.bfloat16] / best[torch.float32])
    return tuple(out)


BF16_GEMM_MARGIN = 1.15     # fp32 must be this much faster to be worth twice the weight memory


def bf16_gemm_in_fp32(model: nn.Module, rows=(64, 512)) -> tuple[bool, str]:
    """Whether this bf16 model's linears should multiply in fp32 (WidenedLinear), and why.

    LMI_CPU_BF16_GEMM=bf16 | fp32 decides; auto (the default) times the model's widest linear
    shape (the output head aside) both ways at a decode-sized and a prefill-sized row count, and
    widens only when fp32 wins at both by BF16_GEMM_MARGIN and the fp32 copies fit in a quarter
    of the memory available. CPUs with AMX multiply bf16 ~2x faster than fp32 and keep bf16; on
    AVX-512 BF16 without AMX the dev machine's oneDNN bf16 GEMM ran at 0.55-0.65x fp32's speed."""
    if _switched_off("LMI_CPU_PREPACK"):
        return False, "LMI_CPU_PREPACK=0: the linear layers stay as the model built them"
    choice = switch("LMI_CPU_BF16_GEMM")
    if choice in ("bf16", "fp32"):
        return choice == "fp32", f"LMI_CPU_BF16_GEMM={choice}"
    ignored = "" if choice == "auto" else f"; LMI_CPU_BF16_GEMM={choice!r} ignored (auto, bf16 or fp32)"
    lin = [m for _, m in _linears(model) if m.weight.dtype == torch.bfloat16]
    if not lin or not can_prepack(torch.float32):
        return False, "no bf16 linear layers" + ignored
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = [m for m in lin if m is not head] or lin
    extra = 4 * sum(m.weight.numel() for m in lin)
    avail = _mem_available()
    if avail is not None and extra > avail // 4:
        return False, (f"fp32 copies of the linear weights ({extra / 2**30:.1f} GiB) would take more "
                       f"than a quarter of the memory available ({avail / 2**30:.1f} GiB)" + ignored)
    widest = max(body, key=lambda m: m.weight.numel())
    n, k = widest.weight.shape
    try:
        ratios = _bf16_over_fp32(k, n, tuple(rows))
    except RuntimeError as e:       # a build or CPU oneDNN refuses: keep the model as it is
        return False, f"the GEMMs could not be timed ({e})" + ignored
    shown = ", ".join(f"{r} rows {x:.2f}x" for r, x in zip(rows, ratios))
    widen = all(x >= BF16_GEMM_MARGIN for x in ratios)
    return widen, f"bf16 GEMM time / fp32 GEMM time on a {k}x{n} weight: {shown}" + ignored


def panels_wanted() -> bool:
    """Whether fp32 GEMMs (and widened bf16 ones) go to kernels/cpu_gemm.c: it runs on this CPU
    and LMI_CPU_GEMM is not `onednn`."""
    choice = switch("LMI_CPU_GEMM")
    if choice == "onednn":
        return False
    if choice != "panels":
        log.warning("LMI_CPU_GEMM=%r ignored (allowed: panels, onednn); using panels where the CPU runs them",
                    choice)
    return cpu_ext.gemm_available()


def _onednn_pack(name: str, weight: torch.Tensor, widen: bool) -> torch.Tensor | None:
    """The weight in oneDNN's layout (widened to fp32 when `widen`), or None where oneDNN cannot
    take it (its dtype on this CPU, or a shape or build it refuses: the layer stays as it was)."""
    if not can_prepack(torch.float32 if widen else weight.dtype):
        return None
    try:
        with torch.no_grad():
            w = weight.detach()
            return torch.ops.mkldnn._reorder_linear_weight(w.float() if widen else w)
    except RuntimeError as e:
        log.debug("not prepacking %s: %s", name, e)
        return None


def prepack_linears(model: nn.Module, keep_weights: bool = False, widen_bf16: bool = False) -> int:
    """Swap every plain nn.Linear on CPU for a PanelLinear where kernels/cpu_gemm.c serves (fp32
    weights, and bf16 ones when widen_bf16), else a PackedLinear (WidenedLinear for bf16 weights
    when widen_bf16); returns how many were packed. keep_weights: leave the original weights in
    place (LoRA reads their shape and dtype)."""
    tied = {id(p) for name, m in model.named_modules() if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)}
    if _switched_off("LMI_CPU_PREPACK"):
        return 0
    panels = panels_wanted()
    done = 0
    for name, m in _linears(model):
        widen = widen_bf16 and m.weight.dtype == torch.bfloat16
        if panels and (widen or m.weight.dtype == torch.float32):
            with torch.no_grad():
                m.panels = cpu_ext.pack_panels(m.weight.detach().float())
            m.widen, cls = widen, PanelLinear
        else:
            packed = _onednn_pack(name, m.weight, widen)
            if packed is None:
                continue
            m.packed, cls = packed, WidenedLinear if widen else PackedLinear
        if cls is not PackedLinear:     # an fp32 GEMM: the bias in fp32
            m.bias32 = None if m.bias is None else m.bias.detach().float().contiguous()
        m.__class__ = cls
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
        out = cpu_ext.rms_norm_bf16(hidden_states, self.weight, self.variance_epsilon)
        if out is not None:
            return out
    return self.weight * F.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=self.variance_epsilon)


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every RMSNorm module whose forward is Llama's the fused forward; returns how many."""
    if _switched_off("LMI_CPU_FUSED_NORM"):
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


# ---- Llama-shaped attention and MLP: the same modules, fewer passes over memory.
# A module qualifies when its forward's source is Llama's line for line (comments aside), so a
# family that computes anything differently keeps its own forward.

def _body(fn) -> list[str] | None:
    """A forward's statements from its first line after the signature, comments dropped."""
    try:
        lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    except (OSError, TypeError):
        return None
    start = next((i + 1 for i, ln in enumerate(lines) if ln.rstrip().endswith(":") and ")" in ln), None)
    if start is None:
        return None
    return [ln.split("#", 1)[0].strip() for ln in lines[start:] if ln.split("#", 1)[0].strip()]


# Llama's attention forward, or it with one of these lines added (Mistral, Qwen2 and their copies
# pass a sliding window): line -> the window of a module.
_WINDOW_LINES = {
    "sliding_window=self.sliding_window,": lambda m: getattr(m, "sliding_window", None),
    'sliding_window=getattr(self.config, "sliding_window", None),':
        lambda m: getattr(m.config, "sliding_window", None),
}


def _llama():
    from transformers.models.llama import modeling_llama
    return modeling_llama


@functools.lru_cache(maxsize=None)
def _window_of(cls):
    """For an attention class whose forward is Llama's: a function module -> sliding window (None:
    none); None when the class does not qualify. Its module's rotary helpers must be Llama's too."""
    llama = _llama()
    mod = sys.modules.get(cls.__module__)
    for name in ("apply_rotary_pos_emb", "rotate_half"):
        if mod is None or _body(getattr(mod, name, None)) != _body(getattr(llama, name)):
            return None
    want, got = _body(llama.LlamaAttention.forward), _body(cls.forward)
    if want is None or got is None:
        return None
    if got == want:
        return lambda m: None
    for line, window in _WINDOW_LINES.items():
        if line in got and [ln for ln in got if ln != line] == want:
            return window
    return None


def _fused_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                             past_key_values=None, **kwargs):
    """Llama's attention on a packed step: projections, rotary in place (kernels/cpu_ext.py, the
    same rounding as transformers'), the paged attention, the output projection; the model's own
    forward whenever the step is not ours."""

    from handler.model.attention import ATTN_NAME, paged_attention_forward
    step = kwargs.get("lmi_step")
    if (step is None or position_embeddings is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1
            or self.config._attn_implementation != ATTN_NAME):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)
    t, d = hidden_states.shape[1], self.head_dim
    q = self.q_proj(hidden_states).view(t, -1, d)   # [T, H, D]
    k = self.k_proj(hidden_states).view(t, -1, d)
    v = self.v_proj(hidden_states).view(t, -1, d)
    cos, sin = position_embeddings
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]   # [1, H, T, D]
    if not cpu_ext.rotary_(q, k, cos[0], sin[0]):
        qh, kh = sys.modules[type(self).__module__].apply_rotary_pos_emb(qh, kh, cos, sin)
    out, _ = paged_attention_forward(self, qh, kh, vh, None, scaling=self.scaling, lmi_step=step,
                                     sliding_window=self._lmi_window)
    return self.o_proj(out.reshape(1, t, -1)), None


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation
    return type(act) is nn.SiLU or (type(act) is SiLUActivation
                                    and _body(SiLUActivation.forward) == ["return nn.functional.silu(input)"])


def _fused_mlp_forward(self, x):
    """Llama's MLP with the activation and the product in place: the same ops and values, two
    fewer [T, I] buffers per layer."""
    return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


def fuse_llama_layers(model: nn.Module) -> tuple[int, int]:
    """Give every attention and MLP module whose forward is Llama's (see above) the fused forward;
    returns (attention modules, MLPs). LMI_CPU_FUSED_LAYERS=0 keeps the models' own."""
    if _switched_off("LMI_CPU_FUSED_LAYERS"):
        return 0, 0
    llama_mlp = _body(_llama().LlamaMLP.forward)
    attn = mlp = 0
    for m in model.modules():
        cls = type(m)
        if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "config")):
            window = _window_of(cls)
            if window is not None:
                m._lmi_window = window(m)
                m.forward = types.MethodType(_fused_attention_forward, m)
                attn += 1
        elif (all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
              and _is_silu(m.act_fn) and _body(cls.forward) == llama_mlp):
            m.forward = types.MethodType(_fused_mlp_forward, m)
            mlp += 1
    return attn, mlp


# ---- The whole model, Llama-shaped: one plain loop over the layers for the engine's packed step.

def _statements(fn) -> list[str] | None:
    """A function's statements, parsed (formatting, comments and its docstring dropped)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.dump(st) for st in body]


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def lean_forward(model: nn.Module):
    """For a model that is Llama's from the head down (its ForCausalLM forward is Llama's; its
    decoder layers' forwards are Llama's line for line; the embedding, rotary, final norm and head
    where Llama keeps them; no forward hooks on what it skips): a function
    `(ids [1, T], positions [1, T], keep [R], step) -> logits [R, V]` that runs the same modules'
    forwards in the same order as the model's own, in one plain loop. It spares, per layer, five
    module calls and transformers' keyword plumbing (decorators, output capture, the causal mask
    our attention never reads), and applies the final norm to the kept rows only (a row-wise op).
    None when the model does not qualify (LMI_CPU_LEAN_FORWARD=0: never). The runner checks its
    logits against the model's own forward once at load (ModelRunner.prepack_cpu), since the
    models' outer forwards differ in their mask code and are not compared line for line."""
    if _switched_off("LMI_CPU_LEAN_FORWARD"):
        return None
    llama = _llama()
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if (inner is None or not isinstance(head, nn.Module)
            or not all(isinstance(getattr(inner, a, None), nn.Module)
                       for a in ("embed_tokens", "rotary_emb", "layers", "norm"))
            or _statements(type(model).forward) != _statements(llama.LlamaForCausalLM.forward)):
        return None
    layers = list(inner.layers[: model.config.num_hidden_layers])
    want = _body(llama.LlamaDecoderLayer.forward)
    parts = []
    for layer in layers:
        subs = [getattr(layer, a, None) for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")]
        if ("forward" in vars(layer) or _body(type(layer).forward) != want
                or not all(isinstance(m, nn.Module) for m in subs) or any(map(_hooked, [layer, *subs]))):
            return None
        parts.append(tuple(m.forward for m in subs))
    if any(map(_hooked, (model, inner, inner.embed_tokens, inner.rotary_emb, inner.norm))):
        return None
    embed, rotary, norm = inner.embed_tokens, inner.rotary_emb, inner.norm.forward

    def forward(ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, step) -> torch.Tensor:
        h = embed(ids)
        pe = rotary(h, position_ids=pos)
        for norm1, attn, norm2, mlp in parts:      # LlamaDecoderLayer.forward, statement by statement
            x, _ = attn(hidden_states=norm1(h), position_embeddings=pe, attention_mask=None, past_key_values=None,
                        position_ids=pos, use_cache=False, lmi_step=step)
            h = h + x
            h = h + mlp(norm2(h))
        return head(norm(h[:, keep]))[0]

    return forward
