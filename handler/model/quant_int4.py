"""Grouped low-bit weights (AWQ, GPTQ, GGUF Q4_0/Q4_1/Q8_0) served without dequantizing them.

One internal format for every source (handler/model/quant_formats.py converts each):

    W[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g]

q: uint8 [N, K] holding 4-bit (0..15) or 8-bit (0..255) codes; scales, mins: fp32 [N, G],
G = ceil(K / g). AWQ/GPTQ's w = (q - z) * s is mins = -z * s; GGUF Q4_1's w = d * q + m is
scales = d, mins = m; Q4_0's d * (q - 8) is mins = -8 d; Q8_0's d * q (q signed) is codes q + 128
with mins = -128 d. For every one of them q * s is exact in fp32 (an fp16 scale times a code of
at most 8 bits) and q * s + m rounds once: the weight the format defines, bit for bit. GGUF's
K-quants also keep their two levels (`Sub`: an fp16 superblock scale times 6/8-bit sub-scales), so
the kernel can stream those instead of fp32 scales and mins.

What the kernel streams (`pack`, kernels/cpu_gemm_q4.c's layout): 4-bit codes as nibbles, wider
ones as bytes (or packed to 5/6 bits under option.grouped_code_layout=packed: fewer bytes, more
instructions; with fp32 activations slower on a 2-core host, with int8 ones faster at one row on avx512),
and the scales and mins as the two levels where a weight has them, as
fp16 where fp16 holds them exactly (GGUF's 32-blocks), else fp32. Bits a weight (GGUF's own):
Q4_K 4.75 (4.5), Q5_0 9 (5.5; packed 6), Q6_K 8.75 (6.56; packed 6.75), Q8_0 9 (8.5), against
6 / 10 / 12 / 10 with fp32 scales and mins. Each mode gives the kernel the same fp32 scale and
min, so the same weights.

A grouped layer is a handler/model/linear.py CpuLinear (an `nn.Linear` put in the plain layer's
place: the model around it, LoRA's wrapper, which reads `weight` for its dtype/device, and tensor-
parallel sharding are unchanged) holding one of three packs, chosen at load: GroupedPack on a CPU
whose kernel build runs kernels/cpu_gemm_q4.c (avx512, avx2, neon; W4A16: each panel's codes
dequantized in registers, fp32 activations, the same FMA order as the fp32 panel GEMM, so bit for bit
the dequantized model's results on that path; or int8 activations where the QPack says so,
option.cpu_grouped_activations=int8); TritonGroupedPack on CUDA, kernels/triton_q4.py (codes two per
byte, dequantized per tile inside a Triton GEMM; checked under the Triton interpreter and compiled for
sm_90 here, not yet run on a GPU); TorchGroupedPack elsewhere (8-bit codes on CUDA, no compiler): the
weight dequantized to the activation dtype per call and multiplied by torch (correct, slow).

Tensor parallelism: a column-parallel layer (q/k/v/gate/up) is cut along N, rows of q, scales and
mins alike; a row-parallel one (o/down) along K in whole groups (refused with one line otherwise).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from handler.config.numerics import Numerics
from handler.model.linear import CpuLinear, Pack, plain, replace
from kernels import cpu as cpu_ext

log = logging.getLogger("lmi.quant")

PANEL = 32


class QuantLoadError(ValueError):
    """One line: what in the quantized checkpoint cannot be served, and what is allowed."""


@dataclass
class Sub:
    """Two-level scales: scales = d[:, j // sg] * a[:, j] and mins = e[:, j // sg] * b[:, j] for
    group j, exactly in fp32 (GGUF's K-quants: d an fp16 value, a and b 6/8-bit integers)."""
    d: torch.Tensor         # fp32 [N, ceil(G / sg)]
    a: torch.Tensor         # int8 [N, G]
    e: torch.Tensor         # fp32 [N, ceil(G / sg)]
    b: torch.Tensor         # int8 [N, G]
    sg: int                 # groups per superblock

    def rows(self, idx) -> "Sub":
        return Sub(self.d[idx], self.a[idx], self.e[idx], self.b[idx], self.sg)

    def chunk(self, size: int, rank: int, dim: int) -> "Sub":
        return Sub(*(t.chunk(size, dim)[rank] for t in (self.d, self.a, self.e, self.b)), self.sg)

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales, mins) fp32 [N, G]."""
        g = self.a.shape[1]
        return ((self.d.repeat_interleave(self.sg, dim=1)[:, :g] * self.a.float()),
                (self.e.repeat_interleave(self.sg, dim=1)[:, :g] * self.b.float()))


@dataclass
class Grouped:
    """A weight in the internal grouped format (see the module doc)."""
    q: torch.Tensor         # uint8 [N, K]
    scales: torch.Tensor    # fp32 [N, G]
    mins: torch.Tensor      # fp32 [N, G]
    bits: int               # 4 or 8 (codes above 15: 8)
    group: int              # g
    sub: Sub | None = None  # the same scales and mins in two levels, where the source has them

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
        return Grouped(self.q[idx], self.scales[idx], self.mins[idx], self.bits, self.group,
                       None if self.sub is None else self.sub.rows(idx))

    def cut(self, kind: str | None, rank: int, size: int, name: str = "") -> "Grouped":
        """This rank's piece: "column" along N, "row" along K in whole groups (module doc)."""
        if size == 1 or kind is None:
            return self
        if kind == "column":
            return Grouped(*(t.chunk(size, 0)[rank] for t in (self.q, self.scales, self.mins)), self.bits, self.group,
                           None if self.sub is None else self.sub.chunk(size, rank, 0))
        if kind == "row":
            n, k = self.q.shape
            g_count = self.scales.shape[1]
            if g_count % size or k != g_count * self.group:
                raise QuantLoadError(f"{name}: {k} inputs in {g_count} groups of {self.group} cannot be cut in "
                                     f"whole groups across {size} ranks; allowed: a tensor_parallel_degree "
                                     f"dividing {g_count}")
            sub = self.sub          # kept where each rank gets whole superblocks
            if sub is not None and (g_count // size) % sub.sg:
                sub = None
            return Grouped(*(t.chunk(size, 1)[rank] for t in (self.q, self.scales, self.mins)), self.bits, self.group,
                           None if sub is None else sub.chunk(size, rank, 1))
        raise QuantLoadError(f"{name}: shard kind {kind!r} is not supported for quantized weights")

    def cat_rows(parts: list["Grouped"]) -> "Grouped":   # noqa: N805 (used as Grouped.cat_rows)
        a = parts[0]
        sub = None
        if all(p.sub is not None and p.sub.sg == a.sub.sg for p in parts):
            sub = Sub(*(torch.cat([getattr(p.sub, f) for p in parts]) for f in "daeb"), a.sub.sg)
        return Grouped(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                       torch.cat([p.mins for p in parts]), a.bits, a.group, sub)


def code_bits(w: Grouped, packed: bool = True) -> int:
    """The code width the kernel streams: 4 for 4-bit codes; else the fewest of 5, 6, 8 bits that hold
    every code where `packed`, 8 otherwise."""
    if w.bits == 4:
        return 4
    if not packed:
        return 8
    top = int(w.q.max()) if w.q.numel() else 0
    return 5 if top < 32 else 6 if top < 64 else 8


def pack(w: Grouped, bits: int | None = None, flat: bool = False, packed: bool = False,
         act8: bool = False) -> cpu_ext.QPack:
    """The kernel's layout (kernels/cpu_gemm_q4.c's top): codes [np][K][row bytes]; scales and mins
    [np][G][32] as two levels (w.sub), fp16 where it holds them exactly, else fp32; zero padded to
    np * 32 columns. `bits`: the code width (default: code_bits, `packed` as
    option.grouped_code_layout=packed); `flat`: fp32 scales and mins (the layout before the compact
    ones, for comparisons); `act8`: multiplied by int8 activations (option.cpu_grouped_activations)."""
    n, k = w.q.shape
    g = w.scales.shape[1]
    npan = -(-n // PANEL)
    if bits is None:
        bits = code_bits(w, packed)
    elif bits not in (4, 5, 6, 8) or (w.bits == 4) != (bits == 4) or bits < code_bits(w):
        raise ValueError(f"code width {bits} for codes that need {code_bits(w)} bits; allowed: 4 for 4-bit "
                         "codes, else 5, 6 or 8 holding every code")
    q = torch.zeros(npan * PANEL, k, dtype=torch.uint8)
    q[:n] = w.q
    q = q.view(npan, PANEL, k)
    if bits == 8:
        codes = q.permute(0, 2, 1)
    else:
        lo = q & 0xF
        parts = [(lo[:, :16] | (lo[:, 16:] << 4)).permute(0, 2, 1)]          # [np, K, 16]
        for p in range(bits - 4):          # a 32-bit plane per higher bit: byte i, bit t = column 8i + t
            bit = ((q >> (4 + p)) & 1).view(npan, 4, 8, k)
            byte = bit[:, :, 0].clone()
            for t in range(1, 8):
                byte |= bit[:, :, t] << t
            parts.append(byte.permute(0, 2, 1))                                  # [np, K, 4]
        codes = torch.cat(parts, dim=2)
    smode, sg, tabs = (cpu_ext.QS_F32, 1, [w.scales, w.mins]) if flat else _scale_tables(w)
    tabs = [_panels(t, npan) for t in tabs]
    if smode == cpu_ext.QS_I8 and torch.equal(tabs[0], tabs[1]):
        tabs[1] = tabs[0]           # Q6_K: its min is -32 d times the scale's own sub-scale: stream one table
    # streamed every step: contiguous copies, in huge-page-advised memory (kernels/cpu/) where
    # a row is one group (W8A16). With several groups a row (GGUF blocks, AWQ/GPTQ) the served step
    # was slower so (Qwen 0.5B q4_k_m at 1 client: 29.2 against 23.0 ms TPOT, one run each; cause not
    # found, benchmarks/results/hugepages/), so those stay in torch's memory.
    huge = g == 1
    codes = _streamed(codes, huge).view(-1)
    s = _streamed(tabs[0], huge)
    m = s if tabs[1] is tabs[0] else _streamed(tabs[1], huge)
    d, e = (_streamed(t, huge) for t in tabs[2:]) if len(tabs) == 4 else (None, None)
    return cpu_ext.QPack(codes, s, m, d, e, smode, sg, bits, w.group, act8)


def _scale_tables(w: Grouped) -> tuple[int, int, list[torch.Tensor]]:
    """(smode, sg, [s, m] or [a, b, d, e]) per output column: the most compact form that gives back
    w's fp32 scales and mins exactly."""
    sub = w.sub
    if sub is not None:
        s, m = sub.expand()
        if torch.equal(s, w.scales) and torch.equal(m, w.mins):
            return cpu_ext.QS_I8, sub.sg, [sub.a, sub.b, sub.d, sub.e]
        log.warning("two-level scales do not give back the weight's scales exactly: packing them flat")
    s16, m16 = w.scales.half(), w.mins.half()
    if torch.equal(s16.float(), w.scales) and torch.equal(m16.float(), w.mins):
        return cpu_ext.QS_F16, 1, [s16, m16]
    return cpu_ext.QS_F32, 1, [w.scales, w.mins]


def _panels(t: torch.Tensor, npan: int) -> torch.Tensor:
    """[N, G] -> [np, G, 32], zero padded."""
    p = torch.zeros(npan * PANEL, t.shape[1], dtype=t.dtype)
    p[:t.shape[0]] = t
    return p.view(npan, PANEL, -1).permute(0, 2, 1)


def unpack(p: cpu_ext.QPack, n: int, k: int) -> Grouped:
    """pack's inverse: the Grouped weight (its two levels too) from the kernel's layout."""
    npan = -(-n // PANEL)
    c = p.codes.view(npan, k, cpu_ext.q_row_bytes(p.bits))
    if p.bits == 8:
        q = c.clone()
    else:
        nib = c[..., :16]
        q = torch.cat([nib & 0xF, nib >> 4], dim=2)
        shifts = torch.arange(8, dtype=torch.uint8)
        for i in range(p.bits - 4):
            plane = c[..., 16 + 4 * i:20 + 4 * i]                              # [np, K, 4]
            q |= (((plane[..., None] >> shifts) & 1) << (4 + i)).reshape(npan, k, PANEL)
    q = q.permute(0, 2, 1).reshape(npan * PANEL, k)[:n].contiguous()

    def cols(t):
        return t.permute(0, 2, 1).reshape(npan * PANEL, t.shape[1])[:n].contiguous()

    sub = None
    if p.smode == cpu_ext.QS_I8:
        sub = Sub(cols(p.d), cols(p.s), cols(p.e), cols(p.m), p.sg)
        s, m = sub.expand()
    else:
        s, m = cols(p.s).float(), cols(p.m).float()
    return Grouped(q, s, m, 4 if p.bits == 4 else 8, p.group, sub)


def _streamed(t: torch.Tensor, huge: bool) -> torch.Tensor:
    """A contiguous copy of t where a step's stream reads it (cpu_ext.empty_hugepage when huge)."""
    if not huge:
        return t.contiguous()
    return cpu_ext.empty_hugepage(t.shape, t.dtype).copy_(t)


@dataclasses.dataclass(eq=False)
class GroupedPack(Pack):
    """kernels/cpu_gemm_q4.c's layout of a grouped weight (its QPack, which carries the code width and
    the int8-activation choice); `fmt` names the source format."""
    qpack: cpu_ext.QPack
    fmt: str

    @property
    def bits(self) -> int:          # the codes' width as streamed: 4, 5, 6 or 8
        return self.qpack.bits

    @property
    def group(self) -> int:
        return self.qpack.group

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        return cpu_ext.gemm_q(x.float(), self.qpack, layer.out_features, layer.bias32).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.qpack.tensors()

    def grouped(self, n: int, k: int) -> Grouped:
        return unpack(self.qpack, n, k)

    def lin(self, dtype):
        # W8A16, GGUF's blocks, AWQ/GPTQ: kernels/cpu_gemm_q4.c on fp32 rows, as forward calls it
        p = self.qpack
        if not all(t.is_contiguous() for t in p.tensors()):
            return "grouped scales not packed contiguously"
        return (cpu_ext.LIN_Q, {"panels": p.codes.data_ptr(), "qscale": p.s.data_ptr(), "qmin": p.m.data_ptr(),
                                "qd": _ptr(p.d), "qe": _ptr(p.e), "qsmode": p.smode, "qsg": p.sg, "bits": p.bits,
                                "group": p.group, "act8": int(p.act8)}, p.tensors())


@dataclasses.dataclass(eq=False)
class TritonGroupedPack(Pack):
    """CUDA: kernels/triton_q4.py's layout, 4-bit codes two per byte along K, fp32 scales and mins [N, G]."""
    qbytes: torch.Tensor
    qscales: torch.Tensor
    qmins: torch.Tensor
    bits: int
    group: int
    fmt: str

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        from kernels import triton_q4
        return triton_q4.q4_gemm(x, self.qbytes, self.qscales, self.qmins, self.group, layer.out_features,
                                 layer.in_features, None if layer.bias is None else layer.bias.to(x.dtype))

    def held(self) -> list[torch.Tensor]:
        return [self.qbytes, self.qscales, self.qmins]

    def grouped(self, n: int, k: int) -> Grouped:
        b = self.qbytes
        q = torch.stack([b & 0xF, b >> 4], dim=2).reshape(b.shape[0], -1)[:, :k]
        return Grouped(q.contiguous(), self.qscales, self.qmins, self.bits, self.group)


@dataclasses.dataclass(eq=False)
class TorchGroupedPack(Pack):
    """Where no grouped kernel runs: the Grouped weight, dequantized to the activations' dtype per call."""
    weight: Grouped
    fmt: str

    @property
    def bits(self) -> int:
        return self.weight.bits

    @property
    def group(self) -> int:
        return self.weight.group

    def forward(self, x: torch.Tensor, layer: CpuLinear) -> torch.Tensor:
        w, dev = self.weight, x.device
        wd = Grouped(w.q.to(dev), w.scales.to(dev), w.mins.to(dev), w.bits, w.group).dequantize(x.dtype)
        return F.linear(x, wd, None if layer.bias is None else layer.bias.to(x.dtype))

    def held(self) -> list[torch.Tensor]:
        return [self.weight.q, self.weight.scales, self.weight.mins]

    def grouped(self, n: int, k: int) -> Grouped:
        return self.weight


GROUPED = (GroupedPack, TritonGroupedPack, TorchGroupedPack)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def use_kernel(device: torch.device) -> bool:
    return device.type == "cpu" and cpu_ext.gemm_q_available()


def grouped_linear(m: nn.Linear, w: Grouped, fmt: str, kernel: bool, numerics: Numerics = Numerics()) -> CpuLinear:
    """A new CpuLinear of `m`'s shape and bias (already loaded, if any) holding `w` (the grouped copy
    replaces the weight: an empty tensor keeps its dtype/device for readers, LoRA). `numerics`: the
    code layout and the int8-activation choice, kept in the pack."""
    n, k = w.shape
    if (n, k) != (m.out_features, m.in_features):
        raise QuantLoadError(f"{fmt} weight of shape [{n}, {k}] does not fit a {m.in_features} -> {m.out_features} "
                             "layer (config.json and the weights disagree)")
    dev = m.weight.device
    if kernel:
        p = GroupedPack(pack(w, packed=numerics.packed_codes, act8=numerics.act8), fmt)
    elif dev.type == "cuda" and w.bits == 4 and _triton():
        from kernels.triton_q4 import pack_k   # two codes per byte along K; scales / mins [N, G]
        p = TritonGroupedPack(pack_k(w.q).to(dev), w.scales.to(dev).contiguous(), w.mins.to(dev).contiguous(),
                              w.bits, w.group, fmt)
    else:
        p = TorchGroupedPack(Grouped(w.q.to(dev), w.scales.to(dev), w.mins.to(dev), w.bits, w.group), fmt)
    return CpuLinear(m, p)


def install(model: nn.Module, name: str, w: Grouped, fmt: str, kernel: bool,
            numerics: Numerics = Numerics()) -> CpuLinear:
    """Put a grouped_linear of `model`'s nn.Linear `name` in its place."""
    return replace(model, name, grouped_linear(model.get_submodule(name), w, fmt, kernel, numerics))


def _triton() -> bool:
    import kernels
    return kernels.triton_available()


def is_grouped(m: nn.Module) -> bool:
    """Whether `m` is a layer holding a grouped weight (any of its packs)."""
    return isinstance(m, CpuLinear) and isinstance(m.pack, GROUPED)


def grouped_layers(model: nn.Module) -> list[CpuLinear]:
    return [m for m in model.modules() if is_grouped(m)]


def grouped_of(m: CpuLinear) -> Grouped:
    """A grouped layer's weight back in the internal format (any pack)."""
    return m.pack.grouped(m.out_features, m.in_features)


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> int:
    """option.quantize=none on a quantized checkpoint: every grouped layer replaced by a plain
    nn.Linear holding its dequantized weight in `dtype`. Returns how many."""
    done = 0
    for name, m in list(model.named_modules()):
        if is_grouped(m):
            w = grouped_of(m).dequantize(torch.float32).to(device=m.weight.device, dtype=dtype)
            replace(model, name, plain(m, w))
            done += 1
    return done


def describe(model: nn.Module) -> str:
    layers = grouped_layers(model)
    if not layers:
        return "no grouped quantized layers"
    fmts = sorted({f"{m.pack.fmt} ({m.pack.bits}-bit, group {m.pack.group}{_scales_said(m.pack)})" for m in layers})
    first = layers[0].pack
    path = {GroupedPack: "kernels/cpu_gemm_q4.c", TritonGroupedPack: "kernels/triton_q4.py",
            TorchGroupedPack: "dequantize + torch matmul (no kernel here)"}[type(first)]
    held = sum(t.numel() * t.element_size() for m in layers for t in m.pack.tensors())
    size = f", {held / 2 ** 20:,.0f} MiB streamed a step" if held else ""
    act = ""
    if isinstance(first, GroupedPack) and first.qpack.act8:
        act = ("; int8 activations where groups are at most 256 inputs, a multiple of 4 "
               "(option.cpu_grouped_activations=int8: integer dot products, not bit for bit the dequantized model)"
               if cpu_ext.q_act8_available() else
               "; option.cpu_grouped_activations=int8 ignored: this build has no int8-activation path (avx512 "
               "with VNNI and VBMI, or avx2): exact fp32 activations")
    return f"{len(layers)} linear layers served grouped: {', '.join(fmts)}, by {path}{size}{act}"


def _scales_said(p: Pack) -> str:
    if not isinstance(p, GroupedPack):
        return ""
    return {cpu_ext.QS_F32: ", fp32 scales", cpu_ext.QS_F16: ", fp16 scales",
            cpu_ext.QS_I8: f", two-level scales ({p.qpack.sg} groups a superblock)"}[p.qpack.smode]
