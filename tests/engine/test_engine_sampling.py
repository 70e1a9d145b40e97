"""The engine's sampling surface against HF oracles: prompt log-probs (decoder_input_details),
top-n alternatives, n/best_of samples (forked KV on paged), sampler warpers and penalties, and
per-request isolation of sampling failures."""
from __future__ import annotations

import pytest
import torch

from handler.engine.loop import ErrorEvent
from handler.engine.request import SamplingParams
from tests.support.reference import _load, hf_greedy
from tests.support.engine import PROMPTS, STRATEGIES, assert_drained, make_engine
from tests.support.server import assert_eventually


def events(ch, timeout=300):
    out = []
    while True:
        ev = ch.events.get(timeout=timeout)
        out.append(ev)
        if isinstance(ev, ErrorEvent) or ev.done:
            return out


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of `ids` (one plain forward, no cache)."""
    _, model = _load(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("strategy,extra", [
    ("paged", {"option.max_rolling_batch_prefill_tokens": "7", "option.enable_prefix_caching": "true"}),
    ("rolling", {}),
    ("none", {}),
])
def test_prompt_logprobs_match_hf_over_chunks_and_prefix_cache(strategy, extra, demo_model_dir, tmp_path):
    engine = make_engine(demo_model_dir, tmp_path, {**STRATEGIES[strategy], **extra})
    try:
        prompt = PROMPTS[2]            # longer than several 7-token chunks and 8-token blocks
        ids = engine.tokenize(prompt)
        # A first request fills the prefix cache; the second must still compute every position.
        events(engine.submit([ids], SamplingParams(max_new_tokens=2))[0])
        evs = events(engine.submit([ids], SamplingParams(max_new_tokens=3, decoder_input_details=True))[0])
        prefill = evs[-1].done.prefill
        assert [t for t, _, _ in prefill] == ids and prefill[0][2] is None
        ref = hf_logprobs(demo_model_dir, ids)
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert [lp for _, _, lp in prefill[1:]] == pytest.approx(want, abs=1e-4)
        tok = engine.tokenizer
        assert [text for _, text, _ in prefill] == [tok.decode([t]) for t in ids]
        assert [e.id for e in evs] == hf_greedy(demo_model_dir, prompt, 3)
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_top_tokens_and_logprobs_match_hf_logits(demo_model_dir, tmp_path):
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        ids = engine.tokenize(PROMPTS[0])
        evs = events(engine.submit([ids], SamplingParams(max_new_tokens=6, top_n_tokens=5))[0])
        out = [e.id for e in evs]
        ref = hf_logprobs(demo_model_dir, ids + out)
        special = set(engine.tokenizer.all_special_ids)
        for k, ev in enumerate(evs):
            row = ref[len(ids) - 1 + k]
            vals, idx = row.topk(5)
            assert [t for t, _, _ in ev.top_tokens] == idx.tolist()
            assert [lp for _, _, lp in ev.top_tokens] == pytest.approx(vals.tolist(), abs=1e-4)
            assert [text for _, text, _ in ev.top_tokens] == [engine.tokenizer.decode([t]) for t in idx.tolist()]
            assert ev.log_prob == pytest.approx(row[ev.id].item(), abs=1e-4)
            assert ev.special == (ev.id in special)
        assert evs[-1].done.cumulative_log_prob == pytest.approx(sum(e.log_prob for e in evs), abs=1e-6)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["paged", "rolling", "dynamic", "none"])
def test_n_greedy_samples_equal_generate_and_paged_prefills_once(strategy, demo_model_dir, tmp_path):
    roomy = {"option.kv_cache_tokens": "1024", "option.max_rolling_batch_size": "9"} \
        if strategy == "paged" else {}            # no preemption, every sample running at once
    engine = make_engine(demo_model_dir, tmp_path, {**STRATEGIES[strategy], **roomy})
    try:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]     # several lengths: the last block partial or not
        ids = [engine.tokenize(p) for p in prompts]
        chans = engine.submit(ids, SamplingParams(max_new_tokens=8, n=3))
        assert [(c.prompt_index, c.sample_index) for c in chans] == [(p, s) for p in range(3) for s in range(3)]
        results = [[e.id for e in events(c)] for c in chans]
        for c, got in zip(chans, results):
            assert got == hf_greedy(demo_model_dir, prompts[c.prompt_index], 8)
        stats = engine.stats()
        if strategy == "paged":      # samples 1 and 2 reuse all but the last prompt token
            assert stats["forked_prompt_tokens"] == sum(2 * (len(i) - 1) for i in ids)
            assert stats["prefill_tokens"] == sum(len(i) + 2 for i in ids)
        else:
            assert stats["forked_prompt_tokens"] == 0 and stats["prefill_tokens"] == 3 * sum(map(len, ids))
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_n_seeded_samples_are_reproducible_distinct_and_match_single_seeds(demo_model_dir, tmp_path):
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        ids = engine.tokenize(PROMPTS[0])
        params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.0, seed=7, best_of=3)

        def run(p):
            chans = engine.submit([ids], p)
            return [([e.id for e in evs], evs[-1].done.cumulative_log_prob)
                    for evs in (events(c) for c in chans)]
        first, again = run(params), run(params)
        assert first == again
        assert len({tuple(t) for t, _ in first}) == 3             # each sample its own draws
        for i, (toks, cum) in enumerate(first):                   # sample i draws from seed + i
            (single, _), = run(SamplingParams(max_new_tokens=12, do_sample=True, seed=7 + i))
            assert toks == single
        assert engine.stats()["forked_prompt_tokens"] > 0
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- sampler against HF's warpers
@pytest.mark.parametrize("kw", [
    {"temperature": 0.7, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8},
    {"min_p": 0.05},
    {"typical_p": 0.6},
    {"temperature": 0.9, "top_k": 50, "top_p": 0.9, "min_p": 0.02, "typical_p": 0.95},
])
def test_warped_distribution_equals_hf_warpers(kw):
    from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper, TypicalLogitsWarper)

    from handler.model.sampling import warped_probs
    from handler.engine.scheduler import StepItem
    torch.manual_seed(0)
    logits = torch.randn(3, 500) * 3
    p = SamplingParams(do_sample=True, **kw)
    hf = LogitsProcessorList()
    if p.temperature != 1.0:
        hf.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        hf.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        hf.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        hf.append(MinPLogitsWarper(p.min_p))
    if p.typical_p < 1.0:
        hf.append(TypicalLogitsWarper(p.typical_p))
    want = hf(None, logits.clone()).softmax(dim=-1)
    items = [StepItem(i, [1], 0, [0], True, p, [1]) for i in range(3)]
    got = warped_probs(logits.clone(), items)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-6)


def test_presence_and_frequency_penalties_follow_openai_formula(demo_model_dir, tmp_path):
    """Greedy with penalties equals HF generate with a processor written from OpenAI's formula:
    logit[j] -= count[j] * frequency + (count[j] > 0) * presence, counts over generated tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    tok, model = _load(demo_model_dir)
    prompt = PROMPTS[3]
    ids = tok(prompt, return_tensors="pt")["input_ids"]

    class OpenAIPenalty(LogitsProcessor):
        def __init__(self, presence, frequency):
            self.presence, self.frequency = presence, frequency

        def __call__(self, input_ids, scores):
            out = input_ids[0, ids.shape[1]:]
            for j in set(out.tolist()):
                c = int((out == j).sum())
                scores[0, j] -= c * self.frequency + self.presence
            return scores

    plain = hf_greedy(demo_model_dir, prompt, 40, ignore_eos=True)
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        # This random model never repeats a token greedily and its logit margins are wide: strong
        # negative penalties make it repeat, so the formula's sign and counts show in the tokens.
        for presence, frequency in [(-8.0, 0.0), (0.0, -4.0), (3.0, -5.0)]:
            with torch.no_grad():
                want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                                      do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None,
                                      logits_processor=
                                      LogitsProcessorList([OpenAIPenalty(presence, frequency)]))[0, ids.shape[1]:]
            evs = events(engine.submit([engine.tokenize(prompt)], SamplingParams(
                max_new_tokens=40, ignore_eos=True, presence_penalty=presence,
                frequency_penalty=frequency))[0])
            assert [e.id for e in evs] == want.tolist(), (presence, frequency)
            assert want.tolist() != plain
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- isolation
def test_a_bad_request_at_sampling_time_fails_alone(demo_model_dir, tmp_path, monkeypatch):
    from handler.model.sampling import Sampler
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        innocent = SamplingParams(max_new_tokens=12)
        # top_k far beyond the vocabulary (2**63 would overflow the whole step) is clamped.
        huge = SamplingParams(max_new_tokens=12, do_sample=True, top_k=2**63, seed=1)
        a, b = engine.submit([engine.tokenize(PROMPTS[0])], innocent) + \
            engine.submit([engine.tokenize(PROMPTS[1])], huge)
        assert [e.id for e in events(a)] == hf_greedy(demo_model_dir, PROMPTS[0], 12)
        assert not isinstance(events(b)[-1], ErrorEvent)

        # A failure found while sampling one row (injected) ends that request only.
        real = Sampler._penalize

        def boom(logits, items):
            if any(it.params.repetition_penalty == 1.25 for it in items):
                raise RuntimeError("injected")
            return real(logits, items)
        monkeypatch.setattr(Sampler, "_penalize", staticmethod(boom))
        long = SamplingParams(max_new_tokens=24)
        a = engine.submit([engine.tokenize(PROMPTS[0])], long)[0]
        a_first = a.events.get(timeout=60)           # running before the bad one joins
        bad = engine.submit([engine.tokenize(PROMPTS[1])], SamplingParams(max_new_tokens=5,
                                                                        repetition_penalty=1.25))[0]
        err = events(bad)[-1]
        assert isinstance(err, ErrorEvent) and err.status == 424 and "injected" in err.message
        rest = events(a)
        assert [a_first.id] + [e.id for e in rest] == hf_greedy(demo_model_dir, PROMPTS[0], 24)

        # So does one found while turning its token into text (the output processor's work).
        import handler.engine.output as engine_module

        class Fragile(engine_module.IncrementalDetokenizer):
            def add(self, token_id):
                if "BOOM" in self.stops:
                    raise UnicodeError("injected")
                return super().add(token_id)
        monkeypatch.setattr(engine_module, "IncrementalDetokenizer", Fragile)
        a = engine.submit([engine.tokenize(PROMPTS[0])], long)[0]
        a_first = a.events.get(timeout=60)
        bad = engine.submit([engine.tokenize(PROMPTS[1])], SamplingParams(max_new_tokens=5,
                                                                        stop_sequences=("BOOM",)))[0]
        err = events(bad)[-1]
        assert isinstance(err, ErrorEvent) and err.status == 500 and "injected" in err.message
        rest = events(a)
        assert [a_first.id] + [e.id for e in rest] == hf_greedy(demo_model_dir, PROMPTS[0], 24)
        assert_drained(engine)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- how sequences end
