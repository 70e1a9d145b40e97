"""benchmarks/spec_decode.py's repetitions: every repetition starts fresh servers in its own arm order
(a server process's own speed is not counted against its arm every time), the order alternates, and
--control adds a second plain server (A/A) with the plain arm's properties. No server is started:
the servers and the load are stand-ins that record what the benchmark asks of them."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import spec_decode


class FakeServer:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.up, self.error, self.held = name, log, False, None, None
        self.api = type("Api", (), {"url": staticmethod(lambda u: u)})()

    @property
    def url(self) -> str:
        return f"http://{self.name}"

    def start(self):
        assert not self.up, f"{self.name} started twice without a stop"
        self.up = True
        self.log.append(("start", self.name))

    def wait(self, timeout):
        pass

    def stop(self):
        if self.up:
            self.up = False
            self.log.append(("stop", self.name))


@pytest.fixture
def bench(monkeypatch):
    log: list = []

    def run_load(url, bodies, c, **kw):
        name = url.split("//")[1]
        servers = {s.name: s for s in arms_made}
        assert servers[name].up, f"load sent to {name}, which is not running"
        log.append(("warm" if len(bodies) == 4 and c == 2 else "run", name))
        return [], 1.0

    monkeypatch.setattr(spec_decode, "run_load", run_load)
    monkeypatch.setattr(spec_decode, "spec_counters", lambda url: {})
    monkeypatch.setattr(spec_decode, "summarise", lambda recs, c, dur: {
        "requests_per_s": 1.0, "tpot_p50": 0.1, "errors": 0})
    arms_made: list = []

    def arms(names):
        made = [spec_decode.Arm(n, "ours", "ngram", FakeServer(n, log)) for n in names]
        arms_made.extend(a.server for a in made)
        return made
    return log, arms


def _run(arms, reps, keep=False):
    results = {"runs": []}
    a = argparse.Namespace(reps=reps, min_requests=8, requests_per_client=1, keep_servers=keep)
    bodies = [{"inputs": "x", "parameters": {"max_new_tokens": 8}}] * 8
    spec_decode.run_system(arms, "m", "chat", bodies, [50], a, results)
    return results["runs"]


def _per_rep(log):
    """The log cut at each round of starts: [[events of repetition 0], [of 1], ...]."""
    reps, cur = [], []
    for ev in log:
        if ev[0] == "start" and cur and cur[-1][0] != "start":
            reps.append(cur)
            cur = []
        cur.append(ev)
    return reps + [cur]


def test_every_repetition_starts_fresh_servers_in_its_own_arm_order(bench):
    log, arms = bench
    names = ["off", "on@4", "on@16"]
    runs = _run(arms(names), reps=4)
    reps = _per_rep([e for e in log if e[0] != "stop"])
    assert len(reps) == 4, log
    for r, events in enumerate(reps):
        order = spec_decode.arm_order(names, r)
        assert [n for k, n in events if k == "start"] == order          # started in this repetition's order
        assert [n for k, n in events if k == "run"] == order            # and run in it
        assert sorted(n for k, n in events if k == "warm") == sorted(names)   # each warmed after its start
    # Stopped before being started again, and all stopped at the end.
    assert [e for e in log if e[0] == "stop"].__len__() == 4 * len(names)
    # No arm is the one started first in every repetition.
    firsts = {events[0][1] for events in reps}
    assert len(firsts) > 1
    assert [(r["rep"], r["arm"], r["position"]) for r in runs if r["rep"] == 1] == \
        [(1, n, i) for i, n in enumerate(spec_decode.arm_order(names, 1))]


def test_keep_servers_starts_each_once(bench):
    log, arms = bench
    _run(arms(["off", "on"]), reps=3, keep=True)
    assert [e for e in log if e[0] == "start"] == [("start", "off"), ("start", "on")]
    assert [n for k, n in log if k == "run"] == ["off", "on", "on", "off", "off", "on"]


def test_rep_schedule_alternates_and_restarts_unless_kept():
    sched = spec_decode.rep_schedule(["off", "on"], range(3), fresh=True)
    assert sched == [(0, ["off", "on"], True), (1, ["on", "off"], True), (2, ["off", "on"], True)]
    assert [s for _, _, s in spec_decode.rep_schedule(["off", "on"], range(3), fresh=False)] == [True, False, False]
    # A run split over invocations (--rep-offset 1) goes on alternating.
    a = argparse.Namespace(reps=2, rep_offset=1)
    assert [(r, o) for r, o, _ in spec_decode.rep_schedule(["off", "on"], spec_decode.rep_range(a), True)] == \
        [(1, ["on", "off"]), (2, ["off", "on"])]


def test_control_arm_is_a_second_plain_server_with_the_plain_properties(tmp_path):
    w = spec_decode.WORKLOADS["chat"]
    specs = spec_decode.our_specs({"method": "ngram", "num_speculative_tokens": 5}, [16])
    arms = spec_decode.our_arms("/m", w, specs, str(tmp_path), str(tmp_path), control=True)
    assert [a.name for a in arms] == ["off", spec_decode.CONTROL, "on"]
    props = {a.name: (tmp_path / f"{a.name}.properties").read_text() for a in arms}
    assert props["off"] == props[spec_decode.CONTROL] and "speculative" not in props["off"]
    assert "option.speculative_config=" in props["on"]
    assert len({a.server.port for a in arms}) == 3
    assert [a.name for a in spec_decode.our_arms("/m", w, specs, str(tmp_path), str(tmp_path))] == ["off", "on"]


def test_report_pairs_the_control_arm_with_off_and_says_what_it_is():
    def row(arm, tpot, rps):
        return {"model": "q", "workload": "chat", "clients": 50, "rep": 0, "system": "ours", "arm": arm,
                "requests": 50, "requests_per_s": rps, "tpot_p50": tpot, "spec": {}}
    md = spec_decode.report({"host": {"processor": "EPYC", "machine": "x86_64", "cpus": 2},
                             "spec": {"method": "ngram"}, "our_arms": {"on": {"method": "ngram"}},
                             "runs": [row("off", 0.200, 2.0), row(spec_decode.CONTROL, 0.210, 1.9),
                                      row("on", 0.190, 2.1)]})
    line = next(ln for ln in md.splitlines() if f"| {spec_decode.CONTROL} |" in ln)
    assert "| 200.0 / 210.0 | 1.05 | 2.00 / 1.90 | 0.95 |" in line
    assert f"{spec_decode.CONTROL}: a second plain server beside off (A/A)" in md
