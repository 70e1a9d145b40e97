"""Attention oracles for the kernel tests: a naive per-token loop in float64, error measures, pool layouts;
and the fixture that runs a test on every kernel build this CPU runs."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu as cpu_ext, isa, reference, torch_paged
from kernels.cpu import build as cpu_build

# A check that compares builds needs a CPU running both x86 builds.
both_x86 = pytest.mark.skipif(not {"avx512", "avx2"} <= set(isa.host_isas()) or cpu_build.compiler() is None,
                              reason="the cross-build check needs a CPU that runs both the avx512 and the avx2 "
                                     "build (AVX-512 F/BW/VL) and a C compiler")


def each_build_fixture(capability: str | None = None, what: str = ""):
    """A fixture over each kernel build this CPU runs (kernels/isa.py), selected in turn and back to the
    default after; `capability` (a cpu_ext function, e.g. "gemm_i8_available") must hold in each."""
    @pytest.fixture(params=isa.host_isas() or ["none"])
    def each_build(request):
        if request.param == "none":
            pytest.skip(f"this CPU ({isa.machine()}) runs none of {', '.join(isa.ISAS)}: torch serves")
        if cpu_build.compiler() is None:
            pytest.skip("no C compiler (cc/gcc) on PATH: the CPU kernels cannot be built")
        cpu_ext.select(request.param)
        try:
            assert cpu_ext.load() is not None, f"the {request.param} build did not load"
            if capability:
                assert getattr(cpu_ext, capability)(), f"the {request.param} build has no {what or capability}"
            yield request.param
        finally:
            cpu_ext.select(None)
    return each_build


# One query row and one head at a time, keys gathered position by position, float64 (the oracle).
naive_attention = reference.paged_attention_f64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs() / (1 + want.double().abs())).max().item()


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in the CPU pool's layout: a [NB, bs, Hkv, D] view of [NB, Hkv, bs, D]."""
    hm = cache.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch_paged.head_major(hm) and torch.equal(hm, cache)
    return hm


def _own_kv(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own keys/values [T, Hkv, D], read from the pool at each row's position."""
    bs = case["key_cache"].shape[1]
    tables, lens, qsl = case["block_tables"].tolist(), case["seq_lens"].tolist(), case["query_start_loc"].tolist()
    slots = [tables[s][p // bs] * bs + p % bs for s in range(len(lens))
             for p in range(lens[s] - (qsl[s + 1] - qsl[s]), lens[s])]
    flat = lambda c: c.reshape(-1, *c.shape[2:])  # noqa: E731
    return flat(case["key_cache"])[slots], flat(case["value_cache"])[slots]
