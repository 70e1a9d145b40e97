"""A decode step's decoder stack in one C call (handler/model/cpu_stack.py, kernels/cpu_layer.c):
the Python layers' values bit for bit (logits and KV pools), and where it does not apply, why."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext

needs_stack = pytest.mark.skipif(not (cpu_ext.gemm_available() and cpu_ext.silu_exact(torch.get_num_threads())),
                                 reason="the C decode stack needs AVX-512 (kernels/cpu_gemm.c) and torch's Sleef")
needs_vnni = pytest.mark.skipif(not cpu_ext.gemm_i8_available(), reason="kernels/cpu_gemm_i8.c needs AVX-512 VNNI")
needs_bf16_panels = pytest.mark.skipif(not cpu_ext.gemm_bf16_available(),
                                       reason="kernels/cpu_gemm_bf16.c needs AVX512-BF16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_silu_mul_rounds_as_torch(dtype, threads):
    # Oracle: torch's own F.silu(inplace) then mul_, at every split torch's loop makes (vector
    # body, scalar tail, one chunk or several across threads), and where exp over/underflows.
    if not (cpu_ext.load() is not None and cpu_ext.silu_mul_(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype))):
        pytest.skip("kernels/cpu_layer.c's SiLU needs AVX-512 and torch's Sleef (an AVX512 build of torch)")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for n in (1, 17, 63, 64, 65, 688 * 3, 32768 - 1, 32768 + 5, 40 * 1536 + 3):
            x = (torch.randn(n, generator=g) * 8).to(dtype)
            x[::13] = -200.0
            x[5::29] = 150.0
            u = torch.randn(n, generator=g).to(dtype)
            mine = x.clone()
            assert cpu_ext.silu_mul_(mine, u)
            want = F.silu(x.clone(), inplace=True).mul_(u)
            assert torch.equal(mine, want), (n, (mine.float() - want.float()).abs().max())
    finally:
        torch.set_num_threads(old)


def _runner(model_dir, dtype="fp32", quantize=None, stack=True, window=None):
    from handler.model.runner import ModelRunner
    r = ModelRunner(model_dir, dtype=dtype, device="cpu", block_size=4, kv_cache_tokens=256, max_running=8,
                    quantize=quantize)
    if window:      # a sliding window on every other layer (Mistral / Qwen2's per-layer windows)
        for layer in r.model.model.layers[::2]:
            layer.self_attn.window = window
    r.prepack_cpu()
    if not stack:
        r.model.decode_stack = None
    return r


def _steps(runner, calls: list) -> list:
    """Two prompts, a mixed step (two decode rows and a third prompt), then decode-only steps; the
    logits of each step and the KV pools after them. `calls` collects whether the stack ran."""
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    from handler.model.runner import pack_step
    stack = runner.model.decode_stack
    if stack is not None:
        real = stack.run
        stack.run = lambda *a: calls.append(real(*a)) or calls[-1]
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(max_new_tokens=16)
    a, b, c = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (9, 5, 7))
    seqs = {1: (a, [0, 1, 2, 7]), 2: (b, [3, 4, 8]), 3: (c, [5, 6, 9, 10])}
    steps = [[StepItem(1, a, 0, seqs[1][1], True, p, a), StepItem(2, b, 0, seqs[2][1], True, p, b)],
             [StepItem(1, [17], 9, seqs[1][1], True, p, a + [17]), StepItem(2, [23], 5, seqs[2][1], True, p, b + [23]),
              StepItem(3, c, 0, seqs[3][1], True, p, c)]]
    toks = {1: a + [17], 2: b + [23], 3: c}
    for i in range(6):      # decode only: every sequence one row, contexts crossing block edges
        items = []
        for s in (1, 2, 3):
            t = (31 * i + 7 * s) % 200 + 3
            items.append(StepItem(s, [t], len(toks[s]), seqs[s][1], True, p, toks[s] + [t]))
            toks[s] = toks[s] + [t]
        steps.append(items)
    out = [runner.forward(pack_step(items, 4)[0]).clone() for items in steps]
    return out, [(k.clone(), v.clone()) for k, v in runner.kv_cache]


@needs_stack
@pytest.mark.parametrize("family,dtype,quantize,window,bf16_gemm", [
    ("llama", "fp32", None, None, None),
    ("qwen2", "fp32", None, 6, None),     # q/k/v biases, sliding windows
    pytest.param("llama", "fp32", "int8", None, None, marks=needs_vnni),
    pytest.param("llama", "bf16", None, None, "panels", marks=needs_bf16_panels),     # vdpbf16ps
    ("qwen2", "bf16", None, 6, "fp32"),     # bf16 weights widened in registers
    pytest.param("qwen2", "bf16", "int8", 6, None, marks=needs_vnni),
])
def test_decode_stack_gives_the_python_layers_values_bit_for_bit(demo_model_factory, monkeypatch, family, dtype,
                                                                 quantize, window, bf16_gemm):
    if bf16_gemm:
        monkeypatch.setenv("LMI_CPU_BF16_GEMM", bf16_gemm)
    path = demo_model_factory(family)
    fast, slow = _runner(path, dtype, quantize, window=window), _runner(path, dtype, quantize, False, window)
    assert fast.model.decode_stack is not None and slow.model.decode_stack is None
    calls = []
    got, got_kv = _steps(fast, calls)
    want, want_kv = _steps(slow, [])
    assert calls == [False, False] + [True] * 6     # prompts and the mixed step stay in Python
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


@needs_stack
def test_decode_stack_stays_off_where_it_does_not_apply(demo_model_factory, monkeypatch):
    r = _runner(demo_model_factory("qwen3"))     # per-head q/k norms
    assert r.model.decode_stack is None
    from handler.model import cpu_stack
    llama = _runner(demo_model_factory("llama"))
    stack, why = cpu_stack.build(llama.model, llama.kv_cache, lora=True)
    assert stack is None and why == "LoRA"
    monkeypatch.setenv("LMI_CPU_DECODE_STACK", "0")
    stack, why = cpu_stack.build(llama.model, llama.kv_cache)
    assert stack is None and "LMI_CPU_DECODE_STACK=0" in why
    monkeypatch.setenv("LMI_CPU_PREPACK", "0")      # plain nn.Linear: nothing packed for the C kernels
    monkeypatch.delenv("LMI_CPU_DECODE_STACK")
    assert _runner(demo_model_factory("llama")).model.decode_stack is None
