"""Speculative decoding (handler/engine/spec.py, handler/model/spec_verify.py): prompt lookup under the
iteration-level strategies, greedy equal to `generate`, an oracle draft accepted in full, the sampled
distribution unchanged (chi-square), KV/blocks consistent, and the properties' one-line errors."""
from __future__ import annotations

import collections

import pytest

from handler.config import ConfigError
from handler.config.speculative import SpecConfig
from handler.engine.request import SamplingParams
from handler.engine.spec import NgramProposer, PerSequence
from tests.support.engine import PROMPTS, STRATEGIES, assert_drained, make_engine, run_all
from tests.support.reference import hf_greedy

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
# Prompts whose continuation the tiny model copies from them (it repeats what it saw).
REPEATS = [PROMPTS[2], PROMPTS[0] * 3, "a b c d e f a b c d e f a b c d e f a b", PROMPTS[4] * 2]
NEW = [40, 33, 27, 45]


# ---------------------------------------------------------------- the proposer
def test_ngram_proposes_what_followed_the_most_recent_earlier_match():
    p = NgramProposer(1, 3)
    assert p.draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]      # the later of two matches
    assert p.draft([5, 6, 7, 8, 6, 7], 3) == [8, 6, 7]                  # longest suffix (6, 7) first
    assert p.draft([1, 2, 3, 4], 3) == []                               # no earlier occurrence
    assert NgramProposer(2, 3).draft([4, 1, 9, 9, 1], 2) == []          # 1-grams below the minimum
    assert p.draft([1, 2, 1], 5) == [2, 1]                              # up to the end
    assert p.draft([1, 2, 1], 0) == []


def test_a_sequence_whose_drafts_are_rejected_backs_off(demo_model_dir, tmp_path):
    """Drafts wholly rejected m times in a row: the next min(2^m, 16) - 1 decode steps propose nothing
    (wasted verify rows), and output stays exact."""
    engine = spec_engine(demo_model_dir, tmp_path, "rolling", {"option.kv_cache_tokens": "2048"})
    try:
        want = hf_greedy(demo_model_dir, PROMPTS[0], 40, ignore_eos=True)

        class Wrong(PerSequence):
            method, calls = "ngram", 0

            def draft(self, tokens, k):
                self.calls += 1
                return [(want[len(tokens) - len(prompt)] + 1) % 1000] * k if len(tokens) - len(prompt) < 40 else []
        prompt = engine.tokenize(PROMPTS[0])
        engine.proposer = wrong = Wrong()
        (ids, _), = run_all(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=40, ignore_eos=True)])
        assert ids == want
        # 38 decode steps after the first token: proposals at steps 0, 2, 6, 14, 30 (gaps 1, 3, 7, 15).
        assert wrong.calls == 5, wrong.calls
        assert engine.stats()["spec"]["ngram"]["accepted"] == 0
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- properties
def spec_engine(model_dir, tmp_path, strategy, extra=None):
    return make_engine(model_dir, tmp_path, {**STRATEGIES[strategy], "option.speculative_config": NGRAM,
                                             **(extra or {})})


def load(tmp_path, model_dir, lines: str):
    from handler.config import load_config
    path = tmp_path / "serving.properties"
    path.write_text("option.rolling_batch=auto\n" + lines)
    return load_config(str(path), model_dir, env={})


