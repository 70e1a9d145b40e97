"""kernels/cpu_gemm_bf16.c through kernels/cpu/: the vdpbf16ps panel GEMM against float64 math
on the same bf16 values (AVX512-BF16 hosts, the avx512 build); the same panels widened in registers
against kernels/cpu_gemm.c on every build this CPU runs, and between the builds."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu as cpu_ext, isa
from kernels.cpu import build as cpu_build, lib as cpu_lib
from tests.support.kernels import each_build_fixture

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler (cc/gcc) on PATH: the CPU "
                                                                   "kernels cannot be built")
dot_needed = pytest.mark.skipif("avx512_bf16" not in cpu_ext.cpu_flags() or "avx512" not in isa.host_isas(),
                                reason="the vdpbf16ps GEMM needs AVX512-BF16 and the avx512 build (this CPU "
                                       "keeps oneDNN's bf16 or the widened panels)")


@pytest.fixture(autouse=True)
def default_build():
    """Each test starts on the default build and leaves it so."""
    cpu_ext.select(None)
    yield
    cpu_ext.select(None)


@pytest.fixture
def avx512():
    cpu_ext.select("avx512")
    yield
    cpu_ext.select(None)


each_build = each_build_fixture()


U = 2.0 ** -24      # fp32's unit roundoff


def _data(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g).to(torch.bfloat16),
            torch.randn(n, generator=g))


def _sum_bound(x, w, b, k):
    """|fp32 sum - exact| <= gamma_(k+1) * sum |terms| (each pair: two exact products added in fp32,
    then the bias): the classic bound of a recursive fp32 sum, 1% slack for gamma's denominator."""
    mag = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    return 1.01 * (k + 1) * U * mag


