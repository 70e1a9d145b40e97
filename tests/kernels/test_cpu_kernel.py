"""The CPU decode-attention kernel (kernels/cpu_decode.c via kernels/cpu/) against the
float64 naive loop, its dispatch from `kernels.paged_attention`, its build cache and its fallback."""
from __future__ import annotations

import logging
import random

import pytest
import torch

import kernels
from kernels import cpu as cpu_ext, isa, reference
from kernels.cpu import build as cpu_build, lib as cpu_lib, probes as cpu_probes
from kernels.selfcheck import make_case
from tests.support.kernels import _head_major, _own_kv, naive_attention, rel_err, each_build_fixture

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None,
                                reason="no C compiler (cc/gcc) on PATH: the CPU kernel cannot be built")


@pytest.fixture(autouse=True)
def fresh_load(monkeypatch, tmp_path_factory):
    """Each test sees `load()` decide afresh; builds go to one cache shared by this session."""
    monkeypatch.setenv("LMI_CPU_EXT_CACHE", str(tmp_path_factory.getbasetemp() / "kernel-cache"))
    cpu_ext.select(None)    # a runner built earlier chose a backend (option.cpu_kernels): back to the environment
    cpu_ext.load.cache_clear()
    yield
    cpu_ext.load.cache_clear()


def _decode_args(case):
    """The kernel's arguments for a decode-only case (query row s = sequence s)."""
    return (case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
            case["seq_lens"], case["scale"])


def test_kernel_builds_and_loads():
    assert cpu_ext.load() is not None, "the CPU kernel did not build (see the warning logged)"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("layout", ["token", "head"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"sliding_window": 1}, {"soft_cap": 1.5}])
def test_kernel_decode_matches_naive_loop(dtype, tol, layout, options):
    rng = random.Random(f"k-{dtype}-{layout}-{options}")
    for _ in range(3):
        case = make_case(rng, num_seqs=rng.randint(1, 9), block_size=rng.choice([1, 4, 16]),
                         hkv=rng.choice([1, 2, 3]), group=rng.choice([1, 3, 4]),
                         head_dim=rng.choice([16, 64, 80, 128]), dtype=dtype, max_ctx=70, decode_only=True)
        case["query"] = case["query"] * 3      # sharper softmax: a wrong key would show
        if layout == "head":
            case["key_cache"], case["value_cache"] = _head_major(case["key_cache"]), _head_major(case["value_cache"])
        got = cpu_ext.decode_attention(*_decode_args(case), options.get("sliding_window"), options.get("soft_cap"))
        assert got.dtype == torch.float32 and got.shape == case["query"].shape
        # bf16 K/V are read exactly (fp32 math): the error is the fp32 one against the same bf16 inputs.
        assert rel_err(got, naive_attention(**case, **options)) <= tol