def test_properties_resolve_and_refuse_in_one_line(tmp_path, demo_model_dir):
    cfg = load(tmp_path, demo_model_dir, f"option.speculative_config={NGRAM}\n"
                                         "option.speculative_disable_by_batch_size=8\n")
    assert cfg.speculative == SpecConfig("ngram", 4, 2, 3, 8, None)
    cfg = load(tmp_path, demo_model_dir, 'option.speculative_config={"method": "ngram"}\noption.speculative_length=7\n')
    assert cfg.speculative.k == 7
    assert load(tmp_path, demo_model_dir, "").speculative is None
    assert "ignored without" in " ".join(load(tmp_path, demo_model_dir, "option.speculative_length=3\n").warnings)
    for lines, words in [
        ('option.speculative_config={"method": "medusa"}', "allowed: ngram, draft_model"),
        ('option.speculative_config={"num_speculative_tokens": 99}', "num_speculative_tokens=99; allowed"),
        ('option.speculative_config={"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min=5 >"),
        ('option.speculative_config={"speculative": 1}', "unknown field(s) speculative"),
        ("option.speculative_config=[1]", "is not a JSON object"),
        ("option.speculative_config={oops", "is not JSON"),
        ("option.speculative_draft_model=/models/small", "draft model /models/small does not exist"),
        ('option.speculative_config={"method": "draft_model", "model": "/m"}', "draft model /m does not exist"),
        (f"option.speculative_config={NGRAM}\noption.speculative_length=2", "differ"),
        (f"option.speculative_config={NGRAM}\noption.batch_invariant=true", "option.batch_invariant"),
        ("option.speculative_length=0", "option.speculative_length"),
    ]:
        with pytest.raises(ConfigError) as e:
            load(tmp_path, demo_model_dir, lines + "\n")
        msg = str(e.value)
        assert words in msg and "\n" not in msg and "option.speculative" in msg, msg


# ---------------------------------------------------------------- greedy: exact
@pytest.mark.parametrize("strategy", ["rolling", "paged"])
def test_greedy_with_prompt_lookup_equals_generate(strategy, demo_model_dir, tmp_path):
    extra = {"option.kv_cache_tokens": "2048", "option.block_size": "8"} if strategy == "paged" else \
        {"option.kv_cache_tokens": "2048"}
    # 1-grams too: the random tiny model repeats few longer runs.
    extra["option.speculative_config"] = NGRAM.replace('"prompt_lookup_max"', '"prompt_lookup_min": 1, "prompt_lookup_max"')
    engine = spec_engine(demo_model_dir, tmp_path, strategy, extra)
    try:
        got = run_all(engine, REPEATS, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW])
        for p, n, (ids, done) in zip(REPEATS, NEW, got):
            assert ids == hf_greedy(demo_model_dir, p, n, ignore_eos=True), (strategy, p[:30])
            assert done.generated_tokens == n
        # The random tiny model rarely repeats itself, so its drafts are mostly rejected (the real
        # models' tests accept them: tests/test_spec_real.py); here: drafts were verified.
        assert engine.stats()["spec"]["ngram"]["proposed"] > 0
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_greedy_with_penalty_stop_and_preemption_equals_generate(demo_model_dir, tmp_path):
    """A tight paged pool (preemptions, drafts dropped when blocks run short), repetition penalty over
    the draft's positions, and EOS/length inside an accepted draft."""
    engine = spec_engine(demo_model_dir, tmp_path, "paged", {"option.kv_cache_tokens": "160",
                                                            "option.block_size": "8",
                                                            "option.max_rolling_batch_size": "4"})
    try:
        params = [SamplingParams(max_new_tokens=n, repetition_penalty=1.3 if i % 2 else 1.0)
                  for i, n in enumerate(NEW)]
        want = {p: hf_greedy(demo_model_dir, p, prm.max_new_tokens, prm.repetition_penalty)
                for p, prm in zip(REPEATS, params)}
        engine.proposer = Oracle({tuple(engine.tokenize(p)): w for p, w in want.items()}, wrong=True)
        got = run_all(engine, REPEATS, params)
        for p, (ids, _) in zip(REPEATS, got):
            assert ids == want[p], p[:30]
        assert engine.stats()["preemptions"] > 0 and engine.stats()["spec"]["ngram"]["accepted"] > 0
        assert_drained(engine)
    finally:
        engine.shutdown()


class Oracle(PerSequence):
    """Proposes the reference continuation (what `generate` gives): a draft the target agrees with;
    with `wrong`, every third step's draft has its token at index step % k replaced (partly accepted)."""
    method = "ngram"

    def __init__(self, continuations: dict[tuple, list[int]], wrong: bool = False):
        self.cont, self.wrong, self.calls = continuations, wrong, 0

    def draft(self, tokens, k):
        for prompt, cont in self.cont.items():
            n = len(prompt)
            if tuple(tokens[:n]) == prompt:
                done = len(tokens) - n
                draft = list(cont[done:done + k])
                self.calls += 1
                if self.wrong and draft and self.calls % 3:
                    i = self.calls % len(draft)
                    draft[i] = (draft[i] + 1) % 1000
                return draft
        return []


@pytest.mark.parametrize("strategy,extra", [
    ("rolling", {}),
    ("paged", {"option.block_size": "4", "option.enable_prefix_caching": "true"})])
