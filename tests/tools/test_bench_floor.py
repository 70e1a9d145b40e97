"""The decode-bound view (handler/tools/bench/floor.py) and the Qwen presets (workloads.py)."""
from __future__ import annotations

import torch
from torch import nn

from handler.model.cpu import PanelPack
from handler.model.linear import CpuLinear
from handler.tools.bench import floor
from handler.tools.bench.compare import curve_requests
from handler.tools.bench.workloads import PRESETS


class _Tiny(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 100, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_step_bytes_leave_out_the_gathered_table_unless_the_head_reads_it():
    untied = floor.step_bytes(_Tiny(tied=False))
    assert untied == {"weight_bytes_per_step": (100 * 8 + 8 + 8) * 4, "embedding_table_bytes": 100 * 8 * 4}
    tied = floor.step_bytes(_Tiny(tied=True))           # the head multiplies by the table itself
    assert tied == {"weight_bytes_per_step": (100 * 8 + 8 + 8) * 4, "embedding_table_bytes": 0}
    m = _Tiny(tied=False)
    m.head = CpuLinear(m.head, PanelPack(torch.zeros(100 * 8, dtype=torch.float32), False), keep_weight=True)
    # a packed copy is what the GEMM reads
    assert floor.step_bytes(m)["weight_bytes_per_step"] == (2 * 100 * 8 + 16) * 4


def test_tpot_at_one_client_against_the_floor():
    results = {"curve": {"paged": [{"clients": 1, "tpot_p50": 0.05}, {"clients": 4, "tpot_p50": 0.09}],
                         "llamacpp": [{"clients": 4, "tpot_p50": 0.07}]}}
    assert floor.tpot_vs_floor(results, {"*": 40.0}) == [
        {"server": "paged", "tpot_p50_ms": 50.0, "floor_ms": 40.0, "x_floor": 1.25}]


def test_copy_probe_measures_a_positive_rate():
    bw = floor.copy_bandwidth(mib=8, reps=2)
    assert bw["bytes"] == 8 * 2 ** 20 and bw["copy_gbps"] > 0


def test_qwen_presets_run_the_load_curve_with_prefixes_of_one_list():
    for name in ("cpu-qwen-0.5b", "cpu-qwen-1.5b"):
        p = PRESETS[name]
        assert p.clients == (1, 4, 16, 50) and p.one_at_a_time and p.model.startswith("qwen2.5-coder-")
        (w,) = p.workloads
        points = [curve_requests(w, c) for c in p.clients]
        assert points[-1] == w.requests and all(0 < n <= w.requests for n in points)


def test_read_probe_reads_every_element_and_measures_a_rate():
    import pytest
    from kernels import cpu as cpu_ext
    x = torch.arange(1000 * 64 + 7, dtype=torch.float32) % 5       # a tail past the 64 lanes and the threads' cuts
    got = cpu_ext.stream_read(x)
    if got is None:
        pytest.skip("the C kernels do not load here (no compiler or no kernel build for this CPU): no read probe")
    assert got == pytest.approx(float(x.double().sum()), rel=1e-6)
    for ahead in floor.AHEADS:      # a look-ahead past the end prefetches nothing it should not
        assert cpu_ext.stream_read(x, ahead) == pytest.approx(float(x.double().sum()), rel=1e-6)
    assert torch.equal(x, torch.arange(1000 * 64 + 7, dtype=torch.float32) % 5)      # read only
    assert floor.read_bandwidth(mib=8, reps=2) > 0


def test_probes_read_memory_placed_as_the_weights_are():
    # The probe buffers come from the weights' allocator: where huge pages are advised for packed
    # weights, they are for the probe too (a 4 KiB-page probe put the floor above served TPOTs).
    from kernels.cpu import memory
    buf = floor._probe_buffer(8)
    assert buf.dtype == torch.float32 and buf.numel() == 8 * 2 ** 20 // 4 and bool((buf == 1).all())
    placed = memory.hugepage_placement([buf])
    if memory.hugepages_wanted():
        assert placed["advised_bytes"] == 8 * 2 ** 20
    else:
        assert placed["advised_bytes"] == 0


def test_weights_read_streams_the_served_tensors_where_they_lie():
    import pytest
    from kernels import cpu as cpu_ext
    m = _Tiny(tied=False)
    panels = torch.zeros(100 * 8 + 1, dtype=torch.float32)
    m.head = CpuLinear(m.head, PanelPack(panels, False), keep_weight=True)
    m.norm.register_buffer("codes", torch.zeros(4 * 1000 + 3, dtype=torch.uint8))   # a 3-byte tail the probe skips
    read, table = floor.step_tensors(m)
    assert table == 100 * 8 * 4 and any(t is panels for t in read) and all(t is not m.embed.weight for t in read)
    got = floor.weights_read(read, reps=2)
    if cpu_ext.load() is None:
        assert got is None
        pytest.skip("the C kernels do not load here: no read probe")
    want = sum(t.numel() * t.element_size() // 4 * 4 for t in read)
    assert got["bytes"] == want and got["ms"] > 0


def test_a_mixture_of_experts_reads_the_router_and_its_top_k_experts_a_token():
    # hidden 64, 8 experts of width 32, top-2: a one-row step reads the router and 2 experts'
    # packed panels (gate|up: 64 columns x 64 inputs; down: 64 columns x 32 inputs), not the other 6
    from handler.model import layers, moe
    from handler.model.cpu import prepack_linears

    class _TinyMoe(_Tiny):
        def __init__(self):
            super().__init__(tied=False)
            spec = moe.MoeSpec(experts=8, top_k=2, intermediate=32, norm_topk=True, fp32_weights=False, shared=0,
                               sparse=(True,))
            self.mlp = moe.SparseMoe(8 * 8, spec, layers.TensorParallel(), torch.float32, "cpu")
            self.mlp.fuse()

    m = _TinyMoe()
    prepack_linears(m.mlp)
    router, expert = 8 * 64 * 4, (64 * 64 + 64 * 32) * 4
    got = floor.step_bytes(m)
    assert got["weight_bytes_per_step"] == (100 * 8 + 8 + 8) * 4 + router + 2 * expert
    assert floor.held_bytes(m) == (2 * 100 * 8 + 8 + 8) * 4 + router + 8 * expert
    read, _ = floor.step_tensors(m)
    assert {id(t) for t in m.mlp.experts[5].down_proj.pack.held()}.isdisjoint(id(t) for t in read)
