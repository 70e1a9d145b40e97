"""kernels/cpu_gemm_i8.c's avx2 build without VNNI (vpmaddwd over activations widened per call in row chunks,
a one-row kernel by vpmaddubsw) against the avx512 build's VNNI kernel: the same fp32 outputs bit for bit
where the avx2 driver's paths meet (row chunks, a one-row chunk after a full one, row blocks of 2 and 3,
half panels, ragged columns), with int8 values at both ends, and against the exact integer product."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu as cpu_ext
from kernels.cpu import build as cpu_build
from tests.support.kernels import both_x86


def _run(x, qw, sw, bias):
    """The selected build's lmi_quant_rows then lmi_gemm_i8 (its own packing) -> (Aq, sa, out)."""
    fn = cpu_ext.load()
    m, k = x.shape
    n = qw.shape[0]
    kp = -(-k // 4) * 4
    aq, sa = torch.empty(m, kp, dtype=torch.uint8), torch.empty(m)
    fn.quant_rows(x.data_ptr(), m, k, k, aq.data_ptr(), kp, sa.data_ptr(), torch.get_num_threads())
    panels, wsum = cpu_ext.pack_i8(qw)
    out = torch.empty(m, n)
    fn.gemm_i8(aq.data_ptr(), m, kp, sa.data_ptr(), panels.data_ptr(), wsum.data_ptr(), sw.data_ptr(), n,
               None if bias is None else bias.data_ptr(), out.data_ptr(), n, torch.get_num_threads())
    return aq, sa, out


def _chunk_rows(kp: int) -> int:
    """Rows per chunk of the avx2 driver's widened activations (about 1 MiB of int16, whole 3-row blocks;
    rows a cache line further apart where 2 kp bytes are a multiple of 4 KiB, as past 8 rows here)."""
    lda16 = kp + 32 if (2 * kp) % 4096 == 0 else kp
    return max(3, ((1 << 20) // (2 * lda16)) // 3 * 3)


@both_x86
@pytest.mark.parametrize("m,k,n", [
    (1, 4096, 40),                          # one row: the vpmaddubsw kernel, a ragged last panel
    (2, 100, 33), (3, 7, 17), (4, 64, 16),  # one block of 2 or 3 rows; 2 + 2; a panel's first half only
    (_chunk_rows(4096) + 1, 4096, 40),      # a full chunk, then a one-row chunk
    (_chunk_rows(4096) + 2, 4093, 97),      # a full chunk, then a 2-row one; k not a multiple of 4
])
def test_avx2_int8_paths_equal_the_avx512_build(m, k, n):
    g = torch.Generator().manual_seed(m * 7 + k)
    x = torch.randn(m, k, generator=g)
    x[:, : min(8, k)] = x[:, :1].abs() * 1e3 * torch.tensor([1., -1, 1, -1, 1, -1, 1, -1])[: min(8, k)]  # q = +-127
    qw = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    qw[:, : min(8, k)] = -128                                     # beside q = +-127: the largest products
    qw[: n // 2, -1] = 127
    sw = torch.rand(n, generator=g) * 1e-2
    bias = torch.randn(n, generator=g)
    got = {}
    try:
        for build in ("avx512", "avx2"):
            cpu_ext.select(build)
            assert cpu_ext.gemm_i8_available(), build
            got[build] = _run(x, qw, sw, bias)
    finally:
        cpu_ext.select(None)
    aq, sa, out = got["avx2"]
    for name, a, b in zip(("bytes", "scales", "outputs"), got["avx512"], got["avx2"]):
        assert torch.equal(a, b), (m, k, n, name)
    # and both are the definition: exact integer sums, one fp32 rescale (fma with the bias)
    q = aq[:, :k].double() - 128
    acc = q @ qw.double().T
    want = torch.addcmul(bias.double()[None], (acc.float() * sw[None]).double(), sa.double()[:, None])
    assert ((out.double() - want).abs() <= 1e-6 * want.abs().max()).all()


def test_int8_avx2_chunk_rows_matches_the_kernel_source():
    # _chunk_rows above mirrors the driver's row chunk; the sources must still say so.
    import os
    here = cpu_build.SRC_DIR
    i8 = ""
    for src in ("cpu_gemm_i8.c", os.path.join("x86", "gemm_i8.c")):    # the driver, the avx2 kernels' rows
        with open(os.path.join(here, src)) as f:
            i8 += f.read()
    with open(os.path.join(here, "cpu_panel.h")) as f:
        panel = f.read()
    assert "lmi_panel_chunk(2 * lda16, MRW)" in i8 and "#define MRW 3" in i8
    assert "(2 * Kp) % 4096 == 0 ? Kp + 32 : Kp" in i8
    assert "((1 << 20) / (row_bytes > 0 ? row_bytes : 1)) / mr * mr" in panel
