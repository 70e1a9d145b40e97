"""The layers our own models (handler/model/llama.py) are built from.

Linear layers are plain `nn.Linear` modules: the CPU GEMM paths (handler/model/cpu.py packs them
for kernels/cpu_gemm.c or oneDNN), LoRA's per-row wrapper (handler/model/lora.py) and quantized
linears take any `nn.Linear`, so none of them needs to know which model it sits in. Tensor
parallelism is a property of where a weight is cut, declared per layer as a `Shard` (nano-vllm's
column / row / QKV-parallel linears): column-parallel layers keep 1/N of the output rows (whole
heads), row-parallel layers 1/N of the input columns and all-reduce their partial sums
(`TensorParallel.reduce`); a row-parallel layer's bias lives on rank 0 (zeros elsewhere), so
the sum adds it once and every layer stays a plain `nn.Linear` call.

RMSNorm has the three ways families round (Llama: normalise in fp32, round, then the weight
product; OLMo-2: the weight product in fp32, then round; Gemma: times 1 + weight in fp32).
Rotary keeps transformers' arithmetic per position (frequencies x position in fp32, cos/sin
scaled, rounded to the model's dtype), read from a table for every position below the context
length, so the values are transformers' own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_ext
from kernels.cpu.probes import TORCH_GRAIN


# ---------------------------------------------------------------------------- tensor parallel
@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group (rank 0 of 1: no parallelism)."""
    rank: int = 0
    size: int = 1

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs across the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x)
        return x


@dataclass(frozen=True)
class Shard:
    """How one checkpoint tensor is cut for this rank.
    kind: None (whole), "column" (output rows), "row" (input columns), "qkv" (a fused
    q/k/v weight: each of the three parts cut by heads), "pair" (a fused gate/up weight: each
    half cut). `parts` gives the fused parts' sizes along dim 0 (q, k, v) or (gate, up)."""
    kind: str | None = None
    parts: tuple[int, ...] = ()


def shard(t: torch.Tensor, spec: Shard, tp: TensorParallel) -> torch.Tensor:
    """This rank's piece of checkpoint tensor `t` (the whole tensor with one rank)."""
    if tp.size == 1 or spec.kind is None:
        return t
    if spec.kind == "column":
        return t.chunk(tp.size, 0)[tp.rank]
    if spec.kind == "row":
        # a bias: rank 0's partial sum carries it, so the all-reduce adds it once
        return t.chunk(tp.size, -1)[tp.rank] if t.dim() > 1 else (t if tp.rank == 0 else torch.zeros_like(t))
    if spec.kind in ("qkv", "pair"):
        return torch.cat([p.chunk(tp.size, 0)[tp.rank] for p in t.split(list(spec.parts), 0)], 0)
    raise ValueError(f"unknown shard kind {spec.kind!r}")


