"""Times the Triton paged attention against torch SDPA over gathered K/V (CUDA, bf16).

    python benchmarks/kernel_bench.py --out benchmarks/results/kernel_bench.json

Per case: Triton (paged, block-table reads inside the kernel); SDPA with the gather from the
paged pool included (index -> [B, Hkv, L, D] -> SDPA); SDPA on K/V already contiguous (the
dense lower bound that a paged cache has to compete with). Prints a Markdown table and writes
JSON. Decode cases give every sequence the same context length so SDPA needs no mask.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Llama-3-8B-like attention: 32 query heads, 8 kv heads, head_dim 128.
H, HKV, D, BLOCK_SIZE = 32, 8, 128, 16

# (name, number of sequences, query rows per sequence, context length per sequence)
CASES = [
    ("decode 64 x 512", 64, 1, 512),
    ("decode 64 x 2048", 64, 1, 2048),
    ("decode 256 x 512", 256, 1, 512),
    ("decode 256 x 2048", 256, 1, 2048),
    ("prefill chunk 4 x 512 over 1536 cached", 4, 512, 2048),
    ("prefill 1 x 2048 (no prefix)", 1, 2048, 2048),
]


def build_case(num_seqs: int, n_q: int, ctx: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """A paged batch with blocks handed out in a shuffled order; args for kernels.paged_attention."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nblk = -(-ctx // BLOCK_SIZE)
    num_blocks = num_seqs * nblk
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(num_seqs, nblk).to(torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    return dict(
        query=rnd(num_seqs * n_q, H, D),
        key_cache=rnd(num_blocks, BLOCK_SIZE, HKV, D),
        value_cache=rnd(num_blocks, BLOCK_SIZE, HKV, D),
        block_tables=tables,
        seq_lens=torch.full((num_seqs,), ctx, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, num_seqs * n_q + 1, n_q, dtype=torch.int32, device=device),
        scale=D ** -0.5,
    )


def gather_kv(case: dict, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged pool -> contiguous K, V [S, Hkv, ctx, D] (what a dense attention needs)."""
    tables = case["block_tables"].long()
    s = tables.shape[0]

    def one(cache):
        return cache[tables].view(s, -1, HKV, D)[:, :ctx].transpose(1, 2).contiguous()

    return one(case["key_cache"]), one(case["value_cache"])


def causal_offset_mask(n_q: int, ctx: int, device) -> torch.Tensor | None:
    """[n_q, ctx] bool: row j sits at ctx - n_q + j and sees positions <= it; None for decode."""
    if n_q == 1:
        return None
    qpos = torch.arange(ctx - n_q, ctx, device=device)
    return torch.arange(ctx, device=device)[None, :] <= qpos[:, None]


def sdpa_dense(case: dict, k: torch.Tensor, v: torch.Tensor, n_q: int) -> torch.Tensor:
    """SDPA over contiguous K/V [S, Hkv, ctx, D] -> [T, H, D]."""
    s, ctx = k.shape[0], k.shape[2]
    q = case["query"].view(s, n_q, H, D).transpose(1, 2)  # [S, H, n_q, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_offset_mask(n_q, ctx, q.device),
                                       scale=case["scale"], enable_gqa=True)
    return o.transpose(1, 2).reshape(s * n_q, H, D)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results path")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time in ms")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA device (torch.cuda.is_available() is False); "
              "the Triton kernels only run on GPUs. Nothing was timed.", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    from kernels import triton_kernels

    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    rows = []
    for name, num_seqs, n_q, ctx in CASES:
        case = build_case(num_seqs, n_q, ctx, dtype, "cuda")
        k, v = gather_kv(case, ctx)
        out_triton = triton_kernels.paged_attention(**case)
        out_sdpa = sdpa_dense(case, k, v, n_q)
        diff = (out_triton.float() - out_sdpa.float()).abs().max().item()
        t_triton = do_bench(lambda: triton_kernels.paged_attention(**case), rep=args.rep, return_mode="median")
        t_gather = do_bench(lambda: sdpa_dense(case, *gather_kv(case, ctx), n_q), rep=args.rep,
                            return_mode="median")
        t_dense = do_bench(lambda: sdpa_dense(case, k, v, n_q), rep=args.rep, return_mode="median")
        kv_bytes = 2 * num_seqs * ctx * HKV * D * case["key_cache"].element_size()
        rows.append(dict(case=name, num_seqs=num_seqs, query_rows_per_seq=n_q, context=ctx,
                         triton_ms=t_triton, sdpa_with_gather_ms=t_gather, sdpa_pregathered_ms=t_dense,
                         triton_kv_read_gbps=kv_bytes / t_triton / 1e6, max_abs_diff_vs_sdpa=diff))
        del case, k, v, out_triton, out_sdpa
        torch.cuda.empty_cache()

    print(f"\nPaged attention, {args.dtype}, H={H} Hkv={HKV} D={D} block_size={BLOCK_SIZE}, "
          f"on {device} (triton {triton.__version__}, torch {torch.__version__})\n")
    print("| case | Triton paged (ms) | SDPA + gather (ms) | SDPA pre-gathered (ms) | "
          "vs SDPA+gather | Triton KV read (GB/s) | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['triton_ms']:.3f} | {r['sdpa_with_gather_ms']:.3f} | "
              f"{r['sdpa_pregathered_ms']:.3f} | {r['sdpa_with_gather_ms'] / r['triton_ms']:.2f}x | "
              f"{r['triton_kv_read_gbps']:.0f} | {r['max_abs_diff_vs_sdpa']:.1e} |")
    result = dict(device=device, dtype=args.dtype, heads=H, kv_heads=HKV, head_dim=D,
                  block_size=BLOCK_SIZE, torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), cases=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    bad = [r["case"] for r in rows if r["max_abs_diff_vs_sdpa"] > 0.05]
    if bad:
        print(f"error: Triton output differs from SDPA in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
