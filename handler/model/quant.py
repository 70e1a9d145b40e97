"""option.quantize: quantized linear layers, each a handler/model/linear.py CpuLinear (an `nn.Linear`)
holding its quantized pack, put in the plain layer's place, so the model around them (ours or
transformers'), LoRA's wrapper and tensor-parallel shards are unchanged.

int8 (aliases w8a8, int8_dynamic): dynamic W8A8. At load each weight row (output channel) is
rounded to int8 by its own scale max|w| / 127; at every step each activation row (token) is
rounded to int8 by its own scale, and the int8 x int8 products are summed exactly in int32, then
scaled back: y[m, n] = sa[m] sw[n] sum_k qa[m, k] qw[n, k] + b[n]. Every CPU kernel build runs
it in kernels/cpu_gemm_i8.c (a quarter of fp32's weight bytes; VNNI or AVX-VNNI vpdpbusd, AVX2
vpmaddubsw/vpmaddwd, NEON sdot; the same integers and values on each); without one (the torch
backend, a GPU) the same arithmetic in torch ops (a reference: correct, not fast). The output head and the embeddings stay in the model's dtype (the head is
sampled from: its error would move every token's log-prob; it is also only run on sampled rows).

Activation outliers (a few input channels far larger than the rest) are what per-token rounding
loses most to, so our own models are first smoothed (SmoothQuant, Xiao et al. 2023): a fixed
calibration text runs through the fp32 model once at load, each linear layer's input channels
get s_j = max|x_j|^a / max|w_:,j|^(1-a) (a = 0.5), the weights' columns are multiplied by s and
the producer of their input divided by it: the RMSNorm before q/k/v and before gate/up, the
up_proj rows before down_proj (SiLU(gate) * up is linear in up). The float model is unchanged
(up to rounding); the int8 one rounds activations whose channels are evened out. A LoRA adapter's
A is multiplied by the same s when loaded (`input_scale`), since its layer now sees x / s.

int8_weight_only (aliases w8a16, int8_wo; torchao's name): W8A16, OpenVINO's default int8 weight
compression. Each weight row n is rounded to int8 by its own symmetric scale s[n] (max|w[n]| / 127,
itself rounded to 16 significant bits so that every q * s is exact in fp32); activations stay
float, nothing is rounded per step: y = x @ (q * s)^T + b. No smoothing (it moves activation
outliers into the weights, which is what a weight-only mode rounds). Served by the grouped 8-bit
kernel (kernels/cpu_gemm_q4.c, every CPU build) as one group of K per row: codes q + 128, scale s,
min -128 s, whose fma(q + 128, s, -128 s) is exactly q * s; so a W8A16 model computes bit for bit
what the fp32 model holding the dequantized weights q * s computes on that kernel path. Without a
kernel (the torch backend, a GPU) quant_int4.TorchGroupedPack dequantizes per call and torch multiplies.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from handler.config.numerics import Numerics
from handler.model.linear import CpuLinear, Pack, replace
from kernels import cpu as cpu_ext

log = logging.getLogger("lmi.quant")

METHODS = {"int8": "int8", "w8a8": "int8", "int8_dynamic": "int8",
           "int8_weight_only": "w8a16", "w8a16": "w8a16", "int8_wo": "w8a16"}
SCALE_BITS = 16     # significant bits kept in a W8A16 row scale (8-bit code x 16 bits: exact in fp32)


def smooths(method: str) -> bool:
    """Whether `method` is smoothed before quantizing (W8A8 only: see the module doc)."""
    return METHODS.get(method) == "int8"
SMOOTH_ALPHA = 0.5
# Calibration: chat-shaped English and code, not the text `handler quality` measures perplexity on.
CALIBRATION = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Could you summarise how a bill becomes a law, and then write a short Python function that counts the
words in a sentence?<|im_end|>
<|im_start|>assistant
A bill is drafted, introduced in one chamber, studied by a committee, debated and voted on; if it
passes, the other chamber does the same, differences are reconciled, and the final text is signed
into law or vetoed. Here is the function:

def count_words(sentence: str) -> int:
    \"\"\"Number of whitespace-separated words in `sentence`.\"\"\"
    return len(sentence.split())

print(count_words("The quick brown fox jumps over the lazy dog"))  # 9
<|im_end|>
<|im_start|>user
Thanks! What are three things to check before a long bicycle ride? Answer as a JSON list.<|im_end|>
<|im_start|>assistant
["tyre pressure", "brakes", "chain lubrication"]<|im_end|>
"""


