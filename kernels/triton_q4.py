"""Triton dequant-GEMM for grouped 4-bit weights (handler/model/quant_int4.py's format) on CUDA:
y[M, N] = x[M, K] @ W^T (+ bias), W[n, k] = q[n, k] * scales[n, k // g] + mins[n, k // g].

Codes are packed two per byte along K (byte j of row n: k = 2j low nibble, 2j + 1 high), so the
weight stream is half a byte per weight plus the group's scale and min. Each program owns a
[BLOCK_M, BLOCK_N] tile of y and walks K in BLOCK_K steps: loads the codes' bytes, splits the
nibbles, dequantizes in fp32 (one FMA, the format's exact weight), casts to x's dtype and
multiplies with tl.dot, accumulating in fp32 (fp32 inputs: "ieee" precision, no TF32).

Works on triton 3.6-3.9, on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (set before
triton is first imported): `TRITON_INTERPRET=1 python -m kernels.triton_q4` checks it against a
float64 product of the dequantized weights.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl


def pack_k(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> [N, ceil(K/2)] bytes, k = 2j in the low nibble of byte j."""
    n, k = q.shape
    if k % 2:
        q = torch.cat([q, q.new_zeros(n, 1)], 1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


@triton.jit
def _q4_gemm_kernel(x_ptr, qb_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, G, GROUP,
                    stride_xm, stride_qn, stride_sn, stride_ym,
                    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    half = tl.arange(0, BLOCK_K // 2)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + half                                        # byte columns of this step
        bytes_ = tl.load(qb_ptr + rn[:, None] * stride_qn + kb[None, :],
                         mask=(rn[:, None] < N) & (kb[None, :] < (K + 1) // 2), other=0).to(tl.int32)
        lo = bytes_ & 0xF
        hi = (bytes_ >> 4) & 0xF
        codes = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))      # k = 2j, 2j + 1 interleaved
        rk = k0 + tl.arange(0, BLOCK_K)
        grp = rk // GROUP
        gmask = (rn[:, None] < N) & (rk[None, :] < K)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + grp[None, :], mask=gmask, other=0.0)
        mn = tl.load(m_ptr + rn[:, None] * stride_sn + grp[None, :], mask=gmask, other=0.0)
        w = codes.to(tl.float32) * s + mn                              # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def q4_gemm(x: torch.Tensor, qbytes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
            n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32/fp16/bf16) -> [..., N] in x's dtype; qbytes from pack_k, scales/mins [N, G] fp32."""
    a = x.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, 64))
    _q4_gemm_kernel[grid](a, qbytes, scales, mins, bias if bias is not None else y, y, m, n, k,
                          scales.shape[1], group, a.stride(0), qbytes.stride(0), scales.stride(0), y.stride(0),
                          HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                          BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64)
    return y.view(*x.shape[:-1], n)


def selfcheck(device: str = "cpu") -> int:
    """Against float64 of the dequantized weights, shapes with K not a multiple of the group / block."""
    failures = 0
    gen = torch.Generator().manual_seed(0)
    for m, n, k, g in [(1, 64, 64, 32), (5, 70, 100, 32), (33, 96, 130, 64), (3, 40, 64, 16)]:
        groups = -(-k // g)
        q = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
        s = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()
        mn = -torch.randint(0, 16, (n, groups), generator=gen).float() * s
        x = torch.randn(m, k, generator=gen)
        b = torch.randn(n, generator=gen)
        wd = q.float() * s.repeat_interleave(g, 1)[:, :k] + mn.repeat_interleave(g, 1)[:, :k]
        want = x.double() @ wd.double().T + b.double()
        got = q4_gemm(x.to(device), pack_k(q).to(device), s.to(device), mn.to(device), g, n, k,
                      b.to(device)).cpu().double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        ok = err < 1e-5
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} m={m} n={n} k={k} g={g}: max rel error {err:.2e}", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


def compile_for(sm: int) -> list[str]:
    """Compile the kernel to a cubin for CUDA arch `sm` without a GPU (catches what the interpreter
    accepts and the GPU compiler rejects); one line per build."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = _q4_gemm_kernel
    names = fn.arg_names
    lines = []
    for dt in ("*fp32", "*fp16", "*bf16"):
        for bm in (16, 64):
            types = dict(x_ptr=dt, qb_ptr="*u8", s_ptr="*fp32", m_ptr="*fp32", b_ptr=dt, y_ptr=dt)
            consts = dict(HAS_BIAS=True, IEEE=dt == "*fp32", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64)
            sig = {n: types.get(n, "i32") for n in names}
            sig.update({k: "constexpr" for k in consts})
            src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
            triton.compile(src, target=GPUTarget("cuda", sm, 32))
            lines.append(f"compiled _q4_gemm_kernel for sm_{sm}: {dt} BLOCK_M={bm}")
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile-sm"]:
        print("\n".join(compile_for(int(sys.argv[2]))))
        sys.exit(0)
    sys.exit(selfcheck(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