def test_partly_wrong_drafts_roll_back_and_stay_exact(strategy, extra, demo_model_dir, tmp_path):
    """Rejected positions' KV is overwritten, the table shrinks back, no block holding a rejected
    token enters the prefix cache: a second round over the cached prefixes is still exact."""
    engine = spec_engine(demo_model_dir, tmp_path, strategy, {"option.kv_cache_tokens": "2048", **extra})
    try:
        prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
        want = [hf_greedy(demo_model_dir, p, 30, ignore_eos=True) for p in prompts]
        cont = {tuple(engine.tokenize(p)): w for p, w in zip(prompts, want)}
        engine.proposer = Oracle(cont, wrong=True)
        for _ in range(2):
            got = run_all(engine, prompts, [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3)
            assert [ids for ids, _ in got] == want
            assert_drained(engine)
            # Prompt + output as the next prompt: its cached blocks hold only accepted tokens.
        if strategy == "paged":
            assert engine.stats()["prefix_cache_hit_tokens"] > 0
            for b, toks in enumerate(engine.blocks.block_tokens):
                if toks is not None:    # every registered block is a run of some prompt + output
                    assert any(_contains(list(pr) + w, list(toks)) for pr, w in cont.items()), b
        st = engine.stats()["spec"]["ngram"]
        assert 0 < st["accepted"] < st["proposed"]
    finally:
        engine.shutdown()


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("strategy", ["rolling", "paged"])
def test_a_draft_equal_to_the_target_is_accepted_in_full(strategy, demo_model_dir, tmp_path):
    engine = spec_engine(demo_model_dir, tmp_path, strategy, {"option.kv_cache_tokens": "2048"})
    try:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
        want = [hf_greedy(demo_model_dir, p, 30, ignore_eos=True) for p in prompts]
        engine.proposer = Oracle({tuple(engine.tokenize(p)): w for p, w in zip(prompts, want)})
        got = run_all(engine, prompts, [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3)
        assert [ids for ids, _ in got] == want
        st = engine.stats()["spec"]["ngram"]
        assert st["proposed"] > 0 and st["accepted"] == st["proposed"]
        # k=4: after the first token each verify emits 5 tokens (the last one k shorter at the end).
        assert st["verifies"] <= 3 * (-(-29 // 5))
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_verify_rows_run_in_the_c_layer_stack(demo_model_dir, tmp_path, monkeypatch):
    """A step of verify rows is a decode step to the CPU kernels: one C call for the layer stack
    (handler/model/cpu_stack.py), not the Python layers."""
    from handler.model import cpu_stack
    seen = []
    run = cpu_stack.DecodeStack.run

    def spy(self, h, cos, sin, step):
        ok = run(self, h, cos, sin, step)
        seen.append((h.shape[0], ok))
        return ok
    monkeypatch.setattr(cpu_stack.DecodeStack, "run", spy)
    engine = spec_engine(demo_model_dir, tmp_path, "paged", {"option.kv_cache_tokens": "2048"})
    try:
        if engine.runner.model.decode_stack is None:
            pytest.skip("the C layer stack does not apply on this host (see the runner's start-up log)")
        want = hf_greedy(demo_model_dir, PROMPTS[0], 20, ignore_eos=True)
        engine.proposer = Oracle({tuple(engine.tokenize(PROMPTS[0])): want})
        (ids, _), = run_all(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=20, ignore_eos=True)])
        assert ids == want
        assert seen[1:] and all(ok for _, ok in seen) and seen[1][0] == 5, seen   # k+1 = 5 rows
    finally:
        engine.shutdown()


def test_n_samples_speculate_each(demo_model_dir, tmp_path):
    engine = spec_engine(demo_model_dir, tmp_path, "paged", {"option.kv_cache_tokens": "2048"})
    try:
        want = hf_greedy(demo_model_dir, PROMPTS[4], 16, ignore_eos=True)
        engine.proposer = Oracle({tuple(engine.tokenize(PROMPTS[4])): want}, wrong=True)
        chans = engine.submit([engine.tokenize(PROMPTS[4])], SamplingParams(max_new_tokens=16, n=3, ignore_eos=True))
        for ch in chans:
            ids = []
            while True:
                ev = ch.events.get(timeout=300)
                ids.append(ev.id)
                if ev.done:
                    break
            assert ids == want
        assert engine.stats()["spec"]["ngram"]["accepted"] > 0
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_guided_requests_and_disable_by_batch_size_do_not_speculate(demo_model_dir, tmp_path):
    from handler.engine.guide import GuideSpec
    engine = spec_engine(demo_model_dir, tmp_path, "rolling", {"option.speculative_disable_by_batch_size": "2"})
    try:
        prompts = [PROMPTS[0], PROMPTS[1]]
        want = [hf_greedy(demo_model_dir, p, 20, ignore_eos=True) for p in prompts]
        engine.proposer = oracle = Oracle({tuple(engine.tokenize(p)): w for p, w in zip(prompts, want)})
        run_all(engine, prompts, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 2)
        # Two running from the first decode step to the last, none proposes; one alone does.
        assert oracle.calls == 0 and engine.stats()["spec"]["ngram"]["proposed"] == 0
        run_all(engine, prompts[:1], [SamplingParams(max_new_tokens=20, ignore_eos=True)])
        assert engine.stats()["spec"]["ngram"]["proposed"] > 0
        # A guided sequence decodes one token a step (its matcher is not asked about drafts).
        before = oracle.calls
        (ids, _), = run_all(engine, prompts[:1], [SamplingParams(
            max_new_tokens=20, guide=GuideSpec("regex", "[a-z ]+"))])
        assert oracle.calls == before
        assert engine.tokenizer.decode(ids, skip_special_tokens=True).strip(" ").isalpha() or \
            set(engine.tokenizer.decode(ids, skip_special_tokens=True)) <= set("abcdefghijklmnopqrstuvwxyz ")
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- sampled: the target's distribution
class Fixed(PerSequence):
    """Proposes fixed tokens at fixed output positions (so that many drafts are rejected and many
    accepted), whatever the sequence sampled so far."""
    method = "ngram"

    def __init__(self, n_prompt: int, draft: list[int]):
        self.n_prompt, self.fixed = n_prompt, draft

    def draft(self, tokens, k):
        done = len(tokens) - self.n_prompt
        return self.fixed[done - 1:done - 1 + k] if done >= 1 else []


def _sample_outputs(engine, ids, n, seed0, new):
    params = [SamplingParams(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=TOP_K, seed=seed0 + i,
                             ignore_eos=True) for i in range(n)]
    from handler.engine.loop import ErrorEvent
    out = []
    for start in range(0, n, 64):
        chans = [engine.submit([ids], p)[0] for p in params[start:start + 64]]
        for ch in chans:
            toks = []
            while True:
                ev = ch.events.get(timeout=300)
                assert not isinstance(ev, ErrorEvent), ev
                toks.append(ev.id)
                if ev.done:
                    break
            out.append(tuple(toks))
    return out


def chi_square_p(a: collections.Counter, b: collections.Counter, min_count: int = 8) -> float:
    """Two-sample chi-square homogeneity test over the categories; rare ones pooled."""
    from scipy.stats import chi2_contingency
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rest_a = sum(a.values()) - sum(a[k] for k in keys)
    rest_b = sum(b.values()) - sum(b[k] for k in keys)
    table = [[a[k] for k in keys] + [rest_a], [b[k] for k in keys] + [rest_b]]
    if rest_a + rest_b == 0:
        table = [row[:-1] for row in table]
    return chi2_contingency(table)[1]


N_DRAWS, NEW_TOKENS = 1200, 4
TOP_K = 3          # a few likely tokens per position: drafts are accepted and rejected often


@pytest.fixture(scope="module")
def baseline(demo_model_dir, tmp_path_factory):
    engine = make_engine(demo_model_dir, tmp_path_factory.mktemp("base"),
                         {**STRATEGIES["paged"], "option.max_rolling_batch_size": "64",
                          "option.kv_cache_tokens": "8192"})
    try:
        ids = engine.tokenize(PROMPTS[3])
        return ids, _sample_outputs(engine, ids, N_DRAWS, 1000, NEW_TOKENS)
    finally:
        engine.shutdown()


def assert_same_distribution(base, spec, st):
    """Both acceptance branches ran, and every position's token (and the first pair) is drawn alike
    with and without speculation (chi-square, p > 1e-3)."""
    assert 0.05 * st["proposed"] < st["accepted"] < 0.95 * st["proposed"], st
    for j in range(NEW_TOKENS):
        p = chi_square_p(collections.Counter(o[j] for o in base), collections.Counter(o[j] for o in spec))
        assert p > 1e-3, (j, p)
    p = chi_square_p(collections.Counter(o[:2] for o in base), collections.Counter(o[:2] for o in spec))
    assert p > 1e-3, ("pairs", p)



def test_sampled_output_distribution_is_the_targets(demo_model_dir, tmp_path, baseline):
    """Position by position, the tokens sampled with speculation (drafts of each position's most
    common token, accepted in part) are distributed as without it: chi-square p > 0.001 for each
    output position and for the pairs of the first two (the draws are seeded). A wrong acceptance
    rule fails it: on rejection drawing from p instead of max(p - q, 0) gives p = 8e-14 at position
    1; accepting with probability 2p(d) gives p = 1e-28; always accepting fails the branch check."""
    ids, base = baseline
    draft = [collections.Counter(o[j] for o in base).most_common(1)[0][0] for j in range(1, NEW_TOKENS)]
    engine = spec_engine(demo_model_dir, tmp_path, "paged", {"option.max_rolling_batch_size": "64",
                                                             "option.kv_cache_tokens": "8192"})
    try:
        engine.proposer = Fixed(len(ids), draft)
        spec = _sample_outputs(engine, ids, N_DRAWS, 50_000, NEW_TOKENS)
        st = engine.stats()["spec"]["ngram"]
    finally:
        engine.shutdown()
    assert_same_distribution(base, spec, st)


def test_stop_string_and_max_tokens_inside_an_accepted_draft(demo_model_dir, tmp_path):
    """Tokens of an accepted draft are applied in order: a stop string in the middle of one ends
    the sequence there (the later tokens are not sent), and max_new_tokens bounds the draft."""
    engine = spec_engine(demo_model_dir, tmp_path, "rolling", {"option.kv_cache_tokens": "2048"})
    try:
        tok = engine.tokenizer
        want = hf_greedy(demo_model_dir, PROMPTS[0], 30, ignore_eos=True)
        engine.proposer = Oracle({tuple(engine.tokenize(PROMPTS[0])): want})
        # A stop string made of the text of tokens 7..8: reached inside the verify of tokens 6..10.
        stop = tok.decode(want[7:9])
        full = tok.decode(want)
        assert stop and full.find(stop) >= len(tok.decode(want[:6]))
        (ids, done), = run_all(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=30, ignore_eos=True,
                                                                     stop_sequences=(stop,))])
        assert done.finish_reason == "stop_sequence" and done.generated_text.endswith(stop)
        assert ids == want[:len(ids)] and len(ids) < 12
        (ids, done), = run_all(engine, [PROMPTS[0]], [SamplingParams(max_new_tokens=7, ignore_eos=True)])
        assert ids == want[:7] and done.finish_reason == "length"
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_metrics_export_proposed_accepted_mean_length_and_rate():
    """/metrics (handler/http/metrics.py): the engine's per-method counts, and the two derived gauges."""
    from handler.http.metrics import Metrics
    from handler.tools.bench.scrape import parse

    class Client:
        def stats(self):
            return {"running": 1, "spec": {"ngram": {"verifies": 10, "proposed": 40, "accepted": 25}}}

        def adapter_counters(self):
            return {}
    m = parse(Metrics("m", "paged", get_client=Client).exposition().decode())
    key = frozenset({"model": "m", "strategy": "paged", "method": "ngram"}.items())
    assert m["lmi_spec_decode_proposed_total"][key] == 40
    assert m["lmi_spec_decode_accepted_total"][key] == 25
    assert m["lmi_spec_decode_verifies_total"][key] == 10
    assert m["lmi_spec_decode_mean_accepted_length"][key] == pytest.approx(3.5)   # (25 + 10) / 10
    assert m["lmi_spec_decode_acceptance_rate"][key] == pytest.approx(0.625)