@dot_needed
@pytest.mark.parametrize("m", [1, 13, 64, 300])
@pytest.mark.parametrize("k,n", [(577, 70), (576, 192), (31, 33), (1536, 40), (2, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_gemm_bf16_matches_float64_within_the_fp32_sum_bound(avx512, m, k, n, bias):
    assert cpu_ext.gemm_bf16_available()
    x, w, b = _data(m, k, n)
    b = b if bias else None
    panels = cpu_ext.pack_bf16(w)
    assert panels.dtype == torch.bfloat16 and panels.numel() == -(-n // 32) * 32 * (-(-k // 2) * 2)
    got = cpu_ext.gemm_bf16(x, panels, n, b, torch.float32)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    bound = _sum_bound(x, w, b, k)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert ((got.double() - want).abs() <= bound).all()
    # The bound is tight enough to see a lost term: dropping the last k (an odd K's tail) breaks it.
    lost = x[:, :-1].double() @ w[:, :-1].double().t() + (0 if b is None else b.double())
    assert ((lost - want).abs() > bound).any()
    # bf16 out: the same fp32 sums rounded once, to nearest even, as torch rounds.
    assert torch.equal(cpu_ext.gemm_bf16(x, panels, n, b), got.to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 13, 64, 300])
@pytest.mark.parametrize("k,n", [(577, 70), (576, 192), (31, 33), (2, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_widened_in_registers_equals_the_fp32_panels_bit_for_bit(each_build, m, k, n, bias):
    # kernels/cpu_gemm.c over the widened weight is the reference: the same FMAs in the same order.
    assert cpu_ext.gemm_bf16w_available() and cpu_ext.gemm_available()
    x, w, b = _data(m, k, n, seed=6)
    b = b if bias else None
    want = cpu_ext.gemm(x.float(), cpu_ext.pack_panels(w.float()), n, b)
    p = cpu_ext.pack_bf16(w)
    assert torch.equal(cpu_ext.gemm_bf16(x, p, n, b, torch.float32, widen=True), want)
    assert torch.equal(cpu_ext.gemm_bf16(x, p, n, b, widen=True), want.to(torch.bfloat16))
    xf = x.float() + 1e-3                       # fp32 input taken as it is (not rounded to bf16)
    assert torch.equal(cpu_ext.gemm_bf16(xf, p, n, b, torch.float32, widen=True),
                       cpu_ext.gemm(xf, cpu_ext.pack_panels(w.float()), n, b))


def test_widened_rows_do_not_depend_on_the_batch_or_the_threads(each_build):
    k, n = 301, 97                      # odd K: the last value alone
    x, w, b = _data(300, k, n, seed=4)
    x = x.float() * 1.001
    p = cpu_ext.pack_bf16(w)
    full = cpu_ext.gemm_bf16(x, p, n, b, torch.float32, widen=True)
    for rows in (slice(0, 1), slice(5, 18), slice(100, 164)):
        assert torch.equal(cpu_ext.gemm_bf16(x[rows], p, n, b, torch.float32, widen=True), full[rows])
    wide = torch.full((300, k + 1), float("nan"))
    wide[:, :k] = x                     # the value after each row's last is NaN: it must not be read
    assert torch.equal(cpu_ext.gemm_bf16(wide[:, :k], p, n, b, torch.float32, widen=True), full)
    before = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(cpu_ext.gemm_bf16(x, p, n, b, torch.float32, widen=True), full)
    finally:
        torch.set_num_threads(before)


def _rows_alone(run, a):
    """Each row of a computed alone (one row: no copy)."""
    return torch.cat([run(a[i:i + 1]) for i in range(a.shape[0])])


def test_rows_at_a_4k_stride_are_copied_without_changing_a_bit(each_build):
    # kernels/cpu_panel.h's padded copy of A (rows 4 KiB apart): widened, fp32 rows of K 1024; each row
    # equals itself alone, in a batch of 8, 21 or 64.
    x, w, b = _data(64, 1024, 45, seed=1024)
    p = cpu_ext.pack_bf16(w)
    a = x.float() * 1.001
    run = lambda rows: cpu_ext.gemm_bf16(rows, p, 45, b, torch.float32, widen=True)   # noqa: E731
    alone = _rows_alone(run, a)
    for m in (8, 21, 64):
        assert torch.equal(run(a[:m]), alone[:m]), m


@dot_needed
def test_bf16_rows_at_a_4k_stride_are_copied_without_changing_a_bit(avx512):
    # The same for the vdpbf16ps GEMM: bf16 rows of K 2048.
    x, w, b = _data(64, 2048, 45, seed=2048)
    p = cpu_ext.pack_bf16(w)
    run = lambda rows: cpu_ext.gemm_bf16(rows, p, 45, b)    # noqa: E731
    alone = _rows_alone(run, x)
    for m in (8, 21, 64):
        assert torch.equal(run(x[:m]), alone[:m]), m


def test_only_the_avx512_build_has_the_dot_product_kernel(each_build):
    # vdpbf16ps is AVX512-BF16's; the AVX2 and NEON builds serve bf16 weights by widening them.
    assert cpu_ext.gemm_bf16w_available()
    if each_build != "avx512":
        assert not cpu_ext.gemm_bf16_available()


def test_widened_gemm_of_every_build_gives_the_same_bits():
    # The exactness contract between instruction sets: each output's FMAs in k order from 0 over
    # the widened weight, then + bias, then (bf16 out) one rounding, whatever the vector width or
    # register block (AVX-512 12 rows, AVX2 / NEON 2), so the builds agree bit for bit.
    builds = isa.host_isas()
    if len(builds) < 2:
        pytest.skip(f"this CPU ({isa.machine()}) runs {' and '.join(builds) or 'no'} kernel build(s) of "
                    f"{', '.join(isa.ISAS)}: no second build to compare")
    g = torch.Generator().manual_seed(3)
    rows = [1, 2, 3, 4, 5, 11, 12, 13, 25, 64, 127, 300]
    cases = []
    for k, n in [(1, 1), (2, 31), (7, 33), (64, 96), (301, 130), (577, 70), (576, 192), (1536, 40)]:
        w, b = torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(n, generator=g)
        xs = torch.randn(max(rows), k + 5, generator=g)[:, 2:k + 2]         # rows at stride k + 5
        cases.append((w, b, xs))
    outs = {}
    try:
        for build in builds:
            cpu_ext.select(build)
            assert cpu_ext.gemm_bf16w_available(), f"the {build} build has no widened bf16 GEMM"
            out = outs[build] = []
            for w, b, xs in cases:
                p = cpu_ext.pack_bf16(w)
                for m in rows:
                    for bias in (b, None):
                        for dt in (torch.float32, torch.bfloat16):
                            out.append(cpu_ext.gemm_bf16(xs[:m], p, w.shape[0], bias, dt, widen=True))
    finally:
        cpu_ext.select(None)
    first, *others = builds
    for other in others:
        for i, (a, c) in enumerate(zip(outs[first], outs[other])):
            assert torch.equal(a, c), f"{first} != {other}: case {i}, max |diff| {(a.float() - c.float()).abs().max()}"


@dot_needed
def test_swapped_pairs_or_columns_break_the_bound(avx512):
    # What a wrong interleave would compute (pairs swapped within k, columns shifted in a panel)
    # is far outside the bound the kernel meets: the bound checks the layout.
    x, w, _ = _data(13, 64, 64)
    bound = _sum_bound(x, w, None, 64)
    want = x.double() @ w.double().t()
    swapped = x.double() @ w.view(64, 32, 2).flip(-1).reshape(64, 64).double().t()
    shifted = x.double() @ w.roll(1, 0).double().t()
    assert ((swapped - want).abs() > bound).any() and ((shifted - want).abs() > bound).any()
    got = cpu_ext.gemm_bf16(x, cpu_ext.pack_bf16(w), 64, None, torch.float32)
    assert ((got.double() - want).abs() <= bound).all()


@dot_needed
@pytest.mark.parametrize("k", [577, 64, 5])
def test_fp32_input_is_rounded_to_bf16_as_torch_rounds(avx512, k):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, k, generator=g) * 3
    _, w, b = _data(1, k, 45, seed=3)
    p = cpu_ext.pack_bf16(w)
    for out in (torch.float32, torch.bfloat16):
        assert torch.equal(cpu_ext.gemm_bf16(x, p, 45, b, out), cpu_ext.gemm_bf16(x.to(torch.bfloat16), p, 45, b, out))


@dot_needed
def test_rows_do_not_depend_on_the_batch_and_inputs_may_be_views(avx512):
    k, n = 301, 97                      # odd K: rows at odd stride put a pair across two rows
    x, w, b = _data(300, k, n, seed=4)
    p = cpu_ext.pack_bf16(w)
    full = cpu_ext.gemm_bf16(x, p, n, b)
    for rows in (slice(0, 1), slice(5, 18), slice(100, 164)):
        assert torch.equal(cpu_ext.gemm_bf16(x[rows], p, n, b), full[rows])
    assert torch.equal(cpu_ext.gemm_bf16(x.view(3, 100, k), p, n, b), full.view(3, 100, n))
    wide = torch.full((300, k + 1), float("nan"), dtype=torch.bfloat16)
    wide[:, :k] = x                     # the value after each row's last is NaN: it must not be read
    assert torch.equal(cpu_ext.gemm_bf16(wide[:, :k], p, n, b), full)
    assert torch.equal(cpu_ext.gemm_bf16(x.t().contiguous().t(), p, n, b), full)
    assert cpu_ext.gemm_bf16(x[:0], p, n, b).shape == (0, n)
    empty = cpu_ext.gemm_bf16(torch.zeros(4, 0, dtype=torch.bfloat16), cpu_ext.pack_bf16(w[:, :0]), n, b)
    assert torch.equal(empty, b.expand(4, n).to(torch.bfloat16))


@dot_needed
def test_gemm_bf16_gives_the_same_answer_on_any_number_of_threads(avx512):
    x, w, b = _data(77, 576, 130, seed=5)
    p = cpu_ext.pack_bf16(w)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu_ext.gemm_bf16(x, p, 130, b, torch.float32))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_bad_inputs_get_one_clear_error():
    x, w, b = _data(3, 8, 8)
    with pytest.raises(ValueError, match="bf16 weight"):
        cpu_ext.pack_bf16(w.float())
    p = cpu_ext.pack_bf16(w)
    with pytest.raises(ValueError, match="takes bf16/fp32"):
        cpu_ext.gemm_bf16(x.half(), p, 8, b)
    with pytest.raises(ValueError, match="takes bf16/fp32"):
        cpu_ext.gemm_bf16(x, p, 8, b, torch.float16)
    with pytest.raises(ValueError, match="bias"):
        cpu_ext.gemm_bf16(x, p, 8, b.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        cpu_ext.gemm_bf16(x, p, 8, b[:4], widen=True)


@dot_needed
def test_a_cpu_without_avx512_bf16_reports_the_kernel_unavailable(avx512, monkeypatch):
    # The build has the instructions (-march=native here); the load-time check reads the CPU's flags.
    monkeypatch.setattr(cpu_lib, "cpu_flags", lambda: {"avx512f", "avx512bw"})
    cpu_ext.load.cache_clear()
    try:
        assert cpu_ext.load() is not None and cpu_ext.gemm_bf16_available() is False
        assert cpu_ext.gemm_available() and cpu_ext.gemm_bf16w_available()   # AVX-512F/BW suffice
    finally:
        monkeypatch.undo()
        cpu_ext.load.cache_clear()
    assert cpu_ext.gemm_bf16_available()
