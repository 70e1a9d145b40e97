"""Linear layers' weights packed for the C GEMMs and the products over them: fp32 panels
(kernels/cpu_gemm.c), int8 W8A8 (cpu_gemm_i8.c), grouped 4/5/6/8-bit codes (cpu_gemm_q4.c) and bf16
(cpu_gemm_bf16.c); and a mixture-of-experts MLP's experts over a step's rows in one call over
those packs (cpu_layer.c lmi_moe_experts). The panel GEMMs sum each output in k order by FMAs from 0 on every backend, so
their values do not depend on the instruction set (tests compare the builds). Packed weights are
placed in huge-page-advised memory (kernels/cpu/memory.py): a decode step streams them."""
from __future__ import annotations

import ctypes
import dataclasses

import torch

from kernels.cpu.args import ptr as _ptr
from kernels.cpu.lib import load
from kernels.cpu.memory import empty_hugepage

PANEL = 32   # output columns per panel of a packed weight (kernels/cpu_gemm.c)


def gemm_available() -> bool:
    """Whether kernels/cpu_gemm.c's fp32 panel GEMM runs here (the avx512, avx2 and neon builds)."""
    fn = load()
    return fn is not None and fn.gemm_available


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's fp32 weight [N, K] -> its panels for `gemm` (a flat fp32 tensor, zero padded
    to a multiple of 32 output columns)."""
    fn = load()
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = empty_hugepage(-(-n // PANEL) * PANEL * k, torch.float32)
    fn.pack_b(w.data_ptr(), n, k, out.data_ptr())
    return out


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 @ the packed weight's transpose (+ bias [N], fp32) -> [..., N] fp32: each
    output summed in k order by fused multiply-adds (kernels/cpu_gemm.c)."""
    k = x.shape[-1]
    if k == 0:      # an empty sum: the bias alone (the kernel sizes its row chunks by k)
        return torch.zeros(*x.shape[:-1], n, dtype=torch.float32) + (0 if bias is None else bias)
    a = x.reshape(-1, k)
    m = a.shape[0]
    if a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        load().gemm(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, panels.data_ptr(), n,
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------------- int8 (kernels/cpu_gemm_i8.c)
def gemm_i8_available() -> bool:
    """Whether kernels/cpu_gemm_i8.c's int8 GEMM runs here (every build: VNNI, AVX-VNNI, AVX2
    vpmaddubsw/vpmaddwd, NEON sdot)."""
    fn = load()
    return fn is not None and fn.gemm_i8_available


def pack_i8(wq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [N, K] -> (panels for `gemm_i8`, flat int8; per-column sums [N] int32)."""
    fn = load()
    n, k = wq.shape
    w = wq.contiguous()
    out = empty_hugepage(-(-n // PANEL) * PANEL * (-(-k // 4) * 4), torch.int8)
    wsum = torch.empty(n, dtype=torch.int32)
    fn.pack_i8(w.data_ptr(), n, k, out.data_ptr(), wsum.data_ptr())
    return out, wsum


def gemm_i8(x: torch.Tensor, panels: torch.Tensor, wsum: torch.Tensor, scales: torch.Tensor, n: int,
            bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32, each row quantized to int8 by its own scale, @ the packed int8 weight's
    transpose, dequantized by row scale x column scale (+ bias [N] fp32) -> [..., N] fp32."""
    fn = load()
    k = x.shape[-1]
    a = x.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, kp = a.shape[0], -(-k // 4) * 4
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        threads = torch.get_num_threads()
        aq = torch.empty(m, kp, dtype=torch.uint8)
        sa = torch.empty(m, dtype=torch.float32)
        fn.quant_rows(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, aq.data_ptr(), kp, sa.data_ptr(), threads)
        fn.gemm_i8(aq.data_ptr(), m, kp, sa.data_ptr(), panels.data_ptr(), wsum.data_ptr(), scales.data_ptr(), n,
                   None if bias is None else bias.data_ptr(), out.data_ptr(), n, threads)
    return out.view(*x.shape[:-1], n)



# ---------------------------------------------------------------------------- grouped 4/8-bit (kernels/cpu_gemm_q4.c)
def q_act8_available() -> bool:
    """Whether this build multiplies grouped weights by int8 activations where a QPack asks for
    them (`act8`, option.cpu_grouped_activations=int8): avx512 with VNNI and VBMI, or avx2."""
    fn = load()
    return fn is not None and fn.q_act8_available


def gemm_q_available() -> bool:
    """Whether kernels/cpu_gemm_q4.c's grouped-weight GEMM runs here (the avx512, avx2 and neon builds)."""
    fn = load()
    return fn is not None and fn.gemm_q_available


@dataclasses.dataclass(frozen=True)
class QPack:
    """A grouped weight in kernels/cpu_gemm_q4.c's layout (its top comment; handler/model/quant_int4.py
    packs it): codes [np][K][row bytes] flat uint8; s, m [np][G][32] in fp32 / fp16 / int8 by smode;
    QS_I8's superblock scales d, e [np][ceil(G / sg)][32] fp32 (None otherwise)."""
    codes: torch.Tensor
    s: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor | None
    e: torch.Tensor | None
    smode: int
    sg: int         # groups per superblock (QS_I8), else 1
    bits: int       # code width: 4, 5, 6 or 8
    group: int      # inputs per group
    act8: bool = False  # int8 activations (option.cpu_grouped_activations=int8; lmi_gemm_q's act8)

    def tensors(self) -> list[torch.Tensor]:
        """What a step streams."""
        out = []
        for t in (self.codes, self.s, self.m, self.d, self.e):
            if t is not None and not any(t is o for o in out):     # s and m may be one table (Q6_K)
                out.append(t)
        return out


def q_row_bytes(bits: int) -> int:
    """Bytes of one packed row k of a 32-column panel (ROW_BYTES in kernels/cpu_gemm_q4.c)."""
    return 32 if bits == 8 else 16 + 4 * (bits - 4)


def gemm_q(x: torch.Tensor, w: QPack, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 @ the grouped quantized weight's transpose (+ bias [N] fp32) -> [..., N] fp32."""
    k = x.shape[-1]
    a = x.reshape(-1, k)
    m = a.shape[0]
    if a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m and k:
        load().gemm_q(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, w.codes.data_ptr(), w.s.data_ptr(),
                      w.m.data_ptr(), _ptr(w.d), _ptr(w.e), w.smode, w.sg, w.bits, w.group, n, _ptr(bias),
                      out.data_ptr(), n, int(w.act8), torch.get_num_threads())
    elif m:
        out.zero_()
        if bias is not None:
            out += bias
    return out.view(*x.shape[:-1], n)


# ---------------------------------------------------------------------------- bf16 (kernels/cpu_gemm_bf16.c)
def gemm_bf16_available() -> bool:
    """Whether kernels/cpu_gemm_bf16.c's vdpbf16ps GEMM runs on this host: built with AVX512-BF16
    and the CPU lists avx512_bf16 (checked at load, not only at compile time)."""
    fn = load()
    return fn is not None and fn.gemm_bf16_available


def gemm_bf16w_available() -> bool:
    """Whether `gemm_bf16(..., widen=True)` runs here: the same bf16 panels widened to fp32 in
    registers and multiplied by fp32 FMAs (AVX-512F/BW; no AVX512-BF16 needed)."""
    fn = load()
    return fn is not None and fn.gemm_bf16w_available


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear's bf16 weight [N, K] -> its pair-interleaved panels for `gemm_bf16` (a flat bf16
    tensor [ceil(N/32)][ceil(K/2)][32][2], zero padded)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"pack_bf16: a 2-D bf16 weight, not {weight.dtype} {tuple(weight.shape)}")
    fn = load()
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = empty_hugepage(-(-n // PANEL) * PANEL * (-(-k // 2) * 2), torch.bfloat16)
    fn.pack_bf16(w.data_ptr(), n, k, out.data_ptr())
    return out


def gemm_bf16(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
              out_dtype: torch.dtype = torch.bfloat16, widen: bool = False) -> torch.Tensor:
    """x [..., K] @ the packed bf16 weight's transpose (+ bias [N] fp32), summed in fp32 ->
    [..., N] in out_dtype (bf16: rounded once, to nearest even; or fp32).

    widen=False: vdpbf16ps, x in bf16 (an fp32 x rounded to bf16 first), pairs of products added
    per instruction. widen=True: the weight widened in registers, x in fp32 (a bf16 x widened,
    exact), fp32 FMAs in k order: kernels/cpu_gemm.c's values over the widened weight, bit for bit."""
    if x.dtype not in (torch.bfloat16, torch.float32) or out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"gemm_bf16: input {x.dtype} -> {out_dtype}; takes bf16/fp32 to bf16/fp32")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"gemm_bf16: the bias must be a contiguous fp32 [{n}], not {bias.dtype} {tuple(bias.shape)}")
    fn = load()
    k = x.shape[-1]
    if k == 0:      # an empty sum: the bias alone
        y = torch.zeros(*x.shape[:-1], n, dtype=torch.float32) + (0 if bias is None else bias)
        return y.to(out_dtype)
    a = x.reshape(-1, k)
    m = a.shape[0]
    threads = torch.get_num_threads()
    if widen:
        a = a.float()
        if a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
            a = a.contiguous()
        out = torch.empty(m, n, dtype=out_dtype)
        if m:
            fn.gemm_bf16w(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, panels.data_ptr(), n,
                          None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                          int(out_dtype == torch.bfloat16), threads)
        return out.view(*x.shape[:-1], n)
    if a.dtype == torch.float32:
        if a.stride(-1) != 1:
            a = a.contiguous()
        rows = torch.empty(m, k, dtype=torch.bfloat16)
        if m:
            fn.bf16_rows(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, rows.data_ptr(), k, threads)
        a = rows
    elif a.stride(-1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    out = torch.empty(m, n, dtype=out_dtype)
    if m:
        fn.gemm_bf16(a.data_ptr(), m, k, a.stride(0) if m > 1 else k, panels.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                     int(out_dtype == torch.bfloat16), threads)
    return out.view(*x.shape[:-1], n)



# ---------------------------------------------------------------------------- experts (kernels/cpu_layer.c)
def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate, up, down) -> torch.Tensor:
    """A mixture-of-experts MLP's experts over a step's rows in one call (lmi_moe_experts): x [T, E]
    (fp32 or bf16, contiguous), ids [T, k] int64 and weights [T, k] (the router's top-k; any float
    dtype, widened to fp32) -> out [T, E] in x's dtype: sum over each row's experts of weight x
    down(silu(gate(x)) * up(x)). gate, up, down: ctypes arrays of X `Lin` (bindings.py), the experts'
    packed weights (gate|up fused: gate holds both, up's n = 0). The caller checked that every Lin
    takes x's dtype (a pack's `lin`); an id outside [0, X) raises IndexError."""
    fn = load()
    t, e = x.shape
    ids = ids.to(torch.int64).contiguous()
    w = weights.float().contiguous()
    out = torch.empty_like(x)
    rc = fn.moe_experts(ctypes.addressof(gate), ctypes.addressof(up), ctypes.addressof(down), len(down),
                        x.data_ptr(), t, e, ids.shape[1], ids.data_ptr(), w.data_ptr(), out.data_ptr(),
                        int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if rc == -1:
        raise IndexError(f"moe_experts: an expert id outside [0, {len(down)})")
    if rc != 0:
        raise MemoryError("moe_experts: scratch allocation failed")
    return out


def moe_route(logits: torch.Tensor, k: int, norm: bool, round_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice in one call (lmi_moe_route): logits [T, X] fp32 -> (weights [T, k] fp32, expert
    ids [T, k] int64): the top-k of each row's fp32 softmax (ties to the lower id), renormalised to sum 1
    where `norm`, rounded to bf16 values where `round_bf16`. The C layer stack routes by the same function.
    The kernel overwrites its logits: a copy is handed to it."""
    fn = load()
    logits = logits.float().contiguous().clone()
    t, x = logits.shape
    if not 0 < k <= x:
        raise ValueError(f"moe_route: top-{k} of {x} experts")
    weights = torch.empty(t, k, dtype=torch.float32)
    ids = torch.empty(t, k, dtype=torch.int64)
    fn.moe_route(logits.data_ptr(), t, x, k, int(norm), int(round_bf16), weights.data_ptr(), ids.data_ptr())
    return weights, ids


def moe_shared(out: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """out [T, E] += sigmoid(g) * s in place (lmi_moe_shared): a shared expert's output s (out's dtype,
    contiguous) gated by its gate's fp32 logits g [T, 1]; bf16 rounds the gate, the product and the sum.
    The C layer stack adds a shared expert by the same function."""
    fn = load()
    g = g.float().contiguous()
    if out.shape != s.shape or out.dtype != s.dtype or not (out.is_contiguous() and s.is_contiguous()) \
            or g.numel() != out.shape[0]:
        raise ValueError(f"moe_shared: out {tuple(out.shape)} {out.dtype}, s {tuple(s.shape)} {s.dtype}, "
                         f"g {tuple(g.shape)}")
    fn.moe_shared(out.data_ptr(), s.data_ptr(), g.data_ptr(), out.shape[0], out.shape[1],
                  int(out.dtype == torch.bfloat16))
    return out
