"""The one-call C layer stack (handler/model/cpu_stack.py, kernels/cpu_layer.c) over grouped 4/8-bit
weights (handler/model/quant_int4.py GroupedPack, kernels/cpu_gemm_q4.c: lmi_lin kind LIN_Q): W8A16
(option.quantize=int8_weight_only), GGUF's blocks (K-quants, Q5_0/Q5_1, Q4_0, Q8_0) and AWQ, in fp32
and bf16 activations, give the Python layers' logits and KV pools bit for bit; on Qwen2.5-Coder-0.5B
the stack serves W8A16 and Qwen's q4_k_m GGUF with the Python layers' greedy answers, and start-up
says so.

The tiny-model tests run on the build this process picks; the last test reruns them in a subprocess
for every other build this CPU runs (torch's vectors at that build's width, as tests/model/test_cpu_stack.py
does)."""
from __future__ import annotations

import logging

import pytest
import torch

from handler.model.quant_int4 import GroupedPack, is_grouped
from kernels import cpu as cpu_ext, isa
from tests.model.test_cpu_stack import BUILD, _runner, _steps, needs_stack, passed_on_build
from tests.model.test_gguf_blocks import KINDS, tiny_qwen2_gguf  # noqa: F401 (a fixture)
from tests.model.test_quant_int4 import tiny_dir  # noqa: F401 (a fixture)

needs_q = pytest.mark.skipif(not cpu_ext.gemm_q_available(),
                             reason=f"no grouped-weight GEMM (kernels/cpu_gemm_q4.c) in the {BUILD} build")


@pytest.fixture(scope="module")
def awq_dir(tiny_dir, tmp_path_factory):  # noqa: F811
    """The tiny Llama of tests/model/test_quant_int4.py as an AutoAWQ checkpoint (RTN, group 32)."""
    from handler.tools.quantize_checkpoint import quantize_checkpoint
    d = str(tmp_path_factory.mktemp("awq") / "awq")
    quantize_checkpoint(tiny_dir, d, "awq", group=32)
    return d


def _model(request, source: str) -> tuple[str, str]:
    """(model directory, option.quantize) of a format family."""
    if source == "w8a16":
        return request.getfixturevalue("demo_model_factory")("qwen2"), "int8_weight_only"
    if source == "gguf":
        return request.getfixturevalue("tiny_qwen2_gguf"), "gguf"
    return request.getfixturevalue("awq_dir"), "awq"


# bits, groups and formats each family's linears must hold (what the stack's LIN_Q layers take)
FORMATS = {"w8a16": ({8}, {"int8_weight_only"}),
           "gguf": ({4, 8}, {f"gguf {k}" for k in KINDS}),
           "awq": ({4}, {"awq"})}


@needs_stack
@needs_q
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("source", ["w8a16", "gguf", "awq"])
def test_stack_over_grouped_weights_gives_the_python_layers_values_bit_for_bit(request, caplog, source, dtype):
    path, quantize = _model(request, source)
    with caplog.at_level(logging.INFO, logger="lmi.runner"):
        fast = _runner(path, dtype, quantize)
    slow = _runner(path, dtype, quantize, stack=False)
    assert fast.model.decode_stack is not None and slow.model.decode_stack is None
    assert "a step's layers in one C call" in caplog.text and "layers in Python" not in caplog.text
    lins = [m for layer in fast.model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    bits, fmts = FORMATS[source]
    assert lins and all(is_grouped(m) for m in lins)     # (W8A16 fuses q|k|v and gate|up)
    assert {m.pack.bits for m in lins} == bits and {m.pack.fmt for m in lins} == fmts
    assert all(isinstance(m.pack, GroupedPack) for m in lins)   # kernels/cpu_gemm_q4.c serves them in Python too
    calls = []
    got, got_kv = _steps(fast, calls)
    want, want_kv = _steps(slow, [])
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and torch.equal(g, w), (i, (g.float() - w.float()).abs().max())
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    # the decode steps ran in C, and the prompt and mixed steps too where the build's prompt
    # attention takes the dtype (not bf16 on avx2)
    assert calls == [fast.model.decode_stack.prompts] * 2 + [True] * 6


_OTHER_BUILDS = [b for b in isa.host_isas() if b != BUILD]


@pytest.mark.parametrize("build", _OTHER_BUILDS or [None])
def test_grouped_stack_on_every_other_build_this_cpu_runs(build):
    # The tests above in a subprocess with LMI_CPU_KERNELS=build (torch at the build's width): they
    # must pass there, not skip.
    if build is None:
        pytest.skip(f"this CPU runs no build but {BUILD}, tested above")
    passed, out = passed_on_build(build, __file__, "bit_for_bit")
    for source in ("w8a16", "gguf", "awq"):
        for dtype in ("fp32", "bf16"):
            want = f"test_stack_over_grouped_weights_gives_the_python_layers_values_bit_for_bit[{source}-{dtype}]"
            assert want in passed, f"{want} did not pass on the {build} build:\n{out[-4000:]}"


# ---------------------------------------------------------------------------- Qwen2.5-Coder-0.5B
@pytest.fixture(scope="module")
def qwen_dir() -> str:
    from tests.test_real_qwen import MODELS_DIR, QWEN_05B, real_dir
    return real_dir(QWEN_05B, MODELS_DIR / QWEN_05B.family)


def _answers(model_dir: str, quantize: str, stack: bool, monkeypatch, caplog) -> list[list[int]]:
    from handler.tools import quality
    from handler.model import cpu
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmi.runner"):
        engine = quality.engine_for(model_dir, "fp32", quantize, arms=cpu.Arms(decode_stack=stack))
    try:
        assert (engine.runner.model.decode_stack is not None) == stack
        said = "a step's layers in one C call" if stack else "the decode_stack=0 arm"
        assert said in caplog.text, caplog.text[-2000:]
        assert any(is_grouped(m) for m in engine.runner.model.modules())
        return quality.chat_answers(engine, quality.chat_ids(engine.runner.tokenizer, quality.CHAT[:3]), 16)
    finally:
        engine.shutdown()


@needs_stack
@needs_q
@pytest.mark.parametrize("quantize", ["int8_weight_only", "gguf"])
def test_real_qwen_greedy_through_the_stack_equals_the_python_layers(qwen_dir, quantize, monkeypatch, caplog):
    got = _answers(qwen_dir, quantize, True, monkeypatch, caplog)
    want = _answers(qwen_dir, quantize, False, monkeypatch, caplog)
    assert got == want
    assert all(len(ids) > 0 for ids in got)
