"""The engine in-process (no HTTP): greedy parity for three model families and every strategy,
seeded sampling across batch neighbours, preemption, prefix caching, cancellation, queue limits."""
from __future__ import annotations

import pytest

from handler.engine.loop import ErrorEvent
from handler.engine.request import SamplingParams
from handler.engine.scheduler import QueueFull
from tests.support.reference import hf_greedy
from tests.support.engine import (NEW, PROMPTS, STRATEGIES, _drained, assert_drained, driven_by_hand,
                                  make_engine, run_all)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_parity_every_family_and_strategy(family, strategy, demo_model_factory, tmp_path):
    model_dir = demo_model_factory(family)
    engine = make_engine(model_dir, tmp_path, STRATEGIES[strategy])
    try:
        results = run_all(engine, PROMPTS, [SamplingParams(max_new_tokens=n) for n in NEW])
        for p, n, (ids, done) in zip(PROMPTS, NEW, results):
            assert ids == hf_greedy(model_dir, p, n), (family, strategy, p[:20])
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_seeded_sampling_is_independent_of_batch_neighbours(demo_model_dir, tmp_path):
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["rolling"])
    try:
        seeded = SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=50,
                                top_p=0.95, seed=1234)
        alone = run_all(engine, [PROMPTS[0]], [seeded])[0][0]
        noise = SamplingParams(max_new_tokens=24, do_sample=True, temperature=1.3)
        crowd = run_all(engine, [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0]],
                        [noise, seeded, noise, SamplingParams(max_new_tokens=16, do_sample=True, seed=99)])
        assert crowd[1][0] == alone
        assert crowd[3][0] != alone        # another seed gives other tokens
    finally:
        engine.shutdown()


def test_preemption_under_tiny_kv_completes_everything_identically(demo_model_dir, tmp_path):
    props = {**STRATEGIES["paged"], "option.kv_cache_tokens": "96", "option.block_size": "4",
             "option.max_rolling_batch_size": "8"}
    engine = make_engine(demo_model_dir, tmp_path, props)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)][:60] for i in range(10)]
        news = [30 + 3 * i for i in range(10)]
        results = run_all(engine, prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                            for n in news])
        assert engine.scheduler.stats["preemptions"] > 0
        for p, n, (ids, done) in zip(prompts, news, results):
            assert len(ids) == n
            want = hf_greedy(demo_model_dir, p, n)
            assert ids[:len(want)] == want
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_prefix_cache_computes_fewer_prefill_tokens_with_same_outputs(demo_model_dir, tmp_path):
    system = "You are a helpful assistant. Answer in Python.\n" * 6
    prompts = [system + q for q in ("def add(a, b):", "class Stack:", "import re\n")]
    outputs = {}
    for caching in ("false", "true"):
        props = {**STRATEGIES["paged"], "option.kv_cache_tokens": "2048",
                 "option.enable_prefix_caching": caching, "option.max_rolling_batch_prefill_tokens": "4096"}
        engine = make_engine(demo_model_dir, tmp_path, props)
        try:
            res = []
            for p in prompts:      # one after another, so later ones can hit the cache
                res += run_all(engine, [p], [SamplingParams(max_new_tokens=8)])
            outputs[caching] = ([ids for ids, _ in res], engine.scheduler.stats["prefill_tokens"],
                                engine.scheduler.stats["cached_prompt_tokens"])
        finally:
            engine.shutdown()
    (ids_off, prefill_off, cached_off), (ids_on, prefill_on, cached_on) = outputs["false"], outputs["true"]
    assert ids_on == ids_off
    assert cached_off == 0 and cached_on > 0
    assert prefill_on == prefill_off - cached_on


def test_abort_frees_blocks_and_queue_full_is_refused(demo_model_dir, tmp_path):
    props = {**STRATEGIES["rolling"], "option.max_rolling_batch_size": "1", "job_queue_size": "2"}
    engine = make_engine(demo_model_dir, tmp_path, props)
    try:
        long = SamplingParams(max_new_tokens=200, ignore_eos=True)
        first = engine.submit([engine.tokenize("a")], long)[0]
        first.events.get(timeout=60)                  # running
        queued = engine.submit([engine.tokenize("b")], long) + engine.submit([engine.tokenize("c")], long)
        with pytest.raises(QueueFull):
            engine.submit([engine.tokenize("d")], long)
        assert engine.counters["rejected_queue_full"] == 1
        for ch in [first] + queued:
            engine.abort(ch.seq_id)
        assert_drained(engine)
        assert engine.counters["aborted"] >= 3
    finally:
        engine.shutdown()


def _tiny(cls, **kw):
    return lambda ids: getattr(__import__("transformers"), cls)(
        num_hidden_layers=2, num_attention_heads=4, **kw, **ids)


FEATURE_CONFIGS = {
    # more families, each routed through the AttentionInterface (small, 2 layers)
    "phi3": _tiny("Phi3Config", hidden_size=64, intermediate_size=128, num_key_value_heads=2),
    "qwen3": _tiny("Qwen3Config", hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16),
    "gemma": _tiny("GemmaConfig", hidden_size=64, intermediate_size=128, num_key_value_heads=1, head_dim=16),
    "gpt_neox": _tiny("GPTNeoXConfig", hidden_size=64, intermediate_size=128),
    "opt": _tiny("OPTConfig", hidden_size=64, ffn_dim=128, word_embed_proj_dim=64),
    "phi": _tiny("PhiConfig", hidden_size=64, intermediate_size=128),
    # a short sliding window (Mistral) and logit soft-capping + alternating sliding layers (Gemma 2),
    # with weights large enough that both change the outputs
    "mistral-sliding-window": lambda ids: __import__("transformers").MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=5, initializer_range=0.3, **ids),
    "gemma2-softcap": lambda ids: __import__("transformers").Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, attn_logit_softcapping=0.5, sliding_window=6,
        query_pre_attn_scalar=16, initializer_range=0.1, **ids),
}