@dataclasses.dataclass(eq=False)
class Int8Pack(Pack):
    """y = dequant(int8(x) @ int8(W)^T) + b, x rounded per row, W per output channel (see the module
    doc): kernels/cpu_gemm_i8.c's `panels` (with `wsum`) where it runs, else `qweight` [N, K] int8
    through the torch reference."""
    wscale: torch.Tensor                # [N] fp32
    panels: torch.Tensor | None = None
    wsum: torch.Tensor | None = None
    qweight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        if self.panels is not None:
            y = cpu_ext.gemm_i8(xf, self.panels, self.wsum, self.wscale, layer.out_features, layer.bias32)
        else:
            y = int8_reference(xf, self.qweight, self.wscale, layer.bias32)
        return y.to(dt)

    def tensors(self) -> list[torch.Tensor]:
        return [self.panels] if self.panels is not None else []

    def held(self) -> list[torch.Tensor]:
        return [t for t in (self.panels, self.wsum, self.wscale, self.qweight) if t is not None]

    def lin(self, dtype):
        if self.panels is None or not self.wscale.is_contiguous():
            return super().lin(dtype)
        return (cpu_ext.LIN_I8, {"panels": self.panels.data_ptr(), "wsum": self.wsum.data_ptr(),
                                 "wscale": self.wscale.data_ptr()}, [self.panels, self.wsum, self.wscale])


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] fp32): each row by max|row| / 127, round to nearest even."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp_(-127, 127).to(torch.int8), scale


