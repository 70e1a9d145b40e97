"""CUDA graphs of the decode step (handler/model/cuda_graphs.py, option.enforce_eager).

On CPU: the sizes captured, the table width, which models may be captured (and why not), the
property, and that a CPU runner captures nothing. On CUDA: a replayed decode step against the
same step run eagerly (logits, and the KV pool: padding rows write nothing), and engines with
and without graphs against `model.generate`.
"""
from __future__ import annotations

import pytest
import torch

from handler.config import ConfigError
from handler.engine.request import SamplingParams
from handler.engine.types import StepItem
from handler.model import cuda_graphs
from handler.model.runner import pack_step
from tests.support.engine import NEW, PROMPTS, make_engine, run_all
from tests.support.reference import greedy_ids, model_on, near_tie_divergence

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("max_batch", [1, 2, 3, 7, 8, 9, 50, 64, 256])
def test_every_batch_runs_a_captured_size_with_little_padding(max_batch):
    sizes = cuda_graphs.graph_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
    for n in range(1, max_batch + 1):
        b = min(s for s in sizes if s >= n)
        assert b - n < 8, (n, b)


def test_graph_sizes_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="max_batch"):
        cuda_graphs.graph_sizes(0)


@pytest.mark.parametrize("max_len, bs, want", [(4096, 16, 256), (100, 16, 7), (131072, 16, 512), (8192, 32, 256)])
def test_table_width_covers_the_captured_context(max_len, bs, want):
    assert cuda_graphs.table_width(max_len, bs) == want


def _cpu_runner(model_dir, tmp_path, **props):
    from handler.config import load_config
    from handler.server import build_runner
    path = tmp_path / "serving.properties"
    path.write_text("\n".join(f"{k}={v}" for k, v in {"option.device": "cpu", **props}.items()) + "\n")
    return build_runner(load_config(str(path), model_dir, env={}))


def test_which_models_are_captured_and_why_not(demo_model_factory, tmp_path):
    from handler.model.runner import ModelRunner
    assert _cpu_runner(demo_model_factory("llama"), tmp_path).graphs is None   # CPU: nothing captured
    runner = ModelRunner(demo_model_factory("llama"), device="cpu", dtype="fp32", kv_cache_tokens=256)
    model = runner.model                 # not packed for the CPU: plain linear layers, as on CUDA
    assert runner.own
    assert cuda_graphs.eligible(model, CUDA, own=True, tp=False, lora=False) is None
    assert cuda_graphs.eligible(model, torch.device("cpu"), own=True, tp=False, lora=False) == "not on CUDA"
    assert "transformers" in cuda_graphs.eligible(model, CUDA, own=False, tp=False, lora=False)
    assert "tensor parallel" in cuda_graphs.eligible(model, CUDA, own=True, tp=True, lora=False)
    assert "LoRA" in cuda_graphs.eligible(model, CUDA, own=True, tp=False, lora=True)
    attn = model.model.layers[1].self_attn
    attn.window = 64
    assert "sliding-window" in cuda_graphs.eligible(model, CUDA, own=True, tp=False, lora=False)
    attn.window = None
    kind = model.rotary.kind
    model.rotary.kind = "dynamic"
    assert "grows" in cuda_graphs.eligible(model, CUDA, own=True, tp=False, lora=False)
    model.rotary.kind = kind


def test_a_quantized_layer_is_not_captured(demo_model_factory, tmp_path):
    runner = _cpu_runner(demo_model_factory("llama"), tmp_path, **{"option.quantize": "int8"})
    why = cuda_graphs.eligible(runner.model, CUDA, own=True, tp=False, lora=False)
    assert why is not None and "quantized" in why, why


def test_enforce_eager_property(demo_model_dir, tmp_path):
    from handler.config import load_config
    path = tmp_path / "serving.properties"
    path.write_text("option.rolling_batch=lmi-dist\n")
    assert load_config(str(path), demo_model_dir, env={}).enforce_eager is False
    path.write_text("option.enforce_eager=true\n")
    assert load_config(str(path), demo_model_dir, env={}).enforce_eager is True
    path.write_text("option.enforce_eager=sometimes\n")
    with pytest.raises(ConfigError, match="option.enforce_eager"):
        load_config(str(path), demo_model_dir, env={})


class _Recorder:
    """Stands in for DecodeGraphs on CPU: records what the runner hands a replay."""
    def __init__(self, max_batch=16, width=8):
        self.max_batch, self.width, self.calls = max_batch, width, []

    def fits(self, n_seq, width):
        return n_seq <= self.max_batch and width <= self.width

    def run(self, ids, pos, slots, seq_lens, tables):
        self.calls.append((ids.tolist(), pos.tolist(), slots.tolist(), seq_lens.tolist(), tables.tolist()))
        return torch.zeros(len(ids), 7)