@pytest.mark.parametrize("name", list(FEATURE_CONFIGS))
def test_parity_for_more_families_sliding_window_and_softcap(name, demo_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model_dir = str(tmp_path / name)
    AutoModelForCausalLM.from_config(FEATURE_CONFIGS[name](ids)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    engine = make_engine(model_dir, tmp_path, STRATEGIES["paged"])
    try:
        results = run_all(engine, PROMPTS[:4], [SamplingParams(max_new_tokens=n) for n in NEW[:4]])
        for p, n, (got, _) in zip(PROMPTS, NEW, results):
            assert got == hf_greedy(model_dir, p, n), (name, p[:20])
    finally:
        engine.shutdown()


def test_architecture_without_attention_interface_is_refused_clearly(demo_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, FalconConfig

    from handler.model.runner import ModelLoadError

    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    model_dir = str(tmp_path / "falcon")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(FalconConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        new_decoder_architecture=False, multi_query=True)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    with pytest.raises(ModelLoadError, match="AttentionInterface"):
        make_engine(model_dir, tmp_path, STRATEGIES["paged"])


def test_a_whole_answer_reader_is_woken_once_per_sequence_in_order(demo_model_dir, tmp_path):
    """stream=False (a non-streaming request): the channel's token events stay with the engine
    until the sequence's last one, then arrive together, in order, equal to a streamed copy's;
    an error ends such a channel with its held tokens first."""
    engine = driven_by_hand(make_engine(demo_model_dir, tmp_path, {"option.rolling_batch": "auto",
                                                                   "option.paged_attention": "true"}))
    ids = engine.tokenize(PROMPTS[0])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    streamed = engine.submit([ids], params)[0]
    whole = engine.submit([ids], params, stream=False)[0]
    seen, sizes = [], []
    while engine.scheduler.has_work or engine._intake:
        engine.step()
        seen += _drained(streamed.events)
        sizes.append(whole.events.qsize())
    got = _drained(whole.events)
    assert len(seen) == params.max_new_tokens and seen[-1].done is not None
    assert sizes[-1] == len(seen) and set(sizes[:-1]) == {0}   # nothing until the last token
    assert [(e.id, e.text, e.log_prob) for e in got] == [(e.id, e.text, e.log_prob) for e in seen]

    held = engine.submit([ids], params, stream=False)[0]
    while held.events.empty() and len(held.held) < 2:
        engine.step()
    n = len(held.held)
    engine.reset(ErrorEvent(500, "boom"))
    out = _drained(held.events)
    assert len(out) == n + 1 and all(e.done is None for e in out[:-1])
    assert isinstance(out[-1], ErrorEvent) and out[-1].message == "boom"


def test_a_started_engine_leaves_the_loaded_model_out_of_garbage_collection(demo_model_dir, tmp_path):
    # What is loaded before the engine starts lives as long as the server: frozen (gc.freeze), so
    # a full collection does not walk it at every few hundred allocations of the serving loop.
    import gc
    gc.unfreeze()
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        assert gc.get_freeze_count() > 10_000
        assert not any(o is engine.runner.model for o in gc.get_objects())    # frozen: not tracked for collection
    finally:
        engine.shutdown()
        gc.unfreeze()


def test_string_work_runs_on_the_output_thread_and_a_stop_string_ends_the_sequence(demo_model_dir, tmp_path):
    """The engine thread emits token ids only: every decode (text, stop strings, top tokens,
    prefill text) runs on the output thread; a stop string found there ends the sequence in the
    engine, whose text stops at it."""
    import threading

    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        tok = engine.tokenizer
        threads = set()

        class Watched:                      # the tokenizer, noting which thread decodes
            def __getattr__(self, name):
                return getattr(tok, name)

            def decode(self, *a, **kw):
                threads.add(threading.current_thread().name)
                return tok.decode(*a, **kw)
        engine.output.tokenizer = Watched()
        ids = engine.tokenize(PROMPTS[0])
        text = tok.decode(hf_greedy(demo_model_dir, PROMPTS[0], 40), skip_special_tokens=True)
        stop = text[len(text) // 3:len(text) // 3 + 3]
        params = SamplingParams(max_new_tokens=40, stop_sequences=(stop,), top_n_tokens=2,
                                decoder_input_details=True)
        ch = engine.submit([ids], params)[0]
        evs = []
        while not evs or not (isinstance(evs[-1], ErrorEvent) or evs[-1].done):
            evs.append(ch.events.get(timeout=300))
        done = evs[-1].done
        assert done.finish_reason == "stop_sequence" and done.generated_text.endswith(stop)
        assert done.generated_text == text[:text.index(stop) + len(stop)]
        assert done.generated_tokens == len(evs) < 40 and len(done.prefill) == len(ids)
        assert threads == {"lmi-output"}
        assert_drained(engine)          # the engine ended it: its blocks are free
        assert engine.counters["finished"] == 1 and engine.counters["aborted"] == 0
    finally:
        engine.shutdown()
