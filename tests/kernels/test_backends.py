"""kernels/backends.py on any host: which backend a device gets, and where each backend sends a
layer's attention. The Triton backend's routing is checked on CPU tensors with a stand-in for
kernels/triton_kernels.py that records its calls and answers with the torch math's values (the
Triton kernels themselves: tests/kernels/test_kernels.py and tests/model/test_gpu.py, on CUDA)."""
from __future__ import annotations

import random
import sys
import types

import pytest
import torch

import kernels
from kernels import torch_paged
from kernels.selfcheck import make_case
from tests.support.kernels import naive_attention, rel_err


def _step(case, slots=None, plan=True):
    lens, qsl = case["seq_lens"].tolist(), case["query_start_loc"].tolist()
    return kernels.Step(slot_mapping=slots, block_tables=case["block_tables"], seq_lens=case["seq_lens"],
                        query_start_loc=case["query_start_loc"], seq_lens_cpu=lens, query_start_loc_cpu=qsl,
                        plan=kernels.plan_step(case["block_tables"], case["seq_lens"], case["query_start_loc"],
                                               case["key_cache"].shape[1], rows=qsl[-1], seq_lens_cpu=lens,
                                               query_start_loc_cpu=qsl) if plan else None)


def _fake_triton(monkeypatch) -> list:
    calls = []
    fake = types.ModuleType("kernels.triton_kernels")

    def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
        calls.append("attention")
        return torch_paged.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                           scale)

    def write_kv(key_cache, value_cache, key, value, slots):
        calls.append("write")
        torch_paged.write_kv(key_cache, value_cache, key, value, slots)
    fake.paged_attention, fake.write_kv = paged_attention, write_kv
    monkeypatch.setitem(sys.modules, "kernels.triton_kernels", fake)
    monkeypatch.setattr(kernels, "triton_kernels", fake, raising=False)
    return calls


def test_triton_backend_sends_windows_and_soft_caps_to_the_torch_math(monkeypatch):
    calls = _fake_triton(monkeypatch)
    tri = kernels.TritonAttention()
    assert not tri.needs_plan
    case = make_case(random.Random(3), num_seqs=4, block_size=4, hkv=2, group=2, head_dim=16,
                     dtype=torch.float32, max_ctx=30)
    got = tri.attend(case["query"], case["key_cache"], case["value_cache"], _step(case, plan=False), case["scale"])
    assert calls == ["attention"] and rel_err(got, naive_attention(**case)) <= 1e-5
    for options in ({"sliding_window": 3}, {"soft_cap": 2.0}):
        calls.clear()
        got = tri.attend(case["query"], case["key_cache"], case["value_cache"], _step(case), case["scale"],
                         options.get("sliding_window"), options.get("soft_cap"))
        assert calls == [] and rel_err(got, naive_attention(**case, **options)) <= 1e-5
    # ... and a step without a plan (the runner builds none on CUDA for a model without windows)
    got = tri.attend(case["query"], case["key_cache"], case["value_cache"], _step(case, plan=False), case["scale"], 3)
    assert calls == [] and rel_err(got, naive_attention(**case, sliding_window=3)) <= 1e-5


