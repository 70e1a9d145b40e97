"""A step's decoder stack in one C call (handler/model/cpu_stack.py, kernels/cpu_layer.c): decode
rows and whole prompts, the Python layers' values bit for bit (logits and KV pools), and where it
does not apply, why.

The tests run on the build this process picks (LMI_CPU_KERNELS, else the best this CPU runs); the
last one reruns them in a subprocess for every other build this CPU runs, torch's own kernels
switched to the same vector width (ATEN_CPU_CAPABILITY), as torch's SiLU is reproduced only
beside Sleef's exp of the build's width."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from handler.model import cpu
from kernels import cpu as cpu_ext, isa
from kernels.cpu import elementwise as cpu_elementwise, probes as cpu_probes

BUILD = cpu_ext.current()[0]    # the build under test here (None: torch's operators)


def _why_not() -> str:
    """Why the C stack cannot run here ("" where it can)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if not cpu_ext.gemm_available():
        return f"no panel GEMM in the {BUILD} build"
    if not cpu_elementwise._silu_ready():
        found = cpu_probes.sleef_expf()
        return (f"the {BUILD} build's SiLU did not take torch's Sleef exp (torch's vectors {cap}: "
                + (f"{found[1]} lanes" if found else "none found") + "; ATEN_CPU_CAPABILITY must give the build's width)")
    if not cpu_ext.silu_exact(torch.get_num_threads()):
        return f"the {BUILD} build's SiLU differs from torch's ({cap})"
    return ""


