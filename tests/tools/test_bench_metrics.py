"""The benchmark's arithmetic on synthetic timings: every expected value is worked by hand."""
from __future__ import annotations

import pytest

from handler.tools.bench.metrics import (Record, Slo, expected_ideal_speedup, ideal_speedup, lmi_requests_per_s,
                                   percentile, summarise, tpot)
from handler.tools.bench.workloads import LMI_CPU, SMOKE, Workload, output_lengths


def test_percentile_interpolates_between_closest_ranks():
    xs = [4.0, 1.0, 3.0, 2.0]                      # sorted: 1 2 3 4, rank = q/100 * 3
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)   # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="outside 0..100"):
        percentile(xs, 101)


def test_lmi_figure_is_clients_over_mean_latency():
    assert lmi_requests_per_s(4, [1.0, 2.0, 3.0]) == pytest.approx(2.0)    # 4 / 2 s
    assert lmi_requests_per_s(50, [0.5] * 10) == pytest.approx(100.0)
    assert lmi_requests_per_s(4, []) is None


def test_tpot_excludes_the_first_token():
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)     # 0.9 s over 9 later tokens
    assert tpot(2.0, 0.5, 4) == pytest.approx(0.5)
    assert tpot(1.0, 0.1, 1) is None                    # no second token
    assert tpot(1.0, None, 10) is None                  # not streamed: first token unknown


def test_summarise_synthetic_run():
    recs = [Record(start=0.0, end=1.0, tokens=10, ttft=0.1),
            Record(start=0.0, end=2.0, tokens=5, ttft=0.4),
            Record(start=1.0, end=4.0, tokens=7, ttft=None),     # a peer that did not stream
            Record(start=2.0, end=2.5, error="HTTP 503: queue full")]
    s = summarise(recs, concurrency=3, duration=4.0)
    assert (s["n"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["requests_per_s"] == pytest.approx(0.75)          # 3 completed / 4 s
    assert s["output_tokens"] == 22
    assert s["output_tokens_per_s"] == pytest.approx(5.5)
    assert s["mean_latency_s"] == pytest.approx(2.0)           # (1 + 2 + 3) / 3, the error excluded
    assert s["lmi_requests_per_s"] == pytest.approx(1.5)       # 3 clients / 2 s
    assert s["latency_p50"] == pytest.approx(2.0)
    assert s["latency_p90"] == pytest.approx(2.8)              # rank 1.8 in 1 2 3
    assert s["ttft_p50"] == pytest.approx(0.25)                # of 0.1 and 0.4
    assert s["tpot_p50"] == pytest.approx((0.1 + 0.4) / 2)     # 0.9/9 = 0.1 and 1.6/4 = 0.4
    assert s["error_samples"] == ["HTTP 503: queue full"]


def test_goodput_counts_requests_within_the_objective():
    recs = [Record(start=0.0, end=1.0, tokens=10, ttft=0.1),      # TPOT 0.1
            Record(start=0.0, end=2.0, tokens=5, ttft=0.4),       # TPOT 0.4
            Record(start=0.0, end=0.3, tokens=1, ttft=0.3),       # one token: no TPOT to bound
            Record(start=1.0, end=4.0, tokens=7, ttft=None),      # not streamed: TTFT unknown
            Record(start=2.0, end=2.5, error="HTTP 503: queue full")]
    s = summarise(recs, concurrency=3, duration=4.0, slo=Slo(ttft_s=0.35, tpot_s=0.2))
    assert s["slo_met"] == 2 and s["goodput_per_s"] == pytest.approx(0.5)     # the first and third
    assert s["slo"] == "TTFT <= 350 ms and TPOT <= 200 ms"
    s = summarise(recs, concurrency=3, duration=4.0, slo=Slo(tpot_s=0.5))
    assert s["slo_met"] == 3           # the unstreamed one has 7 tokens and no known TPOT: not met
    assert summarise(recs, concurrency=3, duration=4.0, slo=Slo(ttft_s=1.0))["slo_met"] == 3
    assert "goodput_per_s" not in summarise(recs, concurrency=3, duration=4.0)


def test_summarise_with_nothing_completed():
    s = summarise([Record(0.0, 1.0, error="boom")], concurrency=2, duration=1.0)
    assert s["requests_per_s"] == 0.0 and s["lmi_requests_per_s"] is None and s["latency_p50"] is None


def test_ideal_speedup_small_case_by_hand():
    # B=2: batches (1,2) and (3,4) cost 2 + 4 = 6 steps; iteration level: 10 tokens / 2 slots = 5.
    assert ideal_speedup([1, 2, 3, 4], 2) == pytest.approx(6 / 5)
    # Only complete batches count: (2,4) costs 4 steps vs 6 / 2 = 3; the trailing (6) is left out.
    assert ideal_speedup([2, 4, 6], 2) == pytest.approx(4 / 3)
    # Fewer requests than one batch: they are the batch. (1,3) costs 3 steps vs 4 / 2 = 2.
    assert ideal_speedup([1, 3], 50) == pytest.approx(3 / 2)
    assert ideal_speedup([4, 4, 4], 3) == pytest.approx(1.0)    # equal lengths: nothing to gain
    assert ideal_speedup([1, 9], 1) == pytest.approx(1.0)       # batch of one: nothing to gain
    with pytest.raises(ValueError, match="batch_size"):
        ideal_speedup([1], 0)


def test_expected_ideal_speedup_by_hand():
    # two draws from {1, 2}: max is 1 with probability 1/4, else 2 -> E[max] = 1.75; E[len] = 1.5
    assert expected_ideal_speedup([1, 2], 2) == pytest.approx(1.75 / 1.5)
    # weights 3:1 on {1, 2}: P(max = 1) = 9/16 -> E[max] = 23/16; E[len] = 5/4
    assert expected_ideal_speedup([1, 2], 2, [3, 1]) == pytest.approx((23 / 16) / (5 / 4))
    assert expected_ideal_speedup([64, 128, 256], 1) == pytest.approx(1.0)
    # the published mix with 50 clients: the batch max is 256 all but (2/3)^50 of the time
    assert expected_ideal_speedup([64, 128, 256], 50) == pytest.approx(256 / (448 / 3), rel=1e-6)


def test_ideal_from_draws_agrees_with_the_expectation():
    import random

    rng = random.Random(1)
    lengths = [rng.choice([16, 32, 64]) for _ in range(40_000)]
    assert ideal_speedup(lengths, 4) == pytest.approx(expected_ideal_speedup([16, 32, 64], 4), rel=0.02)


def test_workload_draw_is_deterministic_and_exact_length():
    a, b = LMI_CPU.draw(), LMI_CPU.draw()
    assert a == b and len(a) == LMI_CPU.requests
    assert {x["parameters"]["max_new_tokens"] for x in a} == {16, 32, 64}
    assert all(x["parameters"]["ignore_eos"] is True and x["stream"] is True for x in a)
    assert len({x["inputs"] for x in a}) == 3


def test_output_lengths_honour_eos_after():
    w = Workload(name="t", requests=200, concurrency=2, prompt_words=(4,), max_new_tokens=(10,),
                 eos_after=(3, 20))
    bodies = w.draw()
    lens = output_lengths(bodies)
    assert all(b["parameters"]["eos_after"] in range(3, 21) for b in bodies)
    assert lens == [min(10, b["parameters"]["eos_after"]) for b in bodies]
    assert output_lengths(SMOKE.draw()) == [b["parameters"]["max_new_tokens"] for b in SMOKE.draw()]
