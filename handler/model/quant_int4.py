"""Grouped low-bit weights (AWQ, GPTQ, GGUF Q4_0/Q4_1/Q8_0) served without dequantizing them.

One internal format for every source (handler/model/quant_formats.py converts each):

    W[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g]

q: uint8 [N, K] holding 4-bit (0..15) or 8-bit (0..255) codes; scales, mins: fp32 [N, G],
G = ceil(K / g). AWQ/GPTQ's w = (q - z) * s is mins = -z * s; GGUF Q4_1's w = d * q + m is
scales = d, mins = m; Q4_0's d * (q - 8) is mins = -8 d; Q8_0's d * q (q signed) is codes q + 128
with mins = -128 d. For every one of them q * s is exact in fp32 (an fp16 scale times a code of
at most 8 bits) and q * s + m rounds once: the weight the format defines, bit for bit.

Q4Linear is an `nn.Linear` whose class is swapped in (as quant.Int8Linear), so the model around it,
LoRA's wrapper (which reads `weight` for its dtype/device: an empty tensor is kept) and tensor-
parallel sharding are unchanged. Its forward on a CPU with AVX-512F is kernels/cpu_gemm_q4.c (W4A16:
each panel's codes dequantized in registers, fp32 activations, the same FMA order as the fp32 panel
GEMM, so bit for bit the dequantized model's results on that path); on CUDA kernels/triton_q4.py
(codes two per byte, dequantized per tile inside a Triton GEMM; checked under the Triton interpreter
and compiled for sm_90 here, not yet run on a GPU); elsewhere (8-bit codes on CUDA, no compiler) the
weight is dequantized to the activation dtype per call and multiplied by torch (correct, slow).

Tensor parallelism: a column-parallel layer (q/k/v/gate/up) is cut along N, rows of q, scales and
mins alike; a row-parallel one (o/down) along K in whole groups (refused with one line otherwise).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ext

log = logging.getLogger("lmi.quant")

PANEL = 32


class QuantLoadError(ValueError):
    """One line: what in the quantized checkpoint cannot be served, and what is allowed."""


@dataclass
class Grouped:
    """A weight in the internal grouped format (see the module doc)."""
    q: torch.Tensor         # uint8 [N, K]
    scales: torch.Tensor    # fp32 [N, G]
    mins: torch.Tensor      # fp32 [N, G]
    bits: int               # 4 or 8
    group: int              # g

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: q * s + m in fp32 (exact product, one rounding), then cast."""
        n, k = self.q.shape
        s = self.scales.repeat_interleave(self.group, dim=1)[:, :k]
        m = self.mins.repeat_interleave(self.group, dim=1)[:, :k]
        return torch.addcmul(m, self.q.float(), s).to(dtype)

    def rows(self, idx: torch.Tensor) -> "Grouped":
        """Output channels reordered / selected by idx (e.g. GGUF's q/k row permutation undone)."""
        return Grouped(self.q[idx], self.scales[idx], self.mins[idx], self.bits, self.group)

    def cut(self, kind: str | None, rank: int, size: int, name: str = "") -> "Grouped":
        """This rank's piece: "column" along N, "row" along K in whole groups (module doc)."""
        if size == 1 or kind is None:
            return self
        if kind == "column":
            return Grouped(*(t.chunk(size, 0)[rank] for t in (self.q, self.scales, self.mins)), self.bits, self.group)
        if kind == "row":
            n, k = self.q.shape
            g_count = self.scales.shape[1]
            if g_count % size or k != g_count * self.group:
                raise QuantLoadError(f"{name}: {k} inputs in {g_count} groups of {self.group} cannot be cut in "
                                     f"whole groups across {size} ranks; allowed: a tensor_parallel_degree "
                                     f"dividing {g_count}")
            return Grouped(*(t.chunk(size, 1)[rank] for t in (self.q, self.scales, self.mins)), self.bits, self.group)
        raise QuantLoadError(f"{name}: shard kind {kind!r} is not supported for quantized weights")

    def cat_rows(parts: list["Grouped"]) -> "Grouped":   # noqa: N805 (used as Grouped.cat_rows)
        a = parts[0]
        return Grouped(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([p.mins for p in parts]), a.bits, a.group)


def pack(w: Grouped) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (kernels/cpu_gemm_q4.c): codes [np][K][16] (4-bit: column j low nibble,
    j + 16 high) or [np][K][32] bytes; scales and mins [np][G][32] fp32; zero padded to np * 32 columns."""
    n, k = w.q.shape
    g = w.scales.shape[1]
    npan = -(-n // PANEL)
    q = torch.zeros(npan * PANEL, k, dtype=torch.uint8)
    q[:n] = w.q
    q = q.view(npan, PANEL, k)
    codes = (q[:, :16] | (q[:, 16:] << 4)) if w.bits == 4 else q
    out = []
    for t in (w.scales, w.mins):
        p = torch.zeros(npan * PANEL, g, dtype=torch.float32)
        p[:n] = t
        out.append(p.view(npan, PANEL, g))
    # streamed every step: contiguous copies, in huge-page-advised memory (kernels/cpu_ext.py) where
    # a row is one group (W8A16). With several groups a row (GGUF blocks, AWQ/GPTQ) the served step
    # was slower so (Qwen 0.5B q4_k_m at 1 client: 29.2 against 23.0 ms TPOT, one run each; cause not
    # found, benchmarks/results/hugepages/), so those stay in torch's memory.
    huge = g == 1
    codes, sc, mn = (_streamed(t.permute(0, 2, 1), huge) for t in (codes, *out))
    return codes.view(-1), sc, mn


def _streamed(t: torch.Tensor, huge: bool) -> torch.Tensor:
    """A contiguous copy of t where a step's stream reads it (cpu_ext.empty_hugepage when huge)."""
    if not huge:
        return t.contiguous()
    return cpu_ext.empty_hugepage(t.shape, t.dtype).copy_(t)