def test_stop_sequence_is_the_recorded_finish_and_an_engine_error_resets_cleanly(demo_model_dir, tmp_path):
    engine = make_engine(demo_model_dir, tmp_path, STRATEGIES["paged"])
    try:
        tok = engine.tokenizer
        ids = engine.tokenize(PROMPTS[0])
        text = tok.decode(hf_greedy(demo_model_dir, PROMPTS[0], 12), skip_special_tokens=True)
        stop = text[len(text) // 2:len(text) // 2 + 3]
        recorded = {}
        real_finish = engine.scheduler.finish

        def finish(sid, reason):
            seq = real_finish(sid, reason)
            if seq is not None:
                recorded[sid] = seq.finish_reason
            return seq
        engine.scheduler.finish = finish
        # Room to run on (no length or EOS finish of its own for ~200 steps): the engine must be told
        # to stop, however far the output processor lags behind it on a loaded host.
        ch = engine.submit([ids], SamplingParams(max_new_tokens=200, ignore_eos=True, stop_sequences=(stop,)))[0]
        done = events(ch)[-1].done
        assert done.finish_reason == "stop_sequence" and done.generated_text.endswith(stop)
        # The output processor found the stop string and ended the sequence in the engine, which
        # records why (the engine thread does it right after the processor asks).
        assert_eventually(lambda: recorded.get(ch.seq_id) == "stop_sequence", timeout=30)
        assert engine.counters["aborted"] == 0

        # A bug inside an iteration: everyone in flight gets a 500, then the engine serves again.
        real_update = engine.scheduler.update

        def broken(plan, results):
            engine.scheduler.update = real_update
            raise RuntimeError("bug")
        engine.scheduler.update = broken
        errs = [events(c)[-1] for c in engine.submit([ids, ids], SamplingParams(max_new_tokens=30))]
        assert all(isinstance(e, ErrorEvent) and e.status == 500 for e in errs)
        assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.scheduler.seqs
        got = [e.id for e in events(engine.submit([ids], SamplingParams(max_new_tokens=8))[0])]
        assert got == hf_greedy(demo_model_dir, PROMPTS[0], 8)
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_any_integer_seed_works_as_64_bits():
    from handler.model.sampling import Sampler
    from handler.engine.scheduler import StepItem
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)

    def draws(seed):
        s, p = Sampler(), SamplingParams(do_sample=True, seed=seed)
        out = [s.sample(logits, [StepItem(1, [1], 0, [0], True, p, [1])])[0] for _ in range(8)]
        assert all(r.error is None for r in out)
        return [r.token for r in out]
    assert draws(-1) == draws(2**64 - 1) and draws(2**64 + 5) == draws(5)
    assert draws(5) != draws(6)