def test_kernel_options_change_the_answer():
    # The window and the cap reach the kernel (a kernel ignoring them would pass the test above
    # only if they did nothing): each moves the result away from plain attention.
    case = make_case(random.Random(5), num_seqs=4, block_size=4, hkv=2, group=2, head_dim=16,
                     dtype=torch.float32, max_ctx=40, decode_only=True)
    assert int(case["seq_lens"].max()) > 3     # some context longer than the window
    case["query"] = case["query"] * 4
    plain = cpu_ext.decode_attention(*_decode_args(case))
    assert rel_err(cpu_ext.decode_attention(*_decode_args(case), 3, None), plain) > 1e-3
    assert rel_err(cpu_ext.decode_attention(*_decode_args(case), None, 0.5), plain) > 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_dispatch_mixed_batch_uses_kernel_for_decode_rows_and_matches_naive_loop(dtype, tol, monkeypatch):
    # Decode rows, chunks over cached prefixes and whole prefills in one packed batch: the decode
    # rows go to the kernel (counted), the rest to the reference, and the whole answer is the loop's.
    calls = []
    real = cpu_ext.decode_attention
    monkeypatch.setattr(cpu_ext, "decode_attention", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    rng = random.Random(f"mix-{dtype}")
    for _ in range(4):
        case = make_case(rng, num_seqs=rng.randint(4, 8), block_size=rng.choice([4, 16]), hkv=rng.choice([1, 3]),
                         group=rng.choice([1, 3]), head_dim=32, dtype=dtype, max_ctx=50)
        key, value = _own_kv(case)
        hm = dict(case, key_cache=_head_major(case["key_cache"]), value_cache=_head_major(case["value_cache"]))
        got = kernels.paged_attention(**hm, key=key, value=value)
        assert got.dtype == dtype
        assert rel_err(got, naive_attention(**case)) <= tol
    assert calls and sum(calls) > 0


def test_decode_rows_of_the_kernel_equal_the_reference_gather_in_fp32():
    case = make_case(random.Random(9), num_seqs=40, block_size=16, hkv=3, group=3, head_dim=64,
                     dtype=torch.float32, max_ctx=200, decode_only=True)
    hm = dict(case, key_cache=_head_major(case["key_cache"]), value_cache=_head_major(case["value_cache"]))
    want = reference.paged_attention(**hm)
    got = kernels.CpuAttention(cpu_ext.current()[0]).attend(hm["query"], hm["key_cache"], hm["value_cache"],
                                                            _step(hm), hm["scale"])
    assert (got - want).abs().max().item() <= 1e-5


def _step(case, slots=None):
    """A kernels.step.Step (and its plan) for a case's tensors."""
    lens, qsl = case["seq_lens"].tolist(), case["query_start_loc"].tolist()
    return kernels.Step(slot_mapping=slots, block_tables=case["block_tables"], seq_lens=case["seq_lens"],
                        query_start_loc=case["query_start_loc"], seq_lens_cpu=lens, query_start_loc_cpu=qsl,
                        plan=kernels.plan_step(case["block_tables"], case["seq_lens"], case["query_start_loc"],
                                               case["key_cache"].shape[1], slot_mapping=slots, rows=qsl[-1],
                                               seq_lens_cpu=lens, query_start_loc_cpu=qsl))


def test_torch_backend_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("LMI_CPU_KERNELS", "torch")
    assert cpu_ext.load() is None
    assert type(kernels.backend_for("cpu")) is kernels.TorchAttention
    with pytest.raises(RuntimeError, match="not available"):
        cpu_ext.decode_attention(torch.zeros(1, 2, 8), torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8),
                                 torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)


def test_failed_build_falls_back_to_the_reference_with_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("LMI_CPU_EXT_CACHE", str(tmp_path))     # nothing cached: a build is needed
    monkeypatch.setenv("CC", "false")                          # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="lmi.kernels"):
        assert cpu_ext.load() is None
    assert "CPU kernels (" in caplog.text and "unavailable" in caplog.text and "false failed" in caplog.text
    case = make_case(random.Random(4), num_seqs=5, block_size=4, hkv=2, group=2, head_dim=16,
                     dtype=torch.float32, max_ctx=30, decode_only=True)
    assert type(kernels.backend_for("cpu")) is kernels.TorchAttention
    assert rel_err(kernels.paged_attention(**case), naive_attention(**case)) <= 1e-5
    assert list(tmp_path.iterdir()) == []                      # no half-written object left behind


def test_build_is_cached_per_cpu(monkeypatch, tmp_path):
    first = cpu_lib.build(str(tmp_path))
    assert cpu_lib.build(str(tmp_path)) == first               # reused, not rebuilt
    monkeypatch.setattr(cpu_build, "cpu_signature", lambda: "model name: another CPU\nflags: sse2")
    other = cpu_lib.build(str(tmp_path))
    assert other != first and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.rsplit("/", 1)[1], other.rsplit("/", 1)[1]])


def test_kernel_skips_pools_it_cannot_read():
    assert not cpu_ext.supports(torch.zeros(2, 4, 2, 8, dtype=torch.float16))     # fp16: the reference
    assert not cpu_ext.supports(torch.zeros(2, 4, 2, 8).transpose(2, 3))           # D not contiguous
    assert cpu_ext.supports(torch.zeros(2, 2, 4, 8, dtype=torch.bfloat16).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["token", "head"])