def test_triton_backend_forward_rotates_writes_and_attends(monkeypatch):
    # transformers' formula for rotary, the KV rows through triton's write, then its attention:
    # the torch backend's values over the same inputs.
    calls = _fake_triton(monkeypatch)
    case = make_case(random.Random(4), num_seqs=3, block_size=4, hkv=1, group=2, head_dim=16,
                     dtype=torch.float32, max_ctx=20, decode_only=True)
    b, h, d = case["query"].shape
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g)
    ang = torch.rand(b, d // 2, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    bs = case["key_cache"].shape[1]
    tables, lens = case["block_tables"].tolist(), case["seq_lens"].tolist()
    slots = torch.tensor([tables[s][(n - 1) // bs] * bs + (n - 1) % bs for s, n in enumerate(lens)])
    pools = (case["key_cache"].clone(), case["value_cache"].clone())
    got = kernels.TritonAttention().forward(case["query"].clone(), k.clone(), v.clone(), *pools, _step(case, slots),
                                            case["scale"], cos=cos, sin=sin)
    assert calls == ["write", "attention"]
    want = kernels.TorchAttention().forward(case["query"].clone(), k.clone(), v.clone(), case["key_cache"],
                                            case["value_cache"], _step(case, slots), case["scale"], cos=cos, sin=sin)
    assert torch.equal(pools[0], case["key_cache"]) and torch.equal(pools[1], case["value_cache"])
    assert torch.equal(got, want)


def test_a_device_gets_its_backend():
    from kernels import cpu as cpu_ext
    cpu = kernels.backend_for("cpu")
    if cpu_ext.load() is None:
        assert type(cpu) is kernels.TorchAttention
    else:
        assert type(cpu) is kernels.CpuAttention and cpu.name == cpu_ext.current()[0]
    assert kernels.backend_for("meta") is kernels.backends.TORCH     # any other device: plain torch



def test_cpu_backend_says_once_when_a_call_runs_in_torch(caplog):
    # fp16 rows: no C kernel reads them; the torch math answers and the log says so, once per op and kinds.
    from kernels import cpu as cpu_ext
    if cpu_ext.load() is None:
        pytest.skip("no C kernel build on this host: the CPU backend is not chosen")
    cpu = kernels.CpuAttention(cpu_ext.current()[0])
    case = make_case(random.Random(8), num_seqs=2, block_size=4, hkv=1, group=2, head_dim=16,
                     dtype=torch.float16, max_ctx=12, decode_only=True)
    q, k = case["query"].clone(), torch.randn(2, 1, 16, dtype=torch.float16)
    cos, sin = torch.ones(2, 16, dtype=torch.float16), torch.zeros(2, 16, dtype=torch.float16)
    with caplog.at_level("WARNING", logger="kernels.backends"):
        for _ in range(3):
            got_q, got_k = cpu.rotate(q, k, cos, sin)
            got = cpu.attend(case["query"], case["key_cache"], case["value_cache"], _step(case), case["scale"])
    assert torch.equal(got_q, q) and torch.equal(got_k, k)      # cos 1, sin 0: the identity
    assert rel_err(got, naive_attention(**case)) <= 2e-3
    said = [r.getMessage() for r in caplog.records]
    assert sum("rotary in torch" in m for m in said) == 1, said
    assert sum("decode attention in torch" in m and "torch.float16" in m for m in said) == 1, said


@pytest.mark.parametrize("window", [None, 5])
def test_blocks_attend_both_ways_as_transformers_blockwise_masks(window, monkeypatch):
    """Step.blocks (Gemma 3's image runs at prefill): every backend's attention equals attention under
    transformers' own mask functions (masking_utils: OR(causal, blockwise_overlay) on full layers,
    AND(that, sliding_window_overlay) on sliding ones), for whole prompts and for chunks whose run began
    before them (a prefix-cache hit inside a run); rows outside the runs stay causal."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_overlay)
    case = make_case(random.Random(11), num_seqs=6, block_size=4, hkv=2, group=2, head_dim=16,
                     dtype=torch.float32, max_ctx=30)
    lens, qsl = case["seq_lens"].tolist(), case["query_start_loc"].tolist()
    blocks = {}
    for s, ctx in enumerate(lens):
        n = qsl[s + 1] - qsl[s]
        if n >= 4:      # a run from before the chunk (or its first row) to inside it, and one at its end
            blocks[s] = [(max(0, ctx - n - 2), ctx - n + 2), (ctx - 2, ctx)]
    # whole prompts (the C prompt kernel's, else) and chunks after cached rows both hold runs
    assert {qsl[s + 1] - qsl[s] == lens[s] for s in blocks} == {True, False}
    step = _step(case)
    step.blocks = blocks
    want = torch.empty_like(case["query"])
    bs = case["key_cache"].shape[1]
    for s, ctx in enumerate(lens):
        a, b = qsl[s], qsl[s + 1]
        tbl = case["block_tables"][s].long()
        k = torch.cat([case["key_cache"][tbl[i]] for i in range(-(-ctx // bs))])[:ctx].double()   # [L, Hkv, D]
        v = torch.cat([case["value_cache"][tbl[i]] for i in range(-(-ctx // bs))])[:ctx].double()
        ids = torch.full((1, ctx), -1)
        for g, (lo, hi) in enumerate(blocks.get(s, ())):
            ids[0, lo:hi] = g
        fn = or_masks(causal_mask_function, blockwise_overlay(ids))
        if window is not None:
            fn = and_masks(fn, sliding_window_overlay(window))
        qpos = torch.arange(ctx - (b - a), ctx)
        zero = torch.tensor(0)
        mask = fn(zero, zero, qpos[:, None], torch.arange(ctx)[None, :]).expand(len(qpos), ctx)   # [n, L]
        q = case["query"][a:b].double().view(b - a, 2, 2, -1)          # [n, Hkv, g, D]
        scores = torch.einsum("nhgd,lhd->hgnl", q, k) * case["scale"]
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
        want[a:b] = torch.einsum("hgnl,lhd->nhgd", p, v).reshape(b - a, 4, -1).float()
    calls = _fake_triton(monkeypatch)       # Triton: a step with blocks goes to the torch math
    for backend in (kernels.TorchAttention(), kernels.backend_for("cpu"), kernels.TritonAttention()):
        got = backend.attend(case["query"], case["key_cache"], case["value_cache"], step, case["scale"], window)
        assert rel_err(got, want) <= 1e-5, backend.name
    assert calls == []
    # the same step without blocks: causal, so the rows in runs differ
    step.blocks = None
    got = kernels.TorchAttention().attend(case["query"], case["key_cache"], case["value_cache"], step, case["scale"],
                                          window)
    assert rel_err(got, want) > 1e-3