_WHY = _why_not()
needs_stack = pytest.mark.skipif(bool(_WHY), reason=_WHY)
needs_vnni = pytest.mark.skipif(not cpu_ext.gemm_i8_available(), reason=f"no int8 GEMM in the {BUILD} build")
needs_bf16_panels = pytest.mark.skipif(not cpu_ext.gemm_bf16_available(),
                                       reason=f"no bf16 dot-product GEMM in the {BUILD} build (AVX512-BF16)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_silu_mul_rounds_as_torch(dtype, threads):
    # Oracle: torch's own F.silu(inplace) then mul_, at every split torch's loop makes (vector
    # body, scalar tail, one chunk or several across threads), and where exp over/underflows.
    if not (cpu_ext.load() is not None and cpu_ext.silu_mul_(torch.zeros(2, dtype=dtype), torch.zeros(2, dtype=dtype))):
        pytest.skip(f"kernels/cpu_layer.c's SiLU: {_WHY}")
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


def _runner(model_dir, dtype="fp32", quantize=None, stack=True, window=None, kv_tokens=256, arms=cpu.DEFAULT,
            kv_cache_dtype="auto"):
    from handler.model.runner import ModelRunner
    r = ModelRunner(model_dir, dtype=dtype, device="cpu", block_size=4, kv_cache_tokens=kv_tokens, max_running=8,
                    quantize=quantize, cpu_kernels=BUILD or "torch", arms=arms, kv_cache_dtype=kv_cache_dtype)
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
    return out, [(k.data.clone(), v.data.clone()) for k, v in runner.kv_cache]


@needs_stack
@pytest.mark.parametrize("family,dtype,quantize,window,bf16_gemm", [
    ("llama", "fp32", None, None, None),
    ("qwen2", "fp32", None, 6, None),     # q/k/v biases, sliding windows
    pytest.param("llama", "fp32", "int8", None, None, marks=needs_vnni),
    pytest.param("llama", "bf16", None, None, "panels", marks=needs_bf16_panels),     # vdpbf16ps
    ("qwen2", "bf16", None, 6, "fp32"),     # bf16 weights widened in registers
    pytest.param("qwen2", "bf16", "int8", 6, None, marks=needs_vnni),
    ("qwen3", "fp32", None, None, None),      # per-head q/k norms
    ("qwen3", "bf16", None, None, "fp32"),
    pytest.param("qwen3", "fp32", "int8", None, None, marks=needs_vnni),
])
def test_decode_stack_gives_the_python_layers_values_bit_for_bit(demo_model_factory, monkeypatch, family, dtype,
                                                                 quantize, window, bf16_gemm):
    arms = cpu.Arms(bf16_gemm=bf16_gemm) if bf16_gemm else cpu.DEFAULT
    path = demo_model_factory(family)
    fast, slow = _runner(path, dtype, quantize, window=window, arms=arms), _runner(path, dtype, quantize, False,
                                                                                  window, arms=arms)
    assert fast.model.decode_stack is not None and slow.model.decode_stack is None
    calls = []
    got, got_kv = _steps(fast, calls)
    want, want_kv = _steps(slow, [])
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    # The prompt step, the mixed step (decode rows, then a whole prompt) and the decode steps all
    # ran in C, except prompts beside sliding windows (the prompt kernel takes none: Python's SDPA)
    # or where the build has no prompt kernel for the dtype (bf16 on avx2: the load log says so).
    prompts = not window and fast.model.decode_stack.prompts
    assert prompts or window or dtype == "bf16"
    assert calls == ([True, True] if prompts else [False, False]) + [True] * 6


@needs_stack
def test_decode_stack_stays_off_where_it_does_not_apply(demo_model_factory, monkeypatch):
    from handler.model import cpu_stack
    r = _runner(demo_model_factory("gpt2"))      # transformers' model, not ours
    assert not r.own and cpu_stack.build(r.model, r.kv_cache) == (None, "not our model")
    llama = _runner(demo_model_factory("llama"))
    stack, why = cpu_stack.build(llama.model, llama.kv_cache, lora=True)
    assert stack is None and why == "LoRA"
    stack, why = cpu_stack.build(llama.model, llama.kv_cache, arms=cpu.Arms(decode_stack=False))
    assert stack is None and "decode_stack=0" in why
    # plain nn.Linear: nothing packed for the C kernels
    assert _runner(demo_model_factory("llama"), arms=cpu.Arms(prepack=False)).model.decode_stack is None


@needs_stack
def test_the_load_log_says_once_per_layer_why_a_layer_keeps_steps_out_of_the_stack(demo_model_factory, caplog):
    """The hot path is decided at load: where a layer keeps whole prompts out of the C stack (a
    sliding window), or keeps the stack off altogether (a norm it does not take), the load log says
    so once, naming the layer; the steps then follow the plan with no check of their own."""
    import logging
    path = demo_model_factory("qwen2")
    with caplog.at_level(logging.INFO, logger="lmi.runner"):
        r = _runner(path, window=6)
    said = [rec.getMessage() for rec in caplog.records if "layer stack:" in rec.getMessage()]
    n = len(r.model.model.layers)
    assert n > 2 and said == [f"CPU: layer stack: layer {i}: sliding window 6: whole prompts in Python (the "
                              "prompt kernel takes no window)" for i in range(0, n, 2)]
    assert r.model.decode_stack is not None and not r.model.decode_stack.prompts
    from handler.model import cpu_stack
    r.model.model.layers[1].post_attention_layernorm.eps *= 10
    stack, why = cpu_stack.build(r.model, r.kv_cache)
    assert stack is None and why == "layer 1: a norm the C stack does not take"


def test_every_norm_has_its_cpu_kernel_chosen_at_load(demo_model_factory):
    """RMSNorm decides at load how it computes on the CPU (handler/model/layers.py bind_kernel), so a
    step's norm makes no capability check; q/k norms (qwen3) included."""
    from handler.model.layers import RMSNorm
    r = _runner(demo_model_factory("qwen3"))
    norms = [m for m in r.model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) > 2 * len(r.model.model.layers)
    want = ("f32",) if BUILD and cpu_ext.rms_norm_f32_lanes(norms[0].weight.shape[0]) else ("f32", "torch")
    assert all(m.cpu_kernel in ("f32", "torch") for m in norms) and norms[0].cpu_kernel in want


def _run_steps(runner, steps: list, calls: list, rowwise: tuple[int, int] = (0, 0)) -> tuple[list, list]:
    from handler.model.runner import pack_step
    stack = runner.model.decode_stack
    if stack is not None:
        real = stack.run
        stack.run = lambda *a: calls.append(real(*a)) or calls[-1]
    out = [runner.forward(pack_step(items, 4, rowwise=rowwise)[0]).clone() for items in steps]
    return out, [(k.data.clone(), v.data.clone()) for k, v in runner.kv_cache]


def _same_as_python_layers(fast, slow, ref, steps: list, rowwise: tuple[int, int], tol: float) -> list:
    """Runs `steps` on three runners: the stack's (`fast`), the Python layers' (`slow`), both packing chunks
    by `rowwise`, and `ref` (its chunks as sequences); asserts fast equals slow bit for bit (logits and
    pools) and is within `tol` of ref's logits (relative to the largest); returns whether the stack ran."""
    calls = []
    got, got_kv = _run_steps(fast, steps, calls, rowwise=rowwise)
    want, want_kv = _run_steps(slow, steps, [], rowwise=rowwise)
    ref_out, _ = _run_steps(ref, steps, [])
    for i, (x, y, z) in enumerate(zip(got, want, ref_out)):
        assert x.shape == y.shape == z.shape and torch.equal(x, y), i
        err = (x.float() - z.float()).abs().max() / z.float().abs().max()
        assert err < tol, (i, err)
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    return calls


@needs_stack
@pytest.mark.parametrize("family,dtype", [("llama", "fp32"), pytest.param("llama", "bf16", marks=needs_bf16_panels),
                                          ("qwen3", "fp32"), pytest.param("qwen3", "bf16", marks=needs_bf16_panels)])
def test_stack_takes_long_prompts_and_declines_chunks_and_prompts_before_decodes(demo_model_factory, family, dtype):
    # Steps of 100-250 rows: past torch's parallel grain (32768 elements) in the norms, residual
    # adds and SiLU at hidden 256 / intermediate 688, where torch splits its loops across threads
    # (qwen3: its per-head q/k norms over 250 rows x 16 heads x 32 too).
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    path = demo_model_factory(family)
    fast = _runner(path, dtype, kv_tokens=1024)
    slow = _runner(path, dtype, stack=False, kv_tokens=1024)
    g = torch.Generator().manual_seed(5)
    p = SamplingParams(max_new_tokens=16)
    a, b, c, d, e = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (150, 100, 60, 80, 9))
    blk = iter(range(256))
    tab = {s: [next(blk) for _ in range(n // 4 + 2)] for s, n in zip("abcde", (150, 100, 60, 80, 9))}
    steps = [
        [StepItem(1, a, 0, tab["a"], True, p, a), StepItem(2, b, 0, tab["b"], True, p, b)],    # two prompts
        [StepItem(1, [7], 150, tab["a"], True, p, a + [7]), StepItem(2, [8], 100, tab["b"], True, p, b + [8]),
         StepItem(3, c, 0, tab["c"], True, p, c)],                                   # decode rows, then a prompt
        [StepItem(4, d[:40], 0, tab["d"], False, p, d)],      # a first chunk: its context is its rows (taken)
        [StepItem(4, d[40:], 40, tab["d"], True, p, d),                             # ... its rest: not whole
         StepItem(1, [9], 151, tab["a"], True, p, a + [7, 9])],
        [StepItem(5, e, 0, tab["e"], True, p, e),                                   # a prompt before decode rows
         StepItem(2, [10], 101, tab["b"], True, p, b + [8, 10])],
        [StepItem(s, [11], n, tab[k], True, p, []) for s, k, n in ((1, "a", 152), (3, "c", 60), (5, "e", 9))],
    ]
    calls = []
    got, got_kv = _run_steps(fast, steps, calls)
    want, want_kv = _run_steps(slow, steps, [])
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.shape == y.shape and torch.equal(x, y), i
    for (gk, gv), (wk, wv) in zip(got_kv, want_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    assert calls == [True, True, True, False, False, True]


@needs_stack
def test_a_whole_prompt_before_decode_rows_is_packed_after_them_and_answers_the_same(demo_model_factory):
    # The runner packs whole prompts after the other items (runner.stack_order), so a step whose prompt ranks
    # before decode rows (a better priority class's new request) runs in the C stack; each item gets what it
    # gets in stack order, and what the Python layers give it in the order asked.
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    from handler.model.runner import stack_order
    path = demo_model_factory("llama")
    g = torch.Generator().manual_seed(13)
    p = SamplingParams(max_new_tokens=16)
    a, b, c = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (20, 33, 12))
    tab = {"a": list(range(0, 8)), "b": list(range(8, 20)), "c": list(range(20, 26))}
    first = [StepItem(1, a, 0, tab["a"], True, p, a), StepItem(3, c, 0, tab["c"], True, p, c)]
    asked = [StepItem(2, b, 0, tab["b"], True, p, b),                       # a prompt, then decode rows
             StepItem(1, [7], 20, tab["a"], True, p, a + [7]), StepItem(3, [9], 12, tab["c"], True, p, c + [9])]
    assert stack_order(asked) == [1, 2, 0] and stack_order([asked[1], asked[2], asked[0]]) is None
    assert stack_order(first) is None

    def run(runner, items):
        calls = []
        stack = runner.model.decode_stack
        if stack is not None:
            real = stack.run
            stack.run = lambda *x: calls.append(real(*x)) or calls[-1]
        runner.step(first)
        return [(r.token, r.logprob) for r in runner.step(items)], calls

    got, calls = run(_runner(path), asked)
    assert calls == [True, True]                                            # both steps in C
    in_order, _ = run(_runner(path), [asked[1], asked[2], asked[0]])
    slow, slow_calls = run(_runner(path, stack=False), asked)
    assert slow_calls == []
    assert got == [in_order[2], in_order[0], in_order[1]] == slow


@needs_stack
@pytest.mark.parametrize("family,dtype", [("llama", "fp32"), ("qwen3", "fp32"),
                                          pytest.param("llama", "bf16", marks=needs_bf16_panels)])
def test_a_short_chunk_after_cached_rows_runs_in_the_stack_as_decode_rows(demo_model_factory, family, dtype):
    # A continuation chunk of a prompt (rows after cached ones) within the runner's key bound (a stack that
    # takes no prompts: sliding windows, no prompt kernel for the dtype) goes as one decode row per token
    # (pack_step's rowwise): the step keeps the stack's shape and runs in C,
    # equal bit for bit to the Python layers on the same packing, and (the attention being the same
    # causal attention over the cache) within rounding of the chunk attended as one sequence.
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    from handler.model.runner import ROWWISE_KEYS, pack_step
    path = demo_model_factory(family)
    g = torch.Generator().manual_seed(11)
    p = SamplingParams(max_new_tokens=16)
    a, d = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (30, 70))
    tab = {"a": list(range(0, 10)), "d": list(range(10, 30))}
    steps = [
        [StepItem(1, a, 0, tab["a"], True, p, a), StepItem(4, d[:25], 0, tab["d"], False, p, d)],
        [StepItem(1, [7], 30, tab["a"], True, p, a + [7]),                  # a decode row, then the
         StepItem(4, d[25:50], 25, tab["d"], False, p, d)],                 # prompt's middle chunk
        [StepItem(4, d[50:], 50, tab["d"], True, p, d),                     # its last chunk (samples)
         StepItem(1, [9], 31, tab["a"], True, p, a + [7, 9])],              # before a decode row
        [StepItem(1, [5], 32, tab["a"], True, p, []), StepItem(4, [6], 70, tab["d"], True, p, [])],
    ]
    assert 20 * 50 + 20 * 21 // 2 <= ROWWISE_KEYS       # the last chunk is within the bound
    rowwise = (0, ROWWISE_KEYS)
    # The packing: the middle chunk is 25 sequences of one row, contexts 26 .. 50; one logit row each step.
    packed, first = pack_step(steps[1], 4, rowwise=rowwise)
    t, s_, w, r = packed[:4].tolist()
    assert (t, s_, r) == (26, 26, 1) and first == [0, 1]
    seq_lens = packed[5 + 3 * t + s_ + 1: 5 + 3 * t + 2 * s_ + 1].tolist()
    assert seq_lens == [31] + list(range(26, 51))
    fast, slow, seq = (_runner(path, dtype, kv_tokens=512), _runner(path, dtype, stack=False, kv_tokens=512),
                       _runner(path, dtype, stack=False, kv_tokens=512))
    calls = _same_as_python_layers(fast, slow, seq, steps, rowwise, 1e-5 if dtype == "fp32" else 3e-2)  # bf16: 8 bits
    assert calls == [True, True, True, True]
    # Past the bound the chunk keeps its sequence and, ranked before a decode row, the step its Python layers.
    calls = []
    _run_steps(_runner(path, dtype, kv_tokens=512), steps, calls, rowwise=(0, 20 * 50))
    assert calls == [True, True, False, True]


@needs_stack
@pytest.mark.parametrize("family,dtype,quantize", [
    ("llama", "fp32", None), ("qwen3", "fp32", None),
    pytest.param("llama", "bf16", None, marks=needs_bf16_panels),
    pytest.param("qwen2", "fp32", "int8", marks=needs_vnni),         # int8 weights
])
@pytest.mark.parametrize("kv_int8", [False, True])
def test_a_long_chunk_after_cached_rows_runs_in_the_stack_over_the_pool(demo_model_factory, family, dtype, quantize,
                                                                         kv_int8):
    # Chunks past the runner's row-by-row bound (a prefix-cache hit's rest, a long prompt's continuation
    # under a prefill budget) keep their sequence: after decode rows the step has the stack's shape, the
    # chunk's earlier keys read from each layer's pools through its block table (lmi_kv_ctx). Equal bit
    # for bit to the Python layers (the same kernel per layer), within rounding of the torch math's
    # gathered attention, and the pools hold the same rows.
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    from handler.model.runner import ROWWISE_ROWS
    from kernels.backends import TORCH
    path = demo_model_factory(family)
    g = torch.Generator().manual_seed(17)
    p = SamplingParams(max_new_tokens=16)
    a, d = (torch.randint(5, 200, (n,), generator=g).tolist() for n in (30, 150))
    tab = {"a": list(range(40, 50)), "d": list(range(39, -1, -1))}    # d's blocks in reverse: scattered
    steps = [
        [StepItem(1, a, 0, tab["a"], True, p, a), StepItem(4, d[:60], 0, tab["d"], False, p, d)],
        [StepItem(1, [7], 30, tab["a"], True, p, a + [7]),                # a decode row, then a chunk of 70
         StepItem(4, d[60:130], 60, tab["d"], False, p, d)],              # after 60 cached rows
        [StepItem(1, [9], 31, tab["a"], True, p, a + [7, 9]),             # ... and its last 20, sampling
         StepItem(4, d[130:], 130, tab["d"], True, p, d)],
        [StepItem(1, [5], 32, tab["a"], True, p, []), StepItem(4, [6], 150, tab["d"], True, p, [])],
    ]

    def runner(stack, attention=None):
        r = _runner(path, dtype, quantize, stack=stack, kv_tokens=256, kv_cache_dtype="int8" if kv_int8 else "auto")
        if attention is not None:
            r.attention = attention
        return r
    fast, slow, gathered = runner(True), runner(False), runner(False, TORCH)
    assert fast.model.decode_stack is not None and fast.model.decode_stack.prompts
    rowwise = fast.rowwise      # the runner's bounds (a stack taking prompts: rows only): neither chunk row by row
    assert rowwise == (ROWWISE_ROWS, 0) and ROWWISE_ROWS < 20
    # bf16's 8 bits; int8 activations (W8A8) and int8 KV rows re-round what the other attention's last bits moved
    tol = 3e-2 if dtype == "bf16" or quantize else 1e-3 if kv_int8 else 1e-5
    assert _same_as_python_layers(fast, slow, gathered, steps, rowwise, tol) == [True, True, True, True]


@needs_stack
def test_the_runner_packs_chunks_row_by_row_within_its_bounds(demo_model_factory):
    # Where prompts reach the C prompt kernel (the stack's, or the Python layers' without a stack) only
    # chunks of a few rows go row by row; where the stack takes no prompts (sliding windows) also those
    # attending to few keys in all (else the step would run the Python layers); off the CPU kernels none.
    from handler.model.runner import ROWWISE_KEYS, ROWWISE_ROWS
    from kernels.backends import TORCH
    path = demo_model_factory("llama")
    r, windowed, bare = _runner(path), _runner(path, window=6), _runner(path, stack=False)
    assert r.model.decode_stack.prompts and r.rowwise == (ROWWISE_ROWS, 0) == bare.rowwise
    assert not windowed.model.decode_stack.prompts and windowed.rowwise == (ROWWISE_ROWS, ROWWISE_KEYS)
    r.attention = TORCH
    assert r.rowwise == (0, 0)


def test_stack_order_puts_chunks_packed_as_sequences_after_rows():
    # A prompt's chunk after cached rows ranks as a prompt where pack_step keeps its sequence (past the
    # bounds), as decode rows where it goes row by row (within either); drafts are rows.
    from handler.engine.request import SamplingParams
    from handler.engine.types import StepItem
    from handler.model.runner import as_rows, stack_order
    p = SamplingParams(max_new_tokens=4)
    chunk = StepItem(4, list(range(10, 40)), 100, list(range(40)), True, p, [])     # 30 rows after 100
    dec = StepItem(1, [7], 20, [0, 1, 2, 3, 4, 5], True, p, [])
    whole = StepItem(2, list(range(10, 40)), 0, list(range(40, 50)), True, p, [])
    cost = 30 * 100 + 30 * 31 // 2
    for rows, keys, packed_as_rows in ((29, 0, False), (30, 0, True), (0, cost - 1, False), (16, cost, True)):
        assert as_rows(chunk, (rows, keys)) is packed_as_rows and not as_rows(dec, (rows, keys))
        assert not as_rows(whole, (rows, keys))         # a whole prompt keeps its sequence
        assert stack_order([chunk, dec], (rows, keys)) == (None if packed_as_rows else [1, 0])
        assert stack_order([dec, chunk], (rows, keys)) is None


def test_step_plan_reads_the_step_layout():
    # Decode rows first, then whole prompts: the C stack's inputs (the plan's `prompts`); anything
    # else: None there, and the decode rows' own inputs wherever they are.
    from kernels.step import plan_step
    bt = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)

    def plan(qsl, lens):
        t = qsl[-1]
        return plan_step(bt[:len(lens)], torch.tensor(lens), torch.tensor(qsl), 4, slot_mapping=torch.arange(t),
                         seq_lens_cpu=lens, query_start_loc_cpu=qsl)
    p = plan([0, 1, 2, 7], [6, 3, 5])
    tables, lens = p.stack_tables
    assert p.slots.dtype == torch.int64 and p.slots.tolist() == list(range(7))
    assert tables.dtype == torch.int32 and tables.tolist() == [[0, 1], [2, 3]] and lens.tolist() == [6, 3]
    assert p.prompts.tolist() == [[2], [5], [0]] and p.whole == [2] and p.partial == [] and not p.all_decode
    p = plan([0, 3, 8], [3, 5])                                 # prompts only, the longer one first in order
    assert p.stack_tables[0].shape[0] == 0 and p.prompts.tolist() == [[0, 3], [3, 5], [1, 0]]
    p = plan([0, 1, 2], [6, 3])                                 # decode only
    assert p.all_decode and p.stack_tables[0].shape[0] == 2 and p.prompts.shape == (3, 0)
    assert p.dec_tables.tolist() == [[0, 1], [2, 3]] and p.dec_rows.tolist() == [0, 1]
    p = plan([0, 3, 4], [3, 7])                                 # a decode row after a prompt
    assert p.prompts is None and p.dec == [1] and p.dec_rows.tolist() == [3] and p.dec_tables.tolist() == [[2, 3]]
    assert p.prompt_ctx is None and p.prompt_tables is None     # whole prompts: their own rows only
    p = plan([0, 1, 3], [6, 5])                 # a chunk of a longer prompt after a decode row: its 3 earlier
    assert p.partial == [1] and p.whole == [] and p.prompts.tolist() == [[1], [2], [0]]    # keys from the pool
    assert p.prompt_ctx.tolist() == [3] and p.prompt_tables.dtype == torch.int32
    assert p.prompt_tables.tolist() == [[2, 3]]
    p = plan([0, 2, 7, 8], [3, 9, 4])           # chunks of 2 (1 before) and 5 (4 before), then a decode row
    assert p.prompts is None and p.partial == [0, 1]
    p = plan([0, 2, 7], [3, 5])                 # a chunk (1 before) and a whole prompt, costliest first
    assert p.prompts.tolist() == [[0, 2], [2, 5], [1, 0]] and p.prompt_ctx.tolist() == [1, 0]
    assert p.prompt_tables.tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="3 query rows do not fit its context length 2"):
        plan([0, 3], [2])


