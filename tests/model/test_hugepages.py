"""The packed weights a step streams sit in huge-page-advised memory (kernels/cpu/
empty_hugepage, LMI_CPU_HUGEPAGES): fp32 panels, W8A16's codes and scales, the output head; the
values, the step's logits and greedy tokens are the same with the switch on and off."""
from __future__ import annotations

import logging
import mmap

import pytest
import torch

from handler.engine.request import SamplingParams
from handler.model import cpu
from handler.model.cpu import hugepage_report, streamed_tensors
from handler.model.quant_int4 import is_grouped
from kernels import cpu as cpu_ext
from kernels.cpu import memory as cpu_memory
from tests.model.test_cpu import _runner, _step_logits
from tests.support.engine import NEW, PROMPTS, STRATEGIES, make_engine, run_all

pytestmark = [
    pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not cpu_memory._smaps(),
                       reason="needs Linux's madvise(MADV_HUGEPAGE) and /proc/self/smaps"),
    pytest.mark.skipif(not cpu_ext.gemm_available() or not cpu_ext.gemm_q_available(),
                       reason="kernels/cpu_gemm.c and cpu_gemm_q4.c are not built here (the torch backend, "
                              "or no C compiler)"),
]


def _big(ts):
    return [t for t in ts if t.numel() * t.element_size() >= cpu_ext.HUGE_PAGE]


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def _whole_pages(ts):
    """The bytes of ts in whole 2 MiB pages: what empty_hugepage advises."""
    return sum(t.numel() * t.element_size() // cpu_ext.HUGE_PAGE * cpu_ext.HUGE_PAGE for t in ts)


def _quantized_runner(path):
    from handler.model.runner import ModelRunner
    r = ModelRunner(path, dtype="fp32", device="cpu", block_size=4, kv_cache_tokens=256, max_running=8,
                    quantize="int8_weight_only")
    r.prepack_cpu()
    return r


@pytest.mark.parametrize("quantize", [None, "int8_weight_only"])
def test_streamed_weights_are_advised_and_unchanged_and_the_steps_logits_too(demo_model_factory, monkeypatch,
                                                                              caplog, quantize):
    path = demo_model_factory("qwen2")     # an 8192 x 256 head: 8 MiB of fp32 panels, 2 MiB of W8A16 codes
    runners = {}
    for setting in ("0", "auto"):
        monkeypatch.setenv("LMI_CPU_HUGEPAGES", setting)
        with caplog.at_level(logging.INFO, logger="lmi.runner"):
            runners[setting] = (_runner(path, "fp32", True) if quantize is None
                                else _quantized_runner(path))
    off, on = (streamed_tensors(runners[s].model) for s in ("0", "auto"))
    assert len(on) == len(off) > 0 and all(torch.equal(a, b) for a, b in zip(on, off))
    big = _big(on)
    head = runners["auto"].model.lm_head
    assert head.pack.tensors()[0].data_ptr() in {t.data_ptr() for t in big}     # its panels or codes
    if quantize:
        assert is_grouped(head)
    p_on, p_off = cpu_ext.hugepage_placement(on), cpu_ext.hugepage_placement(off)
    assert p_off["advised_bytes"] == 0
    assert p_on["advised_bytes"] == _whole_pages(big) > 0
    assert all(t.data_ptr() % cpu_ext.HUGE_PAGE == 0 for t in big)
    for got, want in zip(_step_logits(runners["auto"]), _step_logits(runners["0"])):
        assert torch.equal(got, want)
    said = [r.getMessage() for r in caplog.records if "huge pages" in r.getMessage()]   # one line per load
    assert len(said) == 2 and "huge pages: off (LMI_CPU_HUGEPAGES=0)" in said[0]
    assert f"huge pages: {_whole_pages(big) / 1e6:,.0f} of {_nbytes(on) / 1e6:,.0f} MB" in said[1]
    assert said[1] == "CPU: " + hugepage_report(runners["auto"].model)


@pytest.mark.parametrize("quantize", [None, "int8_weight_only"])
def test_greedy_tokens_equal_generates_with_huge_pages_on_and_off(demo_model_factory, tmp_path, monkeypatch,
                                                                  quantize):
    from tests.support.reference import hf_greedy
    path = demo_model_factory("llama")
    props = {**STRATEGIES["paged"], "option.dtype": "fp32"}
    if quantize:
        props["option.quantize"] = quantize
    got = {}
    for setting in ("auto", "0"):
        monkeypatch.setenv("LMI_CPU_HUGEPAGES", setting)
        engine = make_engine(path, tmp_path, props)
        try:
            head = engine.runner.model.lm_head
            advised = cpu_ext.hugepage_placement(head.pack.tensors()[:1])["advised_bytes"]
            assert (advised > 0) == (setting == "auto")
            got[setting] = [ids for ids, _ in run_all(engine, PROMPTS[:3],
                                                      [SamplingParams(max_new_tokens=n) for n in NEW[:3]])]
        finally:
            engine.shutdown()
    assert got["auto"] == got["0"]
    if quantize is None:
        assert got["auto"] == [hf_greedy(path, p, n) for p, n in zip(PROMPTS[:3], NEW[:3])]


def test_the_real_models_panels_are_nearly_all_in_advised_memory(real_model_dir, monkeypatch):
    # SmolLM2-135M fp32: the whole 2 MiB pages of the layers' 7 MiB gate|up, 3.5 MiB down and the
    # 113 MB head are advised; q|k|v and o (1.3-2 MiB) and the partial tails stay in 4 KiB pages.
    monkeypatch.delenv("LMI_CPU_HUGEPAGES", raising=False)
    r = _runner(real_model_dir, "fp32", True)
    ts = streamed_tensors(r.model)
    p = cpu_ext.hugepage_placement(ts)
    assert p["advised_bytes"] == _whole_pages(_big(ts)) >= 0.75 * p["bytes"]
    if cpu_ext.thp_mode() in ("always", "madvise"):
        assert p["huge_kib"] > 0
