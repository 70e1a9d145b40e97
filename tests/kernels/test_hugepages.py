"""kernels/cpu/'s huge-page allocation: empty_hugepage's tensors (alignment, shape, dtype,
values, lifetime), the kernel's placement of them in 2 MiB pages (/proc/self/smaps), the
LMI_CPU_HUGEPAGES switch and the fallbacks, and the packers' panels in that memory, unchanged."""
from __future__ import annotations

import gc
import logging
import mmap
import types

import pytest
import torch

from kernels import cpu as cpu_ext
from kernels.cpu import memory as cpu_memory

MiB = 1 << 20
linux_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not cpu_memory._smaps(),
                                   reason="needs Linux's madvise(MADV_HUGEPAGE) and /proc/self/smaps")
thp_on = pytest.mark.skipif(cpu_ext.thp_mode() not in ("always", "madvise"),
                            reason=f"transparent huge pages are {cpu_ext.thp_mode()!r} on this host; enable with "
                                   "`echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` (root)")
needs_panels = pytest.mark.skipif(not cpu_ext.gemm_available(),
                                  reason="kernels/cpu_gemm.c is not built here (the torch backend, or no C compiler)")


@pytest.fixture
def hugepages_on(monkeypatch):
    monkeypatch.delenv("LMI_CPU_HUGEPAGES", raising=False)


def _mapped(ptr: int) -> bool:
    return any(lo <= ptr < hi for lo, hi, *_ in cpu_memory._smaps())


@linux_madvise
@pytest.mark.parametrize("advise", [True, False])
@pytest.mark.parametrize("shape,dtype", [((3 * MiB + 12345,), torch.uint8), ((1000, 1531), torch.float32),
                                         ((4, 600, 1024), torch.bfloat16), ((2 * MiB,), torch.int8)])
def test_empty_hugepage_is_an_aligned_writable_tensor_of_the_shape_asked(shape, dtype, advise):
    t = cpu_ext.empty_hugepage(shape, dtype, advise=advise)
    nb = t.numel() * t.element_size()
    assert cpu_ext.hugepage_placement([t])["advised_bytes"] == (nb // (2 * MiB) * (2 * MiB) if advise else 0)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % cpu_ext.HUGE_PAGE == 0
    want = (torch.arange(t.numel()) % 251 - 125).to(dtype).view(shape)
    t.copy_(want)
    assert torch.equal(t, want)
    t2 = t.view(-1)[7:]                 # views share the mapping
    assert t2[0].item() == want.view(-1)[7].item()


@linux_madvise
def test_under_one_huge_page_or_switched_off_it_is_torch_empty(monkeypatch):
    small = cpu_ext.empty_hugepage((1000,), torch.float32, advise=True)
    assert small.shape == (1000,) and small.dtype == torch.float32
    assert cpu_ext.hugepage_placement([small])["advised_bytes"] == 0
    monkeypatch.setenv("LMI_CPU_HUGEPAGES", "0")
    assert not cpu_ext.hugepages_wanted()
    off = cpu_ext.empty_hugepage((8 * MiB,), torch.uint8)
    off.fill_(1)
    assert cpu_ext.hugepage_placement([off])["advised_bytes"] == 0


def test_the_switch_takes_auto_and_0_and_warns_once_on_other_values(monkeypatch, caplog):
    env = {"LMI_CPU_HUGEPAGES": "0"}
    assert not cpu_ext.hugepages_wanted(env)
    assert not cpu_ext.hugepages_wanted({"LMI_CPU_HUGEPAGES": " Off "})
    linux = hasattr(mmap, "MADV_HUGEPAGE") and cpu_memory._hp_state["refused"] is None
    assert cpu_ext.hugepages_wanted({}) is linux and cpu_ext.hugepages_wanted({"LMI_CPU_HUGEPAGES": "auto"}) is linux
    monkeypatch.setitem(cpu_memory._hp_state, "warned", False)
    with caplog.at_level(logging.WARNING, logger="lmi.kernels"):
        assert cpu_ext.hugepages_wanted({"LMI_CPU_HUGEPAGES": "huge"}) is linux
        cpu_ext.hugepages_wanted({"LMI_CPU_HUGEPAGES": "huge"})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "LMI_CPU_HUGEPAGES='huge'" in lines[0] and "auto, 0" in lines[0]


def test_without_madvise_it_falls_back_to_torch_empty(monkeypatch):
    # A platform whose mmap module has no MADV_HUGEPAGE (macOS, Windows): off, plain tensors.
    monkeypatch.setattr(cpu_memory, "mmap", types.SimpleNamespace())
    monkeypatch.delenv("LMI_CPU_HUGEPAGES", raising=False)
    assert not cpu_ext.hugepages_wanted()
    t = cpu_ext.empty_hugepage((4 * MiB,), torch.uint8, advise=True)
    assert t.shape == (4 * MiB,) and t.dtype == torch.uint8


@linux_madvise
def test_the_mapping_goes_with_the_last_tensor_that_uses_it():
    t = cpu_ext.empty_hugepage((3 * MiB,), torch.uint8, advise=True)
    ptr = t.data_ptr()
    view = t[MiB:]
    del t
    gc.collect()
    assert _mapped(ptr)            # the view holds it
    del view
    gc.collect()
    assert not _mapped(ptr)


@linux_madvise
@thp_on
def test_advised_memory_is_faulted_in_huge_pages_and_the_control_is_not():
    on = cpu_ext.empty_hugepage((64 * MiB,), torch.uint8, advise=True)
    off = cpu_ext.empty_hugepage((64 * MiB,), torch.uint8, advise=False)
    before = cpu_ext.hugepage_placement([on, off])
    on.fill_(3)
    off.fill_(3)
    p_on, p_off = cpu_ext.hugepage_placement([on]), cpu_ext.hugepage_placement([off])
    assert before["huge_kib"] == 0
    assert p_on["advised_bytes"] == 64 * MiB and p_off["advised_bytes"] == 0
    # Whole 2 MiB pages where the kernel found free ones (fragmentation may leave some in 4 KiB)
    assert p_on["huge_kib"] > 0 and p_on["huge_kib"] % 2048 == 0
    assert p_off["huge_kib"] == 0


@linux_madvise
@needs_panels
@pytest.mark.parametrize("n,k", [(1000, 700), (9728, 896)])
def test_packed_panels_are_the_same_values_in_advised_memory(monkeypatch, n, k):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g)
    monkeypatch.setenv("LMI_CPU_HUGEPAGES", "0")
    plain = cpu_ext.pack_panels(w)
    plain_i8, plain_sum = cpu_ext.pack_i8((w * 40).round().clamp(-127, 127).to(torch.int8))
    monkeypatch.setenv("LMI_CPU_HUGEPAGES", "auto")
    huge = cpu_ext.pack_panels(w)
    huge_i8, huge_sum = cpu_ext.pack_i8((w * 40).round().clamp(-127, 127).to(torch.int8))
    assert torch.equal(plain, huge) and torch.equal(plain_i8, huge_i8) and torch.equal(plain_sum, huge_sum)
    for t_plain, t_huge in ((plain, huge), (plain_i8, huge_i8)):
        nb = t_huge.numel() * t_huge.element_size()
        assert cpu_ext.hugepage_placement([t_plain])["advised_bytes"] == 0
        # its whole 2 MiB pages (none under one): the partial tail stays in 4 KiB pages
        assert cpu_ext.hugepage_placement([t_huge])["advised_bytes"] == nb // (2 * MiB) * (2 * MiB)
    x = torch.randn(1, k, generator=g)
    assert torch.equal(cpu_ext.gemm(x, plain, n, None), cpu_ext.gemm(x, huge, n, None))