# torch's vectors of the build's width (Sleef_expf16_u10 / Sleef_expf8_u10): what its SiLU must pair with
_TORCH_CAPABILITY = {"avx512": "avx512", "avx2": "avx2"}
_OTHER_BUILDS = [b for b in isa.host_isas() if b != BUILD]


def passed_on_build(build: str, test_file: str, select: str) -> tuple[set[str], str]:
    """Runs `test_file`'s tests matching `-k select` in a subprocess with LMI_CPU_KERNELS=build (and
    torch at the build's width); asserts the run passed and returns (the tests that passed, its output)."""
    env = dict(os.environ, LMI_CPU_KERNELS=build, HF_HUB_OFFLINE="1")
    env.pop("ATEN_CPU_CAPABILITY", None)
    if build in _TORCH_CAPABILITY:
        env["ATEN_CPU_CAPABILITY"] = _TORCH_CAPABILITY[build]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                        os.path.abspath(test_file), "-k", select],
                       env=env, cwd=root, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    return set(re.findall(r"^PASSED \S+::(\S+)", r.stdout, re.M)), out


@pytest.mark.parametrize("build", _OTHER_BUILDS or [None])
def test_stack_on_every_other_build_this_cpu_runs(build):
    # The tests above in a subprocess with LMI_CPU_KERNELS=build (and torch at the build's width):
    # they must pass, and the SiLU and fp32 stack tests must have run there, not skipped.
    if build is None:
        pytest.skip(f"this CPU runs no build but {BUILD} (of {', '.join(isa.ISAS)}), tested above")
    passed, out = passed_on_build(build, __file__, "not every_other_build and not stays_off and not step_layout")
    for want in ("test_silu_mul_rounds_as_torch[1-dtype0]", "test_silu_mul_rounds_as_torch[2-dtype1]",
                 "test_decode_stack_gives_the_python_layers_values_bit_for_bit[llama-fp32-None-None-None]",
                 "test_stack_takes_long_prompts_and_declines_chunks_and_prompts_before_decodes[llama-fp32]",
                 "test_decode_stack_gives_the_python_layers_values_bit_for_bit[qwen3-fp32-None-None-None]"):
        assert want in passed, f"{want} did not pass on the {build} build:\n{out[-4000:]}"