def test_only_decode_steps_that_fit_go_to_the_graphs(demo_model_dir):
    from handler.model.runner import ModelRunner
    runner = ModelRunner(demo_model_dir, device="cpu", dtype="fp32", kv_cache_tokens=2048)
    rec = runner.graphs = _Recorder()
    bs, lens = runner.block_size, [5, 37, 18]
    prefill, _ = pack_step(_items(lens, bs, decode=False), bs)
    assert runner.forward(prefill).shape[0] == 3 and rec.calls == []       # prompts: eager
    items = _items(lens, bs, decode=True)
    decode, _ = pack_step(items, bs)
    assert tuple(runner.forward(decode).shape) == (3, 7)
    ids, pos, slots, seq_lens, tables = rec.calls[-1]
    assert ids == [it.token_ids[0] for it in items] and pos == lens and seq_lens == [n + 1 for n in lens]
    assert slots == [it.block_table[n // bs] * bs + n % bs for it, n in zip(items, lens)]
    assert [row[:len(it.block_table)] for row, it in zip(tables, items)] == [it.block_table for it in items]
    # A mixed step (a prompt chunk beside decode rows), a table wider than captured, and
    # batch-invariant mode all run eagerly.
    mixed, _ = pack_step(items[:2] + _items([9], bs, decode=False, seed=1), bs)
    wide, _ = pack_step(_items([5, 200], bs, decode=True), bs)
    for packed in (mixed, wide):
        runner.forward(packed)
    runner.batch_invariant = True
    runner.forward(decode)
    assert len(rec.calls) == 1


# ---------------------------------------------------------------------------- CUDA
def _cuda_runner(model_dir, tmp_path, dtype, eager=False):
    path = tmp_path / f"{dtype}-{eager}.properties"
    # rolling: the running limit (16) is the largest graph (without a strategy the limit is 1)
    path.write_text(f"option.rolling_batch=lmi-dist\noption.device=cuda\noption.dtype={dtype}\n"
                    f"option.max_rolling_batch_size=16\n"
                    f"option.kv_cache_tokens=2048\noption.enforce_eager={str(eager).lower()}\n")
    from handler.config import load_config
    from handler.server import build_runner
    return build_runner(load_config(str(path), model_dir, env={}))


def _items(lens, bs, decode: bool, seed=0):
    """Sequences of the given lengths with blocks dealt out of order: the prompt (decode=False)
    or one more token each (decode=True)."""
    g = torch.Generator().manual_seed(seed)
    items, next_block = [], 0
    perm = torch.randperm(64, generator=g).tolist()
    for k, n in enumerate(lens):
        nblk = -(-(n + 1) // bs)
        table = perm[next_block:next_block + nblk]
        next_block += nblk
        prompt = torch.randint(3, 200, (n + 1,), generator=g).tolist()
        toks, start = (prompt[n:], n) if decode else (prompt[:n], 0)
        items.append(StepItem(seq_id=k, token_ids=toks, start_pos=start, block_table=table, sample=True,
                              params=SamplingParams(max_new_tokens=4), history=prompt[:start + len(toks)]))
    return items


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_replayed_decode_step_equals_the_eager_step(dtype, tol, demo_model_factory, tmp_path):
    runner = _cuda_runner(demo_model_factory("llama"), tmp_path, dtype)
    graphs = runner.graphs
    assert graphs is not None, "the runner captured no graph on CUDA"
    lens = [5, 37, 18]                  # 3 sequences: the size-4 graph, one padding row
    bs = runner.block_size
    prefill, _ = pack_step(_items(lens, bs, decode=False), bs)
    runner.forward(prefill)             # eager (several tokens per sequence): fills the KV pool
    decode, _ = pack_step(_items(lens, bs, decode=True), bs)
    before = [(k.data.clone(), v.data.clone()) for k, v in runner.kv_cache]
    replays = graphs.replays
    got = runner.forward(decode).clone()
    assert graphs.replays == replays + 1, "the decode step did not replay a graph"
    after_graph = [(k.data.clone(), v.data.clone()) for k, v in runner.kv_cache]
    for (k, v), (k0, v0) in zip(runner.kv_cache, before):   # back to the pre-step pool
        k.data.copy_(k0)
        v.data.copy_(v0)
    runner.graphs = None
    want = runner.forward(decode)
    runner.graphs = graphs
    assert got.shape == want.shape == (len(lens), runner.model.lm_head.out_features)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err <= tol, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The pool changed only at the three slots written (the padding row's slot is -1).
    written = {it.block_table[it.start_pos // bs] * bs + it.start_pos % bs for it in _items(lens, bs, True)}
    for (kg, vg), (k0, v0), (ke, ve) in zip(after_graph, before, [(k.data, v.data) for k, v in runner.kv_cache]):
        for pool, base, eager in ((kg, k0, ke), (vg, v0, ve)):
            flat, flat0, flate = (t.reshape(-1, *t.shape[2:]) for t in (pool, base, eager))
            changed = {int(i) for i in (flat != flat0).flatten(1).any(1).nonzero().flatten()}
            assert changed <= written, changed - written
            for s in written:
                assert torch.allclose(flat[s].float(), flate[s].float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_with_graphs_answers_like_generate(family, demo_model_factory, tmp_path):
    model_dir = demo_model_factory(family)
    props = {"option.rolling_batch": "lmi-dist", "option.device": "cuda", "option.dtype": "bf16",
             "option.max_rolling_batch_size": "8"}
    engine = make_engine(model_dir, tmp_path, props)
    try:
        graphs = engine.runner.graphs
        assert graphs is not None
        results = run_all(engine, PROMPTS, [SamplingParams(max_new_tokens=n) for n in NEW])
        assert graphs.replays > 0
    finally:
        engine.shutdown()
    tok, model = model_on(model_dir, "cuda", torch.bfloat16)
    exact = 0
    for p, n, (got, _) in zip(PROMPTS, NEW, results):
        ids = tok(p)["input_ids"]
        want = greedy_ids(model, tok, ids, n)
        why = near_tie_divergence(model, ids, want, got, 0.1)
        assert why is None, (p[:30], why)
        exact += got == want
    assert exact >= len(PROMPTS) // 2
