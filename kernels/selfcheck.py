"""Triton kernels vs the serving path's torch math (kernels/torch_paged.py) on random paged layouts.

    TRITON_INTERPRET=1 python -m kernels.selfcheck            # CPU, triton interpreter
    python -m kernels.selfcheck --device cuda                  # GPU (adds bf16)
    python -m kernels.selfcheck --compile-sm 90                # compile for sm_90, no GPU needed

Prints one line per case and exits 1 if any case is off. Also the case generator the tests use.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from . import torch_paged


def make_case(rng: random.Random, *, num_seqs: int, block_size: int, hkv: int, group: int,
              head_dim: int, dtype: torch.dtype, device: str = "cpu", max_ctx: int = 40,
              decode_only: bool = False, extra_blocks: int = 3) -> dict:
    """A random packed batch: decode rows, prefill chunks over cached prefixes, whole prefills.

    Blocks are handed out in a shuffled order (tables are non-contiguous), unused table
    entries are -1 and unused cache slots hold random junk that must never be read.
    """
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    lens, nq = [], []
    for _ in range(num_seqs):
        ctx = rng.randint(1, max_ctx)
        kind = "decode" if decode_only else rng.choice(["decode", "chunk", "prefill"])
        n = 1 if kind == "decode" or ctx == 1 else ctx if kind == "prefill" else rng.randint(2, ctx)
        lens.append(ctx)
        nq.append(n)
    need = [-(-c // block_size) for c in lens]
    num_blocks = sum(need) + extra_blocks
    order = list(range(num_blocks))
    rng.shuffle(order)
    max_blocks = max(need) + 1
    tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)
    it = iter(order)
    for s, k in enumerate(need):
        tables[s, :k] = torch.tensor([next(it) for _ in range(k)], dtype=torch.int32)
    qsl = [0]
    for n in nq:
        qsl.append(qsl[-1] + n)
    h = hkv * group

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return dict(
        query=rnd(qsl[-1], h, head_dim),
        key_cache=rnd(num_blocks, block_size, hkv, head_dim),
        value_cache=rnd(num_blocks, block_size, hkv, head_dim),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
    )


def attention_error(case: dict, **kernel_kw) -> float:
    """Max |triton - torch| / (1 + |torch|) over the batch."""
    from . import triton_kernels
    got = triton_kernels.paged_attention(**case, **kernel_kw).float()
    ref = torch_paged.paged_attention(**case).float()
    return ((got - ref).abs() / (1 + ref.abs())).max().item()


def store_error(rng: random.Random, *, block_size: int, hkv: int, head_dim: int,
                dtype: torch.dtype, device: str = "cpu", tokens: int = 10) -> float:
    """Max |triton - torch| over both caches after writing `tokens` rows, some with slot -1."""
    from . import triton_kernels
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    num_blocks = -(-2 * tokens // block_size)  # half the slots stay untouched
    slots = list(range(num_blocks * block_size))
    rng.shuffle(slots)
    slots = slots[:tokens]
    for i in rng.sample(range(tokens), max(1, tokens // 4)):
        slots[i] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    key = torch.randn(tokens, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
    value = torch.randn(tokens, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
    kc = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    triton_kernels.write_kv(kc, vc, key, value, slot_mapping)
    torch_paged.write_kv(kc2, vc2, key, value, slot_mapping)
    return max((kc - kc2).abs().max().item(), (vc - vc2).abs().max().item())


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # ~2 ulp

# (name, make_case kwargs, kernel kwargs); small enough for the interpreter.
ATTENTION_CASES = [
    ("mixed g1 bs16 d32", dict(num_seqs=4, block_size=16, hkv=2, group=1, head_dim=32), {}),
    ("mixed g2 bs4 d32", dict(num_seqs=4, block_size=4, hkv=2, group=2, head_dim=32), {}),
    ("mixed g4 bs1 d16", dict(num_seqs=3, block_size=1, hkv=1, group=4, head_dim=16, max_ctx=20), {}),
    ("mixed g2 bs8 d24 (padded head_dim)", dict(num_seqs=3, block_size=8, hkv=2, group=2, head_dim=24), {}),
    ("mixed g3 bs16 d32 (padded group)", dict(num_seqs=3, block_size=16, hkv=1, group=3, head_dim=32), {}),
    ("mixed g4 bs2 d32 block_q=4 tile_n=16", dict(num_seqs=3, block_size=2, hkv=1, group=4, head_dim=32),
     dict(block_q=4, tile_n=16)),
    ("long prefill g1 bs16 d32 (2 q blocks)", dict(num_seqs=2, block_size=16, hkv=1, group=1,
                                                  head_dim=32, max_ctx=100), {}),
    ("decode g2 bs16 d64", dict(num_seqs=6, block_size=16, hkv=2, group=2, head_dim=64, max_ctx=70,
                                decode_only=True), {}),
]
STORE_CASES = [dict(block_size=16, hkv=2, head_dim=32), dict(block_size=1, hkv=3, head_dim=24),
               dict(block_size=4, hkv=1, head_dim=64)]


def run(device: str, dtypes: list[torch.dtype], seed: int = 0) -> list[str]:
    """Runs every case; returns the failures (also prints one line per case)."""
    failures = []
    for dtype in dtypes:
        rng = random.Random(seed)
        for name, kw, kernel_kw in ATTENTION_CASES:
            err = attention_error(make_case(rng, dtype=dtype, device=device, **kw), **kernel_kw)
            ok = err <= TOL[dtype]
            line = f"attention {name} {dtype}: max err {err:.2e} (relative, tol {TOL[dtype]:.0e})"
            print(("ok   " if ok else "FAIL ") + line, flush=True)
            if not ok:
                failures.append(line)
        for kw in STORE_CASES:
            err = store_error(rng, dtype=dtype, device=device, **kw)
            line = f"store {kw} {dtype}: max err {err:.2e}"
            print(("ok   " if err == 0 else "FAIL ") + line, flush=True)
            if err != 0:
                failures.append(line)
    return failures


def compile_for(sm: int) -> list[str]:
    """Compiles both kernels to a cubin for CUDA arch `sm` (no GPU needed: catches errors
    that the interpreter does not, e.g. tile shapes tl.dot rejects). Returns one line per build."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import triton_kernels as tk

    def build(fn, types: dict, consts: dict) -> str:
        names = fn.arg_names
        sig = {n: types.get(n, "i32") for n in names}
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        triton.compile(src, target=GPUTarget("cuda", sm, 32))
        return f"compiled {fn.__name__} for sm_{sm}: {types.get('kc_ptr')} {consts}"

    lines = []
    for dt in ("*bf16", "*fp16", "*fp32"):
        lines.append(build(tk._store_kv_kernel, dict(key_ptr=dt, value_ptr=dt, kc_ptr=dt, vc_ptr=dt, slot_ptr="*i64"),
                           dict(HKV=8, D=128, BLOCK_SIZE=16, HKV_PAD=8, D_PAD=128)))
        ptrs = dict(q_ptr=dt, kc_ptr=dt, vc_ptr=dt, out_ptr=dt, bt_ptr="*i32", seq_lens_ptr="*i32",
                    qsl_ptr="*i32", scale="fp32")
        for block_q in (4, 16):  # the decode and the prefill tile for 32 heads / 8 kv heads
            lines.append(build(tk._paged_attn_kernel, ptrs, dict(
                G=4, G_PAD=4, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_M=block_q * 4,
                TILE_N=32, IEEE=dt == "*fp32")))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.selfcheck", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-sm", type=int, metavar="SM", help="only compile for this CUDA arch (e.g. 90)")
    args = ap.parse_args(argv)
    if args.compile_sm:
        for line in compile_for(args.compile_sm):
            print(line, flush=True)
        return 0
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("error: --device cpu needs TRITON_INTERPRET=1 in the environment (set before triton "
              "is imported)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    # The interpreter cannot run bf16 (numpy has no bfloat16).
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if args.device == "cuda" else [])
    failures = run(args.device, dtypes, args.seed)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