class Q4Linear(nn.Linear):
    """y = x @ W^T + b with W held grouped (the module doc); `fmt` names the source format."""

    grouped: Grouped | None     # kept where the kernel does not serve (the torch path)
    panels: torch.Tensor | None
    qscales: torch.Tensor | None
    qmins: torch.Tensor | None
    bits: int
    group: int
    bias32: torch.Tensor | None
    fmt: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            dt = x.dtype
            y = cpu_ext.gemm_q(x.float(), self.panels, self.qscales, self.qmins, self.bits, self.group,
                               self.out_features, self.bias32)
            return y.to(dt)
        if getattr(self, "qbytes", None) is not None:     # CUDA: kernels/triton_q4.py
            from kernels import triton_q4
            return triton_q4.q4_gemm(x, self.qbytes, self.qscales, self.qmins, self.group, self.out_features,
                                     self.in_features, None if self.bias is None else self.bias.to(x.dtype))
        w = self.grouped
        dev = x.device
        wd = Grouped(w.q.to(dev), w.scales.to(dev), w.mins.to(dev), w.bits, w.group).dequantize(x.dtype)
        return F.linear(x, wd, None if self.bias is None else self.bias.to(x.dtype))


def use_kernel(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_ext.gemm_q_available()


def install(m: nn.Linear, w: Grouped, fmt: str, kernel: bool) -> Q4Linear:
    """Turn nn.Linear `m` (its bias already loaded, if any) into a Q4Linear holding `w`, in place."""
    n, k = w.shape
    if (n, k) != (m.out_features, m.in_features):
        raise QuantLoadError(f"{fmt} weight of shape [{n}, {k}] does not fit a {m.in_features} -> {m.out_features} "
                             "layer (config.json and the weights disagree)")
    m.bits, m.group, m.fmt = w.bits, w.group, fmt
    m.bias32 = None if m.bias is None else m.bias.detach().float().contiguous()
    dev = m.weight.device
    m.qbytes = None
    if kernel:
        m.panels, m.qscales, m.qmins = pack(w)
        m.grouped = None
    elif dev.type == "cuda" and w.bits == 4 and _triton():
        from kernels.triton_q4 import pack_k   # two codes per byte along K; scales / mins [N, G]
        m.qbytes = pack_k(w.q).to(dev)
        m.qscales, m.qmins = w.scales.to(dev).contiguous(), w.mins.to(dev).contiguous()
        m.grouped = m.panels = None
    else:
        m.grouped = Grouped(w.q.to(dev), w.scales.to(dev), w.mins.to(dev), w.bits, w.group)
        m.panels = m.qscales = m.qmins = None
    m.__class__ = Q4Linear
    # The grouped copy replaces it; an empty tensor keeps dtype/device for readers (LoRA).
    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
    return m


def _triton() -> bool:
    import kernels
    return kernels.triton_available()


def grouped_of(m: Q4Linear) -> Grouped:
    """A Q4Linear's weight back in the internal format (any path)."""
    if m.grouped is not None:
        return m.grouped
    if getattr(m, "qbytes", None) is not None:
        b = m.qbytes
        q = torch.stack([b & 0xF, b >> 4], dim=2).reshape(b.shape[0], -1)[:, :m.in_features]
        return Grouped(q.contiguous(), m.qscales, m.qmins, m.bits, m.group)
    n, k = m.out_features, m.in_features
    npan = -(-n // PANEL)
    g_count = m.qscales.shape[1]      # qscales / qmins: [np, G, 32]
    codes = m.panels.view(npan, k, -1)
    if m.bits == 4:
        q = torch.cat([codes & 0xF, codes >> 4], dim=2)
    else:
        q = codes
    q = q.permute(0, 2, 1).reshape(npan * PANEL, k)[:n]
    s, mn = (t.view(npan, g_count, PANEL).permute(0, 2, 1).reshape(npan * PANEL, g_count)[:n]
             for t in (m.qscales, m.qmins))
    return Grouped(q.contiguous(), s.contiguous(), mn.contiguous(), m.bits, m.group)


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """option.quantize=none on a quantized checkpoint: every Q4Linear back to a plain nn.Linear
    holding its dequantized weight in `dtype`. Returns how many."""
    done = 0
    for m in list(model.modules()):
        if isinstance(m, Q4Linear):
            w = grouped_of(m).dequantize(torch.float32)
            dev = m.weight.device
            for a in ("grouped", "panels", "qbytes", "qscales", "qmins", "bits", "group", "bias32", "fmt"):
                m.__dict__.pop(a, None)
            m.__class__ = nn.Linear
            m.weight = nn.Parameter(w.to(device=dev, dtype=dtype), requires_grad=False)
            done += 1
    return done


def describe(model: nn.Module) -> str:
    layers = [m for m in model.modules() if isinstance(m, Q4Linear)]
    if not layers:
        return "no grouped quantized layers"
    fmts = sorted({f"{m.fmt} ({m.bits}-bit, group {m.group})" for m in layers})
    path = ("kernels/cpu_gemm_q4.c" if layers[0].panels is not None else "kernels/triton_q4.py"
            if getattr(layers[0], "qbytes", None) is not None else "dequantize + torch matmul (no kernel here)")
    return f"{len(layers)} linear layers served grouped: {', '.join(fmts)}, by {path}"