# ---------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; `style` is the family's rounding (see the module doc)."""

    def __init__(self, size: int, eps: float, style: str = "llama", dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps, self.style = float(eps), style
        self.cpu_kernel: str | None = None      # bind_kernel(), at load: how Llama's rounding runs on CPU

    def bind_kernel(self) -> None:
        """At load, once the weight has its memory: how this norm computes on the CPU (Llama's
        rounding). fp32: "f32", kernels/cpu_exact.c, bit for bit torch's values where a summing
        width reproduces torch's sums for this size, else "torch" (torch's fused F.rms_norm); bf16:
        "bf16", the C kernel. None elsewhere (a GPU, other families, no kernel build): the formula."""
        w, self.cpu_kernel = self.weight, None
        if self.style != "llama" or w.device.type != "cpu":
            return
        built = cpu_ext.load() is not None
        if w.dtype == torch.float32:
            self.cpu_kernel = "f32" if built and cpu_ext.rms_norm_f32_lanes(w.shape[0]) else "torch"
        elif w.dtype == torch.bfloat16 and built:
            self.cpu_kernel = "bf16"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "llama":
            kernel = self.cpu_kernel
            # The C kernel sums as torch does for rows below torch's parallel grain (past it torch
            # splits its sums across threads) and for contiguous rows (q/k norms over a fused
            # projection's views take torch's path): a rule on the shape, not a capability probe.
            if kernel == "f32" and x.is_contiguous() and 0 < x.numel() < TORCH_GRAIN:
                return cpu_ext.rms_norm_f32(x, self.weight, self.eps)
            if kernel in ("f32", "torch"):
                return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
            if kernel == "bf16" and x.is_contiguous():
                return cpu_ext.rms_norm_bf16(x, self.weight, self.eps)
            return self.weight * self._normed(x).to(x.dtype)
        if self.style == "olmo2":
            return (self.weight * self._normed(x)).to(x.dtype)
        if self.style == "gemma":
            return (self._normed(x) * (1.0 + self.weight.float())).to(x.dtype)
        raise ValueError(f"unknown RMSNorm style {self.style!r}")

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


# ---------------------------------------------------------------------------- rotary
def rope_parameters(config) -> dict:
    """The config's rope settings as transformers 5 names them (`rope_parameters`), also from a
    config that still says `rope_scaling` / `rope_theta`."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params
    out = dict(getattr(config, "rope_scaling", None) or {})
    out.setdefault("rope_type", out.get("type", "default"))
    out.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return out


class Rotary:
    """cos/sin per position, [T, D] in the model's dtype, as transformers computes them.

    default / linear / llama3 / yarn: one set of frequencies, a table over every position.
    dynamic (NTK) and longrope change the frequencies with a sequence's length: positions of a
    sequence whose length passes the original context are computed with the frequencies for
    that length (transformers' `dynamic_rope_update` on one sequence).
    `layer_type`: a config with rope parameters per layer type (Gemma 3's `rope_parameters`
    {"sliding_attention": {...}, "full_attention": {...}}): this type's."""

    GROWING = ("dynamic", "longrope")

    def __init__(self, config, head_dim: int, max_positions: int, dtype, device, layer_type: str | None = None):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = rope_parameters(config) if layer_type is None else config.rope_parameters[layer_type]
        self.kind = params.get("rope_type", "default")
        self.config, self.dtype, self.device = config, dtype, device
        self._kw = {} if layer_type is None else {"layer_type": layer_type}
        if self.kind == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
            self.scale = 1.0
            self._init = None
        else:
            self._init = ROPE_INIT_FUNCTIONS[self.kind]
            inv_freq, self.scale = self._init(config, torch.device("cpu"), **self._kw)
        self.inv_freq = inv_freq.to(device)
        self.original = int(params.get("original_max_position_embeddings")
                            or getattr(config, "max_position_embeddings", max_positions))
        rows = self.original if self.kind in self.GROWING else max_positions
        self.cos, self.sin = self._table(torch.arange(rows, device=device), self.inv_freq, self.scale)

    def _table(self, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float):
        freqs = pos[:, None].float() * inv_freq.to(device=pos.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)

    def __call__(self, pos: torch.Tensor, seq_lens: list[int], qsl: list[int]):
        """cos, sin [T, D] for a packed step's positions (`seq_lens`/`qsl`: per sequence, on the
        host, for the growing kinds)."""
        if self.kind not in self.GROWING or max(seq_lens) <= self.original:
            return self.cos[pos], self.sin[pos]
        cos, sin = self.cos.new_empty(pos.shape[0], self.cos.shape[1]), self.sin.new_empty(pos.shape[0], self.sin.shape[1])
        for s, n in enumerate(seq_lens):
            a, b = qsl[s], qsl[s + 1]
            if n <= self.original:
                cos[a:b], sin[a:b] = self.cos[pos[a:b]], self.sin[pos[a:b]]
            else:
                kw = {"seq_len": n} if self.kind == "dynamic" else {"seq_len": self.original + 1}
                inv, scale = self._init(self.config, self.device, **kw, **self._kw)
                cos[a:b], sin[a:b] = self._table(pos[a:b], inv, scale)
        return cos, sin


    def mrope(self, pos3: torch.Tensor, sections: tuple):
        """cos, sin [T, D] for M-RoPE positions [3, T]: frequency j takes the position of its section
        (time, height, width, in `sections` sizes over the first half, repeated over the second), as
        transformers' Qwen2-VL rotary recomposes them; the values are the table's."""
        sel = getattr(self, "_mrope_sel", None)
        if sel is None or sel.shape[0] != self.cos.shape[1]:
            half = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(sections)])
            sel = self._mrope_sel = torch.cat([half, half]).to(self.device)
        idx = sel.view(1, 1, -1).expand(1, pos3.shape[1], -1)
        return self.cos[pos3].gather(0, idx)[0], self.sin[pos3].gather(0, idx)[0]


def linear(n_in: int, n_out: int, bias: bool, dtype, device) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device).requires_grad_(False)


def fused(parts: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose output is the parts' outputs side by side (a part without a bias
    contributes zeros to the fused bias)."""
    w = parts[0].weight
    out = linear(w.shape[1], sum(p.out_features for p in parts), any(p.bias is not None for p in parts),
                  w.dtype, w.device)
    out.weight.copy_(torch.cat([p.weight.detach() for p in parts]))
    if out.bias is not None:
        out.bias.copy_(torch.cat([p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.out_features)
                                  for p in parts]))
    return out


# A gated MLP's activations by the config's name (hidden_act / Gemma's hidden_activation): transformers'
# ACT2FN values, the same torch calls.
ACTIVATIONS = {"silu": None, "gelu_pytorch_tanh": "tanh"}


class GatedMlp(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU (or Gemma's tanh-approximated GELU, `act`): Llama's MLP
    (handler/model/llama.py, which adds the all-reduce) and each expert of a mixture
    (handler/model/moe.py), `width` its intermediate size (this rank's)."""

    def __init__(self, hidden: int, width: int, dtype, device, act: str = "silu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation {act!r} (ours: {', '.join(ACTIVATIONS)})")
        self.act = act
        self.gate_proj = linear(hidden, width, False, dtype, device)
        self.up_proj = linear(hidden, width, False, dtype, device)
        self.down_proj = linear(width, hidden, False, dtype, device)
        self.gate_up_proj = None    # fuse(): gate and up in one layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            # [T, 2I]: gate's half copied out (torch's SiLU on a strided view takes another path
            # that rounds differently from its vectorised one), activated in place, times up's.
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            h = self._act(gate.contiguous()).mul_(up)
        else:
            h = self._act(self.gate_proj(x)).mul_(self.up_proj(x))
        return self.down_proj(h)

    def _act(self, gate: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return F.silu(gate, inplace=True)
        return F.gelu(gate, approximate="tanh")

    def fuse(self) -> None:
        """gate and up as one layer, where both are still plain nn.Linear (a loader's quantized
        layers, e.g. GGUF's blocks, stay apart)."""
        if type(self.gate_proj) is nn.Linear and type(self.up_proj) is nn.Linear:
            self.gate_up_proj = fused([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj
