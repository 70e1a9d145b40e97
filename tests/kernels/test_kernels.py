"""kernels/: the serving path's torch math (kernels/torch_paged.py) vs the oracle (kernels/reference.py, a naive
per-token loop); Triton (interpreter / CUDA) vs the oracle."""
from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference, torch_paged
from kernels.selfcheck import make_case
from tests.support.kernels import _head_major, _own_kv, naive_attention, rel_err

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_naive_loop(group, block_size, dtype, tol):
    rng = random.Random(f"{group}-{block_size}-{dtype}")
    for _ in range(2):
        case = make_case(rng, num_seqs=rng.randint(2, 5), block_size=block_size, hkv=rng.choice([1, 2]),
                         group=group, head_dim=rng.choice([16, 32]), dtype=dtype, max_ctx=30)
        got = torch_paged.paged_attention(**case)
        assert got.dtype == dtype and got.shape == case["query"].shape
        want = naive_attention(**case)
        assert rel_err(got, want) <= tol
        # The same answer when the caller passes the host-side lists instead.
        again = torch_paged.paged_attention(
            **case, seq_lens_cpu=case["seq_lens"].tolist(),
            query_start_loc_cpu=case["query_start_loc"].tolist())
        assert torch.equal(again, got)


@pytest.mark.parametrize("sliding_window,soft_cap", [(3, None), (None, 0.7), (5, 1.5), (1, None)])
def test_reference_sliding_window_and_soft_cap_match_naive_loop(sliding_window, soft_cap):
    rng = random.Random(f"sw-{sliding_window}-{soft_cap}")
    for _ in range(3):
        case = make_case(rng, num_seqs=rng.randint(2, 5), block_size=rng.choice([1, 4]), hkv=2,
                         group=rng.choice([1, 2]), head_dim=16, dtype=torch.float32, max_ctx=24)
        case["query"] = case["query"] * 4          # large logits, so the cap changes the answer
        got = torch_paged.paged_attention(**case, sliding_window=sliding_window, soft_cap=soft_cap)
        want = naive_attention(**case, sliding_window=sliding_window, soft_cap=soft_cap)
        assert rel_err(got, want) <= 1e-5
        # and the options do change the result (the test would notice them being ignored)
        assert rel_err(got, naive_attention(**case)) > 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 4}, {"soft_cap": 1.5}])
def test_reference_head_major_pool_and_own_keys_match_naive_loop(dtype, tol, options):
    # The engine's CPU pool is head-major and passes the step's own keys: the answer must be
    # the naive loop's for decode rows, chunks over cached prefixes and whole prefills alike.
    rng = random.Random(f"hm-{dtype}-{options}")
    for _ in range(3):
        case = make_case(rng, num_seqs=rng.randint(3, 6), block_size=rng.choice([1, 4, 16]),
                         hkv=rng.choice([1, 3]), group=rng.choice([1, 3]), head_dim=16, dtype=dtype, max_ctx=40)
        key, value = _own_kv(case)
        hm = dict(case, key_cache=_head_major(case["key_cache"]), value_cache=_head_major(case["value_cache"]))
        got = torch_paged.paged_attention(**hm, key=key, value=value, **options)
        assert got.dtype == dtype
        assert rel_err(got, naive_attention(**case, **options)) <= tol
        if dtype == torch.float32:    # the layout alone changes nothing
            assert rel_err(got, torch_paged.paged_attention(**case, **options)) <= 1e-6


def test_reference_decode_batch_with_uneven_lengths():
    # Many decode rows in one batched gather: lengths 1..70 in one batch, tables padded with -1.
    rng = random.Random(7)
    case = make_case(rng, num_seqs=12, block_size=8, hkv=2, group=2, head_dim=32,
                     dtype=torch.float32, max_ctx=70, decode_only=True)
    case["seq_lens"][0] = 1
    assert (case["block_tables"] == -1).any()
    assert rel_err(torch_paged.paged_attention(**case), naive_attention(**case)) <= 1e-5


def test_length_groups_cover_each_sequence_once_longest_first():
    rng = random.Random(3)
    seqs = list(range(100, 160))
    nblks = [rng.randint(1, 40) for _ in seqs]
    groups = torch_paged.length_groups(seqs, nblks, min_size=8, slack=0.6)
    assert sorted(x for g in groups for x in g) == seqs
    width = {s: n for s, n in zip(seqs, nblks)}
    tops = [max(width[x] for x in g) for g in groups]
    assert tops == sorted(tops, reverse=True) and len(groups) > 1
    for g, nxt in zip(groups, groups[1:]):      # a group closes only when full enough and the
        assert len(g) >= 8                      # next is much shorter than its widest
        assert max(width[x] for x in nxt) < 0.6 * max(width[x] for x in g)
    assert torch_paged.length_groups([7, 8], [1, 30]) == [[8, 7]]     # small batches stay one group


def test_reference_decode_rows_in_several_length_groups_match_naive_loop():
    rng = random.Random(11)
    case = make_case(rng, num_seqs=40, block_size=4, hkv=2, group=3, head_dim=16,
                     dtype=torch.float32, max_ctx=120, decode_only=True)
    lens = case["seq_lens"].tolist()
    assert len(torch_paged.length_groups(list(range(40)), [-(-n // 4) for n in lens])) > 1
    assert rel_err(torch_paged.paged_attention(**case), naive_attention(**case)) <= 1e-5


def test_write_kv_then_attend_equals_causal_sdpa_over_contiguous_kv():
    # A 37-token sequence written through a shuffled block table, read back by attention,
    # must equal plain causal SDPA on the unpaged tensors.
    torch.manual_seed(0)
    n, h, hkv, d, bs = 37, 4, 2, 16, 4
    q, k, v = torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    table = torch.randperm(12)[:10].to(torch.int32)  # 10 blocks of 4 >= 37 positions
    kc, vc = torch.zeros(12, bs, hkv, d), torch.zeros(12, bs, hkv, d)
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)])
    kernels.write_kv(kc, vc, k, v, slots)
    out = kernels.paged_attention(q, kc, vc, table[None], torch.tensor([n], dtype=torch.int32),
                                  torch.tensor([0, n], dtype=torch.int32), d ** -0.5)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                          v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True)
    assert rel_err(out, want.transpose(0, 1)) <= 1e-5


def test_reference_write_kv_places_rows_and_skips_negative_slots():
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch_paged.write_kv(kc, vc, key, value, torch.tensor([9, -1, 2]))
    assert torch.equal(kc[2, 1], key[0]) and torch.equal(vc[2, 1], value[0])  # slot 9 = block 2, offset 1
    assert torch.equal(kc[0, 2], key[2]) and torch.equal(vc[0, 2], value[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 2  # exactly two slots written


def test_reference_rejects_bad_head_counts():
    case = make_case(random.Random(1), num_seqs=1, block_size=4, hkv=2, group=1, head_dim=16,
                     dtype=torch.float32)
    case["query"] = torch.randn(case["query"].shape[0], 3, 16)
    with pytest.raises(ValueError, match="num query heads 3 is not a multiple of num kv heads 2"):
        torch_paged.paged_attention(**case)


def test_reference_rejects_more_query_rows_than_context():
    case = make_case(random.Random(2), num_seqs=1, block_size=4, hkv=1, group=1, head_dim=16,
                     dtype=torch.float32)
    n = case["query"].shape[0]
    case["seq_lens"][0] = n - 1 if n > 1 else 0
    with pytest.raises(ValueError, match=f"sequence 0: {n} query rows do not fit its context length"):
        torch_paged.paged_attention(**case)


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_import_kernels_does_not_import_triton():
    r = _run_python("import sys, kernels; assert 'triton' not in sys.modules, 'triton imported'")
    assert r.returncode == 0, r.stdout + r.stderr


def test_kernels_work_without_triton():
    # Make `import triton` fail: the package still imports and the CPU path still runs.
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'triton': raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, kernels\n"
        "assert kernels.triton_available() is False\n"
        "kc = torch.zeros(2, 4, 1, 16); vc = torch.ones(2, 4, 1, 16)\n"
        "kernels.write_kv(kc, vc, torch.ones(1, 1, 16), torch.full((1, 1, 16), 2.0), torch.tensor([5]))\n"
        "out = kernels.paged_attention(torch.ones(1, 2, 16), kc, vc, torch.tensor([[0, 1]], dtype=torch.int32),\n"
        "    torch.tensor([6], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.25)\n"
        "assert out.shape == (1, 2, 16) and bool((out > 1).all()), out\n"
    )
    r = _run_python(code)
    assert r.returncode == 0, r.stdout + r.stderr


def test_transformers_does_not_mistake_our_package_for_hf_kernels():
    from transformers.utils import is_kernels_available
    assert is_kernels_available() is False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter_match_reference():
    # A fresh process: TRITON_INTERPRET must be set before triton is first imported.
    r = subprocess.run([sys.executable, "-m", "kernels.selfcheck", "--device", "cpu"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, f"selfcheck failed:\n{r.stdout}\n{r.stderr}"
    assert "0 failure(s)" in r.stdout and r.stdout.count("ok   ") >= 20, r.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter accepts things the GPU compiler rejects (tile shapes, dtypes): build cubins.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "kernels.selfcheck", "--compile-sm", "90"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"compile failed:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.count("compiled _paged_attn_kernel for sm_90") == 6, r.stdout


@pytest.mark.gpu
@needs_cuda
def test_triton_on_cuda_matches_reference_fp16_bf16():
    from kernels import selfcheck
    assert selfcheck.run("cuda", [torch.float16, torch.bfloat16, torch.float32], seed=3) == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dispatch_on_cuda_uses_triton_and_matches_reference(dtype):
    assert kernels.triton_available()
    rng = random.Random(11)
    case = make_case(rng, num_seqs=24, block_size=16, hkv=4, group=2, head_dim=128, dtype=dtype,
                     device="cuda", max_ctx=600)
    got = kernels.paged_attention(**case)
    cpu_case = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    want = reference.paged_attention(**{**cpu_case, "query": cpu_case["query"].float(),
                                        "key_cache": cpu_case["key_cache"].float(),
                                        "value_cache": cpu_case["value_cache"].float()})
    assert got.is_cuda and got.dtype == dtype
    assert rel_err(got.cpu(), want) <= (2e-3 if dtype == torch.float16 else 1.6e-2)


def _load_kernel_bench():
    spec = importlib.util.spec_from_file_location("kernel_bench", ROOT / "benchmarks" / "kernel_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("num_seqs,n_q,ctx", [(3, 1, 40), (2, 8, 37)])
def test_kernel_bench_baseline_agrees_with_reference(num_seqs, n_q, ctx):
    # The benchmark's SDPA baseline must compute the same attention the kernels do.
    bench = _load_kernel_bench()
    case = bench.build_case(num_seqs, n_q, ctx, torch.float32, "cpu")
    dense = bench.sdpa_dense(case, *bench.gather_kv(case, ctx), n_q)
    assert rel_err(dense, reference.paged_attention(**case)) <= 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit path")
def test_kernel_bench_on_cpu_exits_with_a_clear_message(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "benchmarks/kernel_bench.py", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