def test_kernel_write_kv_equals_reference_write(dtype, layout):
    # Rows as the attention hands them over (a transposed view of [Hkv, T, D]), some slots -1.
    gen = torch.Generator().manual_seed(3)
    nb, bs, hkv, d, t = 6, 4, 3, 16, 9
    pools = [torch.randn(nb, bs, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    if layout == "head":
        pools = [_head_major(p) for p in pools]
    key = torch.randn(hkv, t, d, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(hkv, t, d, generator=gen).to(dtype).transpose(0, 1)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[2, 5]] = -1
    want = [p.clone() for p in pools]
    reference.write_kv(*want, key, value, slots)
    kernels.write_kv(*pools, key, value, slots)
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    assert not torch.equal(want[0], pools[0].clone().zero_())   # rows were written at all
    assert cpu_ext.write_kv(*pools, key, value, slots)          # the kernel, not the fallback, took it


def test_kernel_write_kv_refuses_a_slot_past_the_pool():
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(IndexError, match="past the pool's 8 slots"):
        cpu_ext.write_kv(kc, vc, torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.tensor([3, 8]))
    assert not kc.any() and not vc.any()                        # nothing written


def test_rms_norm_bf16_kernel_matches_float64_math():
    # Against the formula itself in float64 (then rounded as transformers rounds): within one
    # bf16 step, and a row of zeros stays zeros (eps keeps the rsqrt finite).
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(37, 96, generator=gen) * 4).to(torch.bfloat16)
    x[5] = 0
    w = torch.randn(96, generator=gen).to(torch.bfloat16)
    got = cpu_ext.rms_norm_bf16(x, w, 1e-6)
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    want = (w.double() * normed.double()).to(torch.bfloat16)
    step = want.float().abs().clamp_min(1e-30) * 2 ** -7
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ((got.float() - want.float()).abs() <= 2 * step).all()
    assert torch.equal(got[5], torch.zeros(96, dtype=torch.bfloat16))
    assert cpu_ext.rms_norm_bf16(x.float(), w, 1e-6) is None              # fp32: not this kernel's
    assert cpu_ext.rms_norm_bf16(x.t(), w[:37], 1e-6) is None             # not contiguous


@pytest.mark.parametrize("hidden", [8, 13, 64, 576, 2048, 4096])
def test_rms_norm_f32_kernel_equals_transformers_bit_for_bit(hidden):
    # Oracle: transformers' LlamaRMSNorm (pow, mean, rsqrt, two products), on fresh inputs of
    # several magnitudes, decode-sized row counts and a zero row; the kernel must give every bit.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    gen = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    for rows in (1, 2, 5, cpu_probes.TORCH_GRAIN // hidden - 1):
        if rows < 1:
            continue
        x = torch.randn(rows, hidden, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
        x[rows // 2] = 0
        got = cpu_ext.rms_norm_f32(x, norm.weight.detach(), 1e-5)
        assert got is not None, "the kernel declined a contiguous fp32 input under torch's grain"
        with torch.no_grad():
            want = norm(x)
        assert torch.equal(got, want), (rows, (got - want).abs().max().item())
    # Not this kernel's: bf16, a strided view, a batch at torch's parallel grain.
    w = norm.weight.detach()
    assert cpu_ext.rms_norm_f32(torch.randn(2, hidden).bfloat16(), w, 1e-5) is None
    assert cpu_ext.rms_norm_f32(torch.randn(hidden, 4).t(), w, 1e-5) is None
    assert cpu_ext.rms_norm_f32(torch.randn(cpu_probes.TORCH_GRAIN // hidden + 1, hidden), w, 1e-5) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
def test_rotary_kernel_equals_transformers_bit_for_bit(dtype, heads):
    # Oracle: transformers' own apply_rotary_pos_emb and rotary module on the same inputs.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    h, hkv = heads
    d, t = 64, 29
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, num_key_value_heads=hkv)
    gen = torch.Generator().manual_seed(10)
    # q/k as the projections give them: [T, heads*D] rows viewed [T, heads, D]
    q = torch.randn(t, h * d, generator=gen).to(dtype).view(t, h, d)
    k = torch.randn(t, hkv * d, generator=gen).to(dtype).view(t, hkv, d)
    pos = torch.tensor([[3, 0, 17, 1000, 4095] + list(range(50, 74))])
    cos, sin = LlamaRotaryEmbedding(cfg)(q, pos)                          # [1, T, D] in dtype
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert cpu_ext.rotary_(q, k, cos[0], sin[0])
    assert torch.equal(q, want_q[0].transpose(0, 1)) and torch.equal(k, want_k[0].transpose(0, 1))
    before = q.clone()
    assert not cpu_ext.rotary_(q, k, cos[0, :5], sin[0, :5])              # cos for other tokens
    assert not cpu_ext.rotary_(q, k.float() if dtype != torch.float32 else k.double(), cos[0], sin[0])
    assert torch.equal(q, before)                                          # refused: untouched


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    # A shared object linked with -ffast-math sets flush-to-zero for the whole process when it
    # loads (gcc's crtfastmath.o): torch's and Python's float math would silently change.
    import subprocess
    import sys
    code = ("import sys, torch\nfrom kernels import cpu as cpu_ext\nassert cpu_ext.load() is not None\n"
            "x = sys.float_info.min\nassert x / 4 > 0, 'subnormals flushed to zero'\n"
            "assert (torch.tensor([x], dtype=torch.float64) / 4).item() > 0\n"
            "assert (torch.tensor([1e-39]) * 1.0).item() > 0\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


each_build = each_build_fixture()


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 384), (33, 49152), (2, 151936)])
def test_row_stats_give_torch_argmax_and_log_softmax(each_build, rows, vocab):
    """The sampler's one-pass kernel: torch.argmax's index (ties: the first), and log_softmax of
    the chosen token from (x - max) - logsum, against float64 log_softmax, on every build (the
    sum's error must not grow with the vocabulary or the vector width)."""
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[0, vocab // 2] = x[0].max() + 1.0
    x[0, vocab - 1] = x[0, vocab // 2]            # a tie: the first index wins, as in torch
    wide = torch.randn(rows, vocab + 5, generator=g)
    masked = x.clone()
    masked[:, 1::3] = float("-inf")               # some logits masked out: still the kernel's
    for logits in (x, wide[:, 2:vocab + 2], masked):   # contiguous rows, rows at a stride, masked
        idx, row_max, logsum = cpu_ext.row_stats(logits)
        assert torch.equal(idx, logits.argmax(dim=-1))
        lp = (logits.gather(1, idx[:, None])[:, 0] - row_max) - logsum
        want = torch.log_softmax(logits.double(), dim=-1).gather(1, idx[:, None])[:, 0]
        assert torch.allclose(lp.double(), want, atol=1e-5, rtol=0)


def test_row_stats_hand_non_finite_rows_back_to_torch(each_build):
    x = torch.randn(3, 64)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 5] = bad
        assert cpu_ext.row_stats(y) is None
    y = x.clone()
    y[2] = float("-inf")
    assert cpu_ext.row_stats(y) is None
    assert cpu_ext.row_stats(x.to(torch.bfloat16)) is None      # fp32 only
    assert cpu_ext.row_stats(x.t()) is None                     # rows must be contiguous


@pytest.mark.parametrize("m", [1, 5, 12, 13, 37, 64, 300])
@pytest.mark.parametrize("k,n", [(64, 1), (96, 17), (256, 32), (576, 192), (100, 333), (1536, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_float64_within_the_fp32_sum_bound(each_build, m, k, n, bias):
    # Oracle: the float64 product. An fp32 sum of k products (each FMA rounds once) is within
    # k * 2^-24 * sum_k |a_k w_k| of it (the standard bound, plus the bias add's rounding).
    assert cpu_ext.gemm_available()
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = cpu_ext.gemm(x, cpu_ext.pack_panels(w), n, b)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    bound = (k + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0))
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


def test_gemm_rows_do_not_depend_on_the_batch_and_inputs_may_be_views(each_build):
    # Each output row is its own k-ordered sum: the same bits alone, in a batch of 7 or of 300,
    # and from a 3-D input, a row-strided view or a non-contiguous one.
    g = torch.Generator().manual_seed(1)
    k, n = 576, 200
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = cpu_ext.pack_panels(w)
    x = torch.randn(300, k, generator=g)
    full = cpu_ext.gemm(x, p, n, b)
    for rows in (slice(0, 1), slice(3, 10), slice(40, 300)):
        assert torch.equal(cpu_ext.gemm(x[rows], p, n, b), full[rows])
    assert torch.equal(cpu_ext.gemm(x.view(3, 100, k), p, n, b), full.view(3, 100, n))
    wide = torch.randn(300, k + 8, generator=g)
    wide[:, :k] = x
    assert torch.equal(cpu_ext.gemm(wide[:, :k], p, n, b), full)          # rows at stride k + 8
    xt = x.t().contiguous().t()                                           # column-major: copied
    assert torch.equal(cpu_ext.gemm(xt, p, n, b), full)
    assert cpu_ext.gemm(x[:0], p, n, b).shape == (0, n)
    assert torch.equal(cpu_ext.gemm(torch.randn(4, 0), cpu_ext.pack_panels(torch.randn(n, 0)), n, b),
                       b.expand(4, n))                                  # no inputs: the bias alone


@pytest.mark.parametrize("k", [1024, 3072])
def test_gemm_rows_at_a_4k_stride_are_copied_without_changing_a_bit(each_build, k):
    # Rows 4 KiB apart (or a multiple) go through a copy at another stride (kernels/cpu_panel.h
    # lmi_panel_pad): each row still equals itself alone (one row: no copy), in one chunk or several,
    # and a view whose stride aliases reads only its own columns (NaN after them).
    g = torch.Generator().manual_seed(k)
    n = 70
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = cpu_ext.pack_panels(w)
    x = torch.randn(300, k, generator=g)
    alone = torch.cat([cpu_ext.gemm(x[i:i + 1], p, n, b) for i in range(300)])
    for m in (8, 13, 40, 300):
        assert torch.equal(cpu_ext.gemm(x[:m], p, n, b), alone[:m]), m
    want = x.double() @ w.double().t() + b.double()
    assert ((alone.double() - want).abs() <= (k + 1) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()
                                                                     + b.double().abs())).all()
    wide = torch.full((300, 1024), float("nan"))
    wide[:, :1000] = x[:, :1000]
    q = cpu_ext.pack_panels(w[:, :1000])
    assert torch.equal(cpu_ext.gemm(wide[:, :1000], q, n, b), cpu_ext.gemm(x[:, :1000].contiguous(), q, n, b))


def test_gemm_gives_the_same_answer_on_any_number_of_threads(each_build):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(37, 300, generator=g), torch.randn(130, 300, generator=g)
    p = cpu_ext.pack_panels(w)
    before = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu_ext.gemm(x, p, 130, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def each_build_of(f):
    """{build: f()} for every kernel build this CPU runs, each selected in turn (back to the default
    after); skips, saying why, where the CPU runs fewer than two."""
    builds = isa.host_isas()
    if len(builds) < 2:
        pytest.skip(f"this CPU ({isa.machine()}) runs {' and '.join(builds) or 'no'} kernel build(s) of "
                    f"{', '.join(isa.ISAS)}: no second build to compare")
    outs = {}
    try:
        for b in builds:
            cpu_ext.select(b)
            assert cpu_ext.gemm_available(), f"the {b} build has no panel GEMM"
            outs[b] = f()
    finally:
        cpu_ext.select(None)
    return outs


# Row counts around every build's register blocks (AVX-512 14, AVX2 / NEON 3 rows), odd and even k,
# partial last panels, 1 to 3 panels per thread.
CROSS_ROWS = [1, 2, 3, 4, 5, 7, 13, 14, 15, 29, 64, 127, 300]
CROSS_KN = [(1, 1), (2, 31), (7, 33), (64, 96), (300, 130), (577, 70), (576, 192), (1536, 40)]


def test_gemm_every_build_gives_the_same_bits():
    # The exactness contract between instruction sets: each output's FMAs in k order from 0, then
    # + bias, whatever the vector width or register block, so the builds agree bit for bit.
    g = torch.Generator().manual_seed(3)
    cases = []
    for k, n in CROSS_KN:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        xs = torch.randn(max(CROSS_ROWS), k + 5, generator=g)[:, 2:k + 2]       # rows at stride k + 5
        cases.append((w, b, xs))

    def run():
        out = []
        for w, b, xs in cases:
            p = cpu_ext.pack_panels(w)
            for m in CROSS_ROWS:
                out += [cpu_ext.gemm(xs[:m], p, w.shape[0], b), cpu_ext.gemm(xs[:m], p, w.shape[0], None)]
        return out

    outs = each_build_of(run)
    first, *others = outs
    for other in others:
        for i, (a, c) in enumerate(zip(outs[first], outs[other])):
            assert torch.equal(a, c), f"{first} != {other}: case {i}, max |diff| {(a - c).abs().max().item()}"


def _fused_inputs(case, rng):
    """A decode step's q/k/v as views of one fused projection [B, (H + 2 Hkv) D], fresh K/V rows
    for each sequence's last position (slot), and cos/sin rows, in the case's dtype."""
    q = case["query"]
    b, h, d = q.shape
    hkv = case["key_cache"].shape[2]
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=gen).to(q.dtype)
    qv, kv, vv = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    ang = torch.rand(b, d // 2, generator=gen) * 6.0
    emb = torch.cat([ang, ang], dim=-1)
    bs = case["key_cache"].shape[1]
    tables, lens = case["block_tables"].tolist(), case["seq_lens"].tolist()
    slots = torch.tensor([tables[s][(n - 1) // bs] * bs + (n - 1) % bs for s, n in enumerate(lens)])
    return (qkv, qv.view(b, h, d), kv.view(b, hkv, d), vv.view(b, hkv, d),
            emb.cos().to(q.dtype), emb.sin().to(q.dtype), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_fused_decode_step_equals_rotary_write_and_attention(dtype, head_dim):
    # The CPU backend's decode step (one C call) against the three calls it replaces, on copies of
    # the same inputs: the same output bit for bit in fp32 and bf16, the same pools afterwards, q/k
    # rotated alike.
    rng = random.Random(f"fused-{dtype}-{head_dim}")
    for num_seqs in (1, 6):
        case = make_case(rng, num_seqs=num_seqs, block_size=rng.choice([4, 16]), hkv=3, group=3,
                         head_dim=head_dim, dtype=dtype, max_ctx=60, decode_only=True)
        case["key_cache"], case["value_cache"] = _head_major(case["key_cache"]), _head_major(case["value_cache"])
        qkv, q, k, v, cos, sin, slots = _fused_inputs(case, rng)
        pools = (case["key_cache"].clone(), case["value_cache"].clone())
        qkv2 = qkv.clone()
        common = dict(block_tables=case["block_tables"], seq_lens=case["seq_lens"],
                      query_start_loc=case["query_start_loc"], seq_lens_cpu=case["seq_lens"].tolist(),
                      query_start_loc_cpu=case["query_start_loc"].tolist())
        fused = []
        real = cpu_ext.decode_fused
        cpu_ext.decode_fused = lambda *a: fused.append(1) or real(*a)
        try:
            got = kernels.CpuAttention(cpu_ext.current()[0]).forward(q, k, v, *pools, _step(case, slots), case["scale"],
                                                                     cos=cos, sin=sin)
        finally:
            cpu_ext.decode_fused = real
        assert fused == [1] and got.dtype == dtype
        q2, k2, v2 = (t.view(t.shape[0], -1, head_dim) for t in qkv2.split([q[0].numel(), k[0].numel(), v[0].numel()], -1))
        assert cpu_ext.rotary_(q2, k2, cos, sin)
        kernels.write_kv(case["key_cache"], case["value_cache"], k2, v2, slots)
        want = kernels.paged_attention(q2, case["key_cache"], case["value_cache"], scale=case["scale"], **common)
        assert torch.equal(qkv, qkv2)                       # q and k rotated in place alike, v untouched
        assert torch.equal(pools[0], case["key_cache"]) and torch.equal(pools[1], case["value_cache"])
        assert torch.equal(got, want)


def test_fused_decode_step_declines_what_it_does_not_serve():
    rng = random.Random("fused-declines")
    case = make_case(rng, num_seqs=3, block_size=4, hkv=1, group=2, head_dim=16, dtype=torch.float32,
                     max_ctx=20, decode_only=True)
    qkv, q, k, v, cos, sin, slots = _fused_inputs(case, rng)
    before = (qkv.clone(), case["key_cache"].clone())
    pools = (case["key_cache"], case["value_cache"])
    # a step where a sequence feeds more than one row: not a decode step
    mixed = dict(case, query_start_loc=torch.tensor([0, 2, 3, 4], dtype=torch.int32))
    assert not _step(mixed).plan.all_decode
    # K/V in another dtype than the pools: the general path converts, the fused call declines
    assert cpu_ext.decode_fused(q, k.double(), v.double(), cos, sin, *pools, slots, _step(case).plan.dec_tables,
                                _step(case).plan.dec_lens, case["scale"]) is None
    assert torch.equal(qkv, before[0]) and torch.equal(case["key_cache"], before[1])
    # a slot past the pool: an error naming it, nothing written
    nslots = case["key_cache"].shape[0] * case["key_cache"].shape[1]
    with pytest.raises(IndexError, match=f"{nslots} slots"):
        kernels.CpuAttention(cpu_ext.current()[0]).forward(q, k, v, *pools, _step(case, torch.full_like(slots, nslots)),
                                                           case["scale"], cos=cos, sin=sin)
    assert torch.equal(qkv, before[0]) and torch.equal(case["key_cache"], before[1])


# ---------------------------------------------------------------------------- prompt attention
def _causal64(q, k, v, scale, causal=True):
    """float64 causal (or bidirectional) attention of one prompt: q [n, H, D], k/v [n, Hkv, D] -> [n, H, D]."""
    n, h, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)


def _packed(dtype, heads, kv_heads, d, lens, seed, panels=True):
    """q/k/v of packed sequences of `lens` rows ([H, T, D] storage read as [T, H, D]: token and head
    strides as transformers' views have them), `out` filled with 7s, and the sequences' first rows.
    panels: the kernel under test needs the panel GEMM of `dtype` (the encoder's does not)."""
    if panels and not (cpu_ext.gemm_bf16_available() if dtype == torch.bfloat16 else cpu_ext.gemm_available()):
        pytest.skip("the panel GEMM for this dtype is not in this build (bf16: the AVX512-BF16 dot GEMM)")
    if not panels and not cpu_ext.encoder_attention_available(dtype):
        pytest.skip("no C kernels in this build")
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(heads, t, d, generator=g).to(dtype).transpose(0, 1)
    k = torch.randn(kv_heads, t, d, generator=g).to(dtype).transpose(0, 1)
    v = torch.randn(t, kv_heads, d, generator=g).to(dtype)
    return q, k, v, torch.full((t, heads, d), 7.0, dtype=dtype), [sum(lens[:i]) for i in range(len(lens))]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 64), (9, 3, 64), (8, 1, 128), (6, 2, 48)])
def test_prompt_attention_is_causal_attention_of_each_prompt(dtype, tol, heads, kv_heads, d):
    # Oracle: float64 causal softmax attention per prompt; prompts shorter and longer than a
    # query chunk (64), odd lengths, q/k/v read through strided views (heads apart from rows).
    lens = [2, 17, 64, 65, 150, 3, 200]
    q, k, v, out, starts = _packed(dtype, heads, kv_heads, d, lens, heads * d)
    scale = d ** -0.5
    assert cpu_ext.prefill_attention(q, k, v, starts[1:], lens[1:], scale, out)
    assert torch.equal(out[:2], torch.full((2, heads, d), 7.0, dtype=dtype))     # not a prompt given: untouched
    for a, n in zip(starts[1:], lens[1:]):
        want = _causal64(q[a:a + n], k[a:a + n], v[a:a + n], scale)
        assert (out[a:a + n].double() - want).abs().max() <= tol * max(1.0, want.abs().max()), n


@pytest.mark.parametrize("dtype,pool_dtype,tol", [(torch.float32, torch.float32, 2e-6),
                                                   (torch.bfloat16, torch.bfloat16, 2e-2),
                                                   (torch.float32, torch.int8, 2e-6),
                                                   (torch.bfloat16, torch.int8, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d,head_major", [(4, 4, 64, False), (9, 3, 64, True), (6, 2, 48, True)])
def test_prompt_chunks_read_their_earlier_keys_from_the_pool(dtype, pool_dtype, tol, heads, kv_heads, d, head_major):
    # A prompt chunk after cached rows (prefix-cache hit, chunked prefill's continuation): its row i at
    # position before + i sees positions 0 .. before + i, the earlier ones read from the paged pools through
    # its block table (blocks scattered, tables padded past the context with -1), its own from this step's
    # rows. Oracle: float64 causal attention over the whole context as the pools hold it (int8: each row
    # quantized and read back, rounded to the activations' dtype); whole prompts (before 0) in the same call.
    q, _, _, out, starts = _packed(dtype, heads, kv_heads, d, [3, 17, 2, 64, 65, 9], heads * d + 1)
    lens, before, bs = [17, 2, 64, 65, 9], [5, 130, 0, 37, 64], 16
    g = torch.Generator().manual_seed(d)
    nblk = [-(-(b + n) // bs) for b, n in zip(before, lens)]
    perm = torch.randperm(sum(nblk) + 3, generator=g).tolist()
    tables = torch.full((len(lens), max(nblk) + 2), -1, dtype=torch.int32)
    for i, m in enumerate(nblk):
        tables[i, :m] = torch.tensor(perm[sum(nblk[:i]):sum(nblk[:i + 1])])
    kp, vp = (kernels.pool.allocate((len(perm), bs, kv_heads, d), pool_dtype, head_major=head_major) for _ in "kv")
    ks, vs, k, v = [], [], torch.zeros(out.shape[0], kv_heads, d, dtype=dtype), torch.zeros(out.shape[0], kv_heads, d,
                                                                                          dtype=dtype)
    for i, (b, n) in enumerate(zip(before, lens)):
        kk, vv = (torch.randn(b + n, kv_heads, d, generator=g).to(dtype) for _ in "kv")
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(b + n)])
        assert cpu_ext.write_kv(kp, vp, kk, vv, slots)
        kk, vv = kernels.pool.as_stored(kp, kk), kernels.pool.as_stored(vp, vv)   # what the pools give back
        ks.append(kk)
        vs.append(vv)
        a = starts[i + 1]
        k[a:a + n], v[a:a + n] = kk[b:], vv[b:]        # this step's rows, as the layer hands them over
    scale = d ** -0.5
    assert cpu_ext.prefill_attention(q, k, v, starts[1:], lens, scale, out, (kp, vp, tables, before))
    assert torch.equal(out[:3], torch.full((3, heads, d), 7.0, dtype=dtype))     # not a prompt given: untouched
    for i, (a, b, n) in enumerate(zip(starts[1:], before, lens)):
        full = torch.cat([torch.zeros(b, heads, d, dtype=dtype), q[a:a + n]])
        want = _causal64(full, ks[i], vs[i], scale)[b:]
        assert (out[a:a + n].double() - want).abs().max() <= tol * max(1.0, want.abs().max()), (b, n)
    # pools another dtype than the activations' (and not int8): declined, nothing written
    if pool_dtype != torch.int8:
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        op = (kernels.pool.allocate((len(perm), bs, kv_heads, d), other) for _ in "kv")
        mark = out.clone()
        assert not cpu_ext.prefill_attention(q, k, v, starts[1:], lens, scale, out, (*op, tables, before))
        assert torch.equal(out, mark)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,d", [(12, 12, 32), (4, 4, 64), (6, 2, 48)])
@pytest.mark.parametrize("lens", [
    [5, 1, 16, 64, 65, 130, 7, 256],    # most work in sequences of 128+ rows: the panel GEMMs where built
    [5, 1, 16, 64, 65, 127, 7, 33],     # short ones: query rows a block at a time
])
def test_encoder_attention_is_bidirectional_within_each_sequence(dtype, tol, heads, kv_heads, d, lens):
    # Oracle: float64 softmax attention over all of a sequence's rows (an encoder's, no mask), per
    # packed sequence; lengths across the 64-row query chunk, 1 and odd; strided q/k/v views.
    q, k, v, out, starts = _packed(dtype, heads, kv_heads, d, lens, heads + d, panels=False)
    scale = d ** -0.5
    assert cpu_ext.encoder_attention(q, k, v, starts[1:], lens[1:], scale, out)
    assert torch.equal(out[:5], torch.full((5, heads, d), 7.0, dtype=dtype))     # not a sequence given: untouched
    for a, n in zip(starts[1:], lens[1:]):
        want = _causal64(q[a:a + n], k[a:a + n], v[a:a + n], scale, causal=False)
        assert (out[a:a + n].double() - want).abs().max() <= tol * max(1.0, want.abs().max()), n
        if n > 1:   # not the causal answer: the first row sees the later ones
            causal = _causal64(q[a:a + n], k[a:a + n], v[a:a + n], scale)
            assert (out[a].double() - causal[0]).abs().max() > 1e-3


def test_paged_attention_sends_prompts_and_chunks_to_the_c_kernel(monkeypatch):
    # Two whole prompts and a continued one (5 tokens cached, 4 new) go to the kernel in one call, the
    # continued one's earlier keys read from the pool; the values are the reference's.
    if not cpu_ext.gemm_available():
        pytest.skip("kernels/cpu_gemm.c is not in this build")
    g = torch.Generator().manual_seed(5)
    h, hkv, d, bs = 6, 2, 32, 4
    kc, vc = torch.randn(24, bs, hkv, d, generator=g), torch.randn(24, bs, hkv, d, generator=g)
    lens, nq = [9, 20, 9], [9, 20, 4]
    qsl = [0, 9, 29, 33]
    tables = torch.tensor([[3, 7, 1, -1, -1], [0, 2, 4, 5, 6], [9, 11, 8, -1, -1]], dtype=torch.int32)
    slots = [int(tables[s, p // bs]) * bs + p % bs for s in range(3) for p in range(lens[s] - nq[s], lens[s])]
    q, k, v = (torch.randn(33, n, d, generator=g) for n in (h, hkv, hkv))
    kernels.write_kv(kc, vc, k, v, torch.tensor(slots))
    calls = []
    real = cpu_ext.prefill_attention
    monkeypatch.setattr(cpu_ext, "prefill_attention", lambda *a: calls.append(a[4]) or real(*a))
    args = (q, kc, vc, tables, torch.tensor(lens), torch.tensor(qsl), d ** -0.5)
    got = kernels.paged_attention(*args, key=k, value=v)
    want = reference.paged_attention(*args, key=k, value=v)
    assert calls == [[9, 20, 4]]
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