def int8_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in torch ops: x [..., K] fp32 -> [..., N] fp32 (the integer sum in
    fp64, exact for any K this serves)."""
    qa, sa = quantize_rows(x.reshape(-1, x.shape[-1]))
    acc = qa.double() @ qweight.to(qa.device).double().T
    y = (acc * sa.double()[:, None] * wscale.double()[None]).float()
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], qweight.shape[0])


def quantize_rows_w8a16(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] fp32 of SCALE_BITS significant bits): each row
    symmetric by max|row| / 127 (round half to even; an all-zero row has scale 0)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    drop = 24 - SCALE_BITS                              # fp32's 24 significant bits -> SCALE_BITS
    bits = scale.view(torch.int32)
    bits = (bits + (1 << (drop - 1))) & ~((1 << drop) - 1)     # round to nearest (ties away), positive floats
    scale = bits.view(torch.float32)
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp_(-127, 127).to(torch.int8), scale


def w8a16_grouped(w: torch.Tensor):
    """[N, K] float -> quant_int4.Grouped: 8-bit codes q + 128, one group of K, min -128 s."""
    from handler.model.quant_int4 import Grouped
    q, s = quantize_rows_w8a16(w)
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    return Grouped(codes.contiguous(), s[:, None].contiguous(), (-128.0 * s)[:, None].contiguous(), 8, w.shape[1])


def _head(model: nn.Module) -> nn.Linear | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _targets(model: nn.Module, head: bool) -> list[tuple[str, nn.Linear]]:
    out = _head(model)
    return [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and (head or m is not out)]


def _untie_head(model: nn.Module) -> None:
    """The head its own copy of a tied embedding's weight (smoothing scales the head's columns;
    the quantized head replaces its weight): the embedding keeps the original."""
    out, emb = _head(model), model.get_input_embeddings()
    if out is not None and emb is not None and out.weight is emb.weight:
        out.weight = nn.Parameter(out.weight.detach().clone(), requires_grad=False)


def head_quantized(method: str, setting: str = "auto") -> bool:
    """Whether `method` quantizes the output head: option.quantize_head's `true` / `false`, else
    (`auto`) by method. A weight-only int8 head keeps perplexity (SmolLM2 0.989/1.014,
    Qwen2.5-Coder-0.5B 1.000/0.996 of fp32) and is a third of a one-row step's bytes on a 150k
    vocabulary; a W8A8 head does not (+2.5%)."""
    if setting in ("true", "false"):
        return setting == "true"
    return METHODS.get(method) == "w8a16"


def quantize_model(model: nn.Module, method: str, head: bool = False, numerics: Numerics = Numerics()) -> int:
    """Replace every linear layer but the output head (with `head`, that one too) by a CpuLinear
    holding `method`'s pack; returns how many. `numerics`: the grouped packs' settings (W8A16)."""
    kind = METHODS.get(method)
    if kind is None:
        raise ValueError(f"unknown quantization {method!r}")
    if head:
        _untie_head(model)
    if kind == "w8a16":
        return _quantize_w8a16(model, head, numerics)
    kernel = cpu_ext.gemm_i8_available()
    done = 0
    for name, m in _targets(model, head):
        q, scale = quantize_rows(m.weight)
        pack = Int8Pack(scale.to(m.weight.device))
        if kernel and m.weight.device.type == "cpu":
            pack.panels, pack.wsum = cpu_ext.pack_i8(q)
        else:
            pack.qweight = q.to(m.weight.device)
        replace(model, name, CpuLinear(m, pack))   # the int8 copy replaces the weight
        done += 1
    log.info("int8: %d linear layers quantized (%s); the output head %s", done,
             f"kernels/cpu_gemm_i8.c, the {cpu_ext.backend().isa} build" if kernel
             else "reference torch ops: no int8 kernel build here",
             "too (option.quantize_head)" if head else
             "stays " + str(next(model.parameters()).dtype).removeprefix("torch."))
    return done


def _quantize_w8a16(model: nn.Module, head: bool, numerics: Numerics) -> int:
    from handler.model.quant_int4 import install, use_kernel
    done, kernel = 0, None
    for name, m in _targets(model, head):
        if kernel is None:
            kernel = use_kernel(m.weight.device)
        install(model, name, w8a16_grouped(m.weight), "int8_weight_only", kernel, numerics)
        done += 1
    log.info("int8_weight_only: %d linear layers as int8 weights per output channel (%s); the output head %s",
             done, f"kernels/cpu_gemm_q4.c, the {cpu_ext.backend().isa} build" if kernel
             else "dequantized per call for torch: no grouped kernel here",
             "too (option.quantize_head)" if head else
             "stays " + str(next(model.parameters()).dtype).removeprefix("torch."))
    return done


def smooth_groups(model: nn.Module, head: bool = False) -> list[tuple[nn.Module, list[nn.Linear]]] | None:
    """(producer, consumers) pairs whose consumers' inputs are the producer's output, for our
    Llama family with pre-norms (handler/model/llama.py); None for any other model. With `head`,
    the final norm and the output head too."""
    arch = getattr(model, "arch", None)
    if arch is None or arch.post_norms or arch.gemma:    # Gemma: the norms' 1 + weight does not scale
        return None
    groups = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if a.qkv_proj is not None:
            raise ValueError("smooth before fuse_projections: smoothing scales q/k/v and up_proj apart")
        groups.append((layer.input_layernorm, [a.q_proj, a.k_proj, a.v_proj]))
        experts = getattr(m, "experts", None)
        if experts is not None:     # MoE (handler/model/moe.py): the norm feeds the routers and every expert
            mlps = [*experts] + ([m.shared_expert] if hasattr(m, "shared_expert") else [])
            routers = [m.gate] + ([m.shared_expert_gate] if hasattr(m, "shared_expert_gate") else [])
            groups.append((layer.post_attention_layernorm, routers + [p for e in mlps for p in (e.gate_proj, e.up_proj)]))
            groups += [(e.up_proj, [e.down_proj]) for e in mlps]
            continue
        groups.append((layer.post_attention_layernorm, [m.gate_proj, m.up_proj]))
        groups.append((m.up_proj, [m.down_proj]))
    if head:
        _untie_head(model)
        groups.append((model.model.norm, [model.lm_head]))
    return groups


@torch.no_grad()
def smooth(model: nn.Module, run_calibration, alpha: float = SMOOTH_ALPHA, head: bool = False) -> int:
    """SmoothQuant our model in place (see the module doc); `run_calibration()` runs the
    calibration text through it once. Returns how many layers were smoothed (0: not ours)."""
    groups = smooth_groups(model, head)
    if not groups:
        return 0
    consumers = {id(c): c for _, cs in groups for c in cs}
    amax: dict[int, torch.Tensor] = {}

    def hook(mod, args):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
        amax[id(mod)] = x if id(mod) not in amax else torch.maximum(amax[id(mod)], x)

    handles = [c.register_forward_pre_hook(hook) for c in consumers.values()]
    try:
        run_calibration()
    finally:
        for h in handles:
            h.remove()
    done = 0
    for producer, cs in groups:
        seen = [amax[id(c)] for c in cs if id(c) in amax]
        if not seen:        # an expert no calibration token was routed to: left as it is
            continue
        done += 1
        xmax = torch.stack(seen).amax(0).clamp_min(1e-5)
        wmax = torch.stack([c.weight.detach().abs().amax(0).float() for c in cs]).amax(0).clamp_min(1e-5)
        s = (xmax.pow(alpha) / wmax.pow(1 - alpha)).clamp_min(1e-5)
        if isinstance(producer, nn.Linear):     # up_proj: its output rows
            producer.weight.div_(s[:, None].to(producer.weight.dtype))
            if producer.bias is not None:
                producer.bias.div_(s.to(producer.bias.dtype))
        else:                                   # an RMSNorm: its weight
            producer.weight.div_(s.to(producer.weight.dtype))
        for c in cs:
            c.weight.mul_(s[None].to(c.weight.dtype))
            c.input_scale = s.to(c.weight.device)
    return done