def test_lora_rows_of_a_draft_get_their_adapter(demo_model_dir, tmp_path):
    """A verify item's k+1 rows carry its adapter's update (handler/model/lora.py maps rows by item):
    base and adapted sequences in one batch, each equal to its merged model's generate."""
    import os
    import shutil

    from tests.support.lora import build_adapter, greedy
    d = str(tmp_path / "model")
    shutil.copytree(demo_model_dir, d)
    merged = build_adapter(d, os.path.join(d, "adapters", "a1"), 101, ["q_proj", "v_proj", "down_proj"])
    engine = spec_engine(d, tmp_path, "paged", {"option.enable_lora": "true", "option.max_loras": "1",
                                                "option.kv_cache_tokens": "2048", "option.dtype": "fp32"})
    try:
        prompts = [PROMPTS[0], PROMPTS[3]]
        want_base = [hf_greedy(d, p, 20, ignore_eos=True) for p in prompts]
        want_a1 = [greedy(merged, engine.tokenizer, p, 20) for p in prompts]
        assert want_a1 != want_base
        # The oracle proposes the base model's continuation: accepted for the base, mostly not for a1.
        engine.proposer = Oracle({tuple(engine.tokenize(p)): w for p, w in zip(prompts, want_base)})
        a1 = engine.runner.lora.get("a1")
        got = run_all(engine, prompts * 2, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 2
                      + [SamplingParams(max_new_tokens=20, ignore_eos=True, adapter=a1)] * 2)
        assert [ids for ids, _ in got] == want_base + want_a1
        assert engine.stats()["spec"]["ngram"]["accepted"] > 0
    finally:
        engine.shutdown()