@linux_madvise
@pytest.mark.parametrize("group", [None, 32])
def test_grouped_codes_are_advised_only_with_one_group_a_row(hugepages_on, group):
    """W8A16 (one group a row) streams its codes from huge-page-advised memory; with several groups
    a row (GGUF blocks, AWQ/GPTQ) the codes and scales stay in torch's memory (served slower so)."""
    from handler.model.quant_int4 import Grouped, pack
    n, k = 2048, 1536                               # 8-bit codes: 3 MiB
    gen = torch.Generator().manual_seed(k)
    g = k if group is None else group
    w = Grouped(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen),
                torch.rand(n, k // g, generator=gen), torch.rand(n, k // g, generator=gen), 8, g)
    packed = pack(w)
    codes = packed.codes
    advised = cpu_ext.hugepage_placement(packed.tensors())["advised_bytes"]
    if group is None:
        assert advised == codes.numel() // (2 * MiB) * (2 * MiB) > 0
    else:
        assert advised == 0
    monkeypatch_off = pytest.MonkeyPatch()
    monkeypatch_off.setenv("LMI_CPU_HUGEPAGES", "0")
    try:
        for got, want in zip(packed.tensors(), pack(w).tensors()):
            assert torch.equal(got, want)
    finally:
        monkeypatch_off.undo()


@linux_madvise
def test_placement_counts_only_its_own_advised_mappings():
    """Memory advised MADV_HUGEPAGE by anyone else (here by hand) is not empty_hugepage's: a tensor
    there counts no advised bytes, so the switch-off arm of a long-lived process reads 0."""
    buf = mmap.mmap(-1, 6 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    foreign = torch.frombuffer(buf, dtype=torch.uint8, count=4 * MiB, offset=0)
    foreign.fill_(1)
    ours = cpu_ext.empty_hugepage((4 * MiB,), torch.uint8, advise=True)
    ours.fill_(1)
    assert cpu_ext.hugepage_placement([foreign])["advised_bytes"] == 0
    assert cpu_ext.hugepage_placement([ours])["advised_bytes"] == 4 * MiB
    del foreign
