"""Issue 47's peer arms (benchmarks/spec_decode.py --systems): the speculative command lines of
llama-server and of our OpenVINO GenAI front, the counters each is read by, the front's engine with
a stand-in openvino_genai (what it hands the pipeline and each request; how it counts tokens per
step), and the benchmark's arm bookkeeping and table. No server is started here."""
from __future__ import annotations

import sys
import types

import pytest

from benchmarks import spec_decode
from handler.tools.bench import llamacpp_peer, openvino_peer


def flag(cmd, f):
    return cmd[cmd.index(f) + 1]


# ------------------------------------------------------------------ llama.cpp
def test_llamacpp_prompt_lookup_flags_follow_the_plain_ones_and_only_the_speculative_arm_has_them():
    spec = llamacpp_peer.spec_args("ngram", 5, ngram_n=3)
    on, _, held = llamacpp_peer.server("/p", "/m/x.gguf", 1234, 12800, 64, 4096, "fp32", threads=2, spec=spec,
                                       metrics=True)
    off, _, held_off = llamacpp_peer.server("/p", "/m/x.gguf", 1234, 12800, 64, 4096, "fp32", threads=2,
                                            metrics=True)
    assert (flag(on, "--spec-type"), flag(on, "--spec-ngram-simple-size-n"),
            flag(on, "--spec-ngram-simple-size-m")) == ("ngram-simple", "3", "5")
    assert "--metrics" in on and "--metrics" in off
    assert "--spec-type" not in off and "speculative" not in held_off
    # the same server otherwise: the plain arm's command is the speculative one's prefix
    assert on[:len(off)] == off
    assert held["speculative"] == {"spec_type": "ngram-simple", "ngram_n": 3, "draft_tokens": 5}
    mapk = llamacpp_peer.spec_args("ngram", 4, ngram_n=2, ngram_type="ngram-map-k")[0]
    assert (flag(mapk, "--spec-type"), flag(mapk, "--spec-ngram-map-k-size-n"),
            flag(mapk, "--spec-ngram-map-k-size-m")) == ("ngram-map-k", "2", "4")
    assert "--metrics" not in llamacpp_peer.server("/p", "/m/x.gguf", 1, 128, 2, 512, "fp32")[0]


def test_llamacpp_draft_model_flags_name_the_gguf_k_and_the_drafts_kv_and_threads():
    cmd, held = llamacpp_peer.spec_args("draft_model", 4, draft_gguf="/m/draft-f32.gguf", kv_type="f32", threads=2)
    assert (flag(cmd, "--spec-type"), flag(cmd, "--spec-draft-model"), flag(cmd, "--spec-draft-n-max"),
            flag(cmd, "--spec-draft-n-min"), flag(cmd, "-ctkd"), flag(cmd, "-ctvd"), flag(cmd, "-td"),
            flag(cmd, "-tbd")) == ("draft-simple", "/m/draft-f32.gguf", "4", "0", "f32", "f32", "2", "2")
    assert held["draft_gguf"] == "draft-f32.gguf" and held["draft_tokens"] == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="eagle", k=5), "method='eagle': allowed ngram, draft_model"),
    (dict(method="ngram", k=0), "k=0: must be an integer >= 1"),
    (dict(method="ngram", k=5, ngram_type="ngram-cache"), "ngram_type='ngram-cache': allowed ngram-simple"),
    (dict(method="ngram", k=5, ngram_n=0), "ngram_n=0: must be an integer >= 1"),
    (dict(method="draft_model", k=5), "needs draft_gguf"),
])
def test_llamacpp_spec_args_refuse_what_llama_server_would_not_take(kwargs, match):
    method, k = kwargs.pop("method"), kwargs.pop("k")
    with pytest.raises(ValueError, match=match):
        llamacpp_peer.spec_args(method, k, **kwargs)


LLAMA_METRICS = """# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 310
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 120
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 84
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 24
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 20
"""


def test_llamacpp_metrics_give_proposed_accepted_and_verifies_and_the_run_delta_their_rates():
    after = llamacpp_peer.spec_counters(LLAMA_METRICS)
    assert after == {"proposed": 120.0, "accepted": 84.0, "verifies": 24.0}
    d = spec_decode.delta({"ngram": after}, {"ngram": {"proposed": 20.0, "accepted": 14.0, "verifies": 4.0}})
    assert d["ngram"]["acceptance_rate"] == pytest.approx(70 / 100)
    assert d["ngram"]["mean_tokens_per_verify"] == pytest.approx((70 + 20) / 20)
    assert llamacpp_peer.spec_counters("llamacpp:n_decode_total 3\n") == {}


# ------------------------------------------------------------------ OpenVINO GenAI
def test_openvino_speculative_front_flags_and_what_they_set():
    spec = openvino_peer.spec_args("ngram", 5, max_ngram_size=3)
    on, _, held = openvino_peer.server("/ov", "/ir", "/m", 1234, 12800, 64, 4096, "fp32", threads=2, spec=spec)
    off = openvino_peer.server("/ov", "/ir", "/m", 1234, 12800, 64, 4096, "fp32", threads=2)[0]
    assert on[:len(off)] == off
    assert (flag(on, "--spec"), flag(on, "--num-assistant-tokens"), flag(on, "--max-ngram-size")) == \
        ("prompt_lookup", "5", "3")
    assert held["speculative"] == {"pipeline": "prompt_lookup", "num_assistant_tokens": 5, "max_ngram_size": 3}
    d = openvino_peer.spec_args("draft_model", 4, draft_ir="/ir-draft")[0]
    assert (flag(d, "--spec"), flag(d, "--num-assistant-tokens"), flag(d, "--draft-ir")) == \
        ("draft_model", "4", "/ir-draft")
    with pytest.raises(ValueError, match="needs draft_ir"):
        openvino_peer.spec_args("draft_model", 4)
    with pytest.raises(ValueError, match="method='medusa': allowed ngram, draft_model"):
        openvino_peer.spec_args("medusa", 4)


class _FakeGenAI:
    """Just enough of openvino_genai for openvino_peer.Engine: records what the pipeline and each
    request were given; each request's handle yields the scripted token lists one per step."""

    class SchedulerConfig:
        pass

    class GenerationConfig:
        pass

    class GenerationStatus:
        RUNNING, FINISHED = "running", "finished"

    def __init__(self, script):
        self.script = script        # request id -> [new ids per step]
        self.pipes, self.drafts = [], []
        fake = self

        class Output:
            def __init__(self, ids):
                self.generated_ids = ids

        class Handle:
            def __init__(self, steps):
                self.steps, self.pending = list(steps), []

            def can_read(self):
                return bool(self.pending)

            def read(self):
                ids, self.pending = self.pending, []
                return {0: Output(ids)}

            def get_status(self):
                return fake.GenerationStatus.RUNNING if self.steps or self.pending else fake.GenerationStatus.FINISHED

        class Pipe:
            def __init__(self, ir, sc, device, props):
                self.props, self.handles, self.configs = props, [], []
                fake.pipes.append(self)

            def add_request(self, rid, ids, cfg):
                self.configs.append(cfg)
                self.handles.append(Handle(fake.script[rid]))
                return self.handles[-1]

            def step(self):
                for h in self.handles:
                    if h.steps and not h.pending:
                        h.pending = h.steps.pop(0)

        self.ContinuousBatchingPipeline = Pipe

    def draft_model(self, path, device, **kw):
        self.drafts.append((path, device, kw))
        return ("draft", path)


@pytest.fixture
def fake_genai(monkeypatch):
    def make(script):
        g = _FakeGenAI(script)
        mod = types.ModuleType("openvino_genai")
        for name in ("SchedulerConfig", "GenerationConfig", "GenerationStatus", "ContinuousBatchingPipeline",
                     "draft_model"):
            setattr(mod, name, getattr(g, name))
        ov = types.ModuleType("openvino")
        ov.Tensor = lambda a: a
        monkeypatch.setitem(sys.modules, "openvino_genai", mod)
        monkeypatch.setitem(sys.modules, "openvino", ov)
        return g
    return make


def test_openvino_engine_hands_prompt_lookup_to_the_pipeline_and_counts_tokens_per_step(fake_genai):
    # request 0: first token, then steps of 4, 1 and 3 tokens (3 steps, 8 tokens after the first)
    g = fake_genai({0: [[5], [6, 7, 8, 9], [10], [11, 12, 13]]})
    spec = {"pipeline": "prompt_lookup", "num_assistant_tokens": 5, "max_ngram_size": 3}
    eng = openvino_peer.Engine("/ir", 10, 4, 64, "fp32", 2, spec=spec)
    assert g.pipes[0].props["prompt_lookup"] is True and "draft_model" not in g.pipes[0].props
    assert g.pipes[0].props["INFERENCE_PRECISION_HINT"] == "f32"
    q = eng.submit([1, 2, 3], 32, False, 0)
    got = [t for new, _ in eng.tokens(q) for t in new]
    assert got == [5, 6, 7, 8, 9, 10, 11, 12, 13]
    cfg = g.pipes[0].configs[0]
    assert (cfg.num_assistant_tokens, cfg.max_ngram_size, cfg.max_new_tokens) == (5, 3, 32)
    assert eng.stats == {"decode_steps": 3, "decode_tokens": 8}


def test_openvino_engine_gives_the_draft_model_its_own_scheduler_config_and_plain_requests_no_assistant(fake_genai):
    g = fake_genai({0: [[1], [2]]})
    spec = {"pipeline": "draft_model", "num_assistant_tokens": 4, "max_ngram_size": 4, "draft_ir": "/ir-d"}
    eng = openvino_peer.Engine("/ir", 10, 4, 64, "fp32", 2, spec=spec)
    path, device, kw = g.drafts[0]
    assert (path, device, g.pipes[0].props["draft_model"]) == ("/ir-d", "CPU", ("draft", "/ir-d"))
    sc = kw["scheduler_config"]
    assert (sc.num_kv_blocks, sc.max_num_seqs, sc.max_num_batched_tokens, sc.enable_prefix_caching) == \
        (10, 4, 64, False)
    assert kw["KV_CACHE_PRECISION"] == "f32"
    list(eng.tokens(eng.submit([1], 8, False, None)))
    assert g.pipes[0].configs[0].num_assistant_tokens == 4
    assert not hasattr(g.pipes[0].configs[0], "max_ngram_size")
    g2 = fake_genai({0: [[1], [2]]})
    plain = openvino_peer.Engine("/ir", 10, 4, 64, "fp32", 2)
    list(plain.tokens(plain.submit([1], 8, False, None)))
    assert "prompt_lookup" not in g2.pipes[0].props
    assert not hasattr(g2.pipes[0].configs[0], "num_assistant_tokens")
    assert plain.stats == {"decode_steps": 1, "decode_tokens": 1}


def test_openvino_arm_counters_file_extra_tokens_per_step_as_accepted_without_a_proposal_count(monkeypatch):
    class R:
        def json(self):
            return {"decode_steps": 10, "decode_tokens": 34, "speculative": "prompt_lookup"}

    monkeypatch.setattr(spec_decode.requests, "get", lambda url, timeout: R())
    arm = spec_decode.Arm("on", "openvino", "ngram", spec_decode.Server("x", [], "/dev/null", 1))
    c = arm.counters()
    assert c == {"ngram": {"verifies": 10, "accepted": 24}}
    d = spec_decode.delta(c, {})["ngram"]
    assert d["acceptance_rate"] is None and d["mean_tokens_per_verify"] == pytest.approx(3.4)


# ------------------------------------------------------------------ the benchmark's arms and table
def test_disable_by_batch_size_sweep_gives_one_named_arm_per_value():
    base = {"method": "ngram", "num_speculative_tokens": 5}
    assert spec_decode.disable_values("16") == [16]
    assert list(spec_decode.our_specs(base, [16])) == ["on"]
    assert spec_decode.our_specs(base, [16])["on"]["disable_by_batch_size"] == 16
    arms = spec_decode.our_specs(base, spec_decode.disable_values("4,8,0"))
    assert list(arms) == ["on@4", "on@8", "on@never"]
    assert [a.get("disable_by_batch_size") for a in arms.values()] == [4, 8, None]
    assert base == {"method": "ngram", "num_speculative_tokens": 5}     # not mutated
    for bad in ("4,x", "-1", "8,8"):
        with pytest.raises(SystemExit, match="--disable-by-batch-size"):
            spec_decode.disable_values(bad)
    assert spec_decode.arm_order(["off", "on@4", "on@8"], 0) == ["off", "on@4", "on@8"]
    assert spec_decode.arm_order(["off", "on@4", "on@8"], 1) == ["on@8", "on@4", "off"]


def _row(system, arm, tpot, rps, spec=None, clients=1):
    return {"model": "smollm2", "workload": "edit", "clients": clients, "rep": 0, "system": system, "arm": arm,
            "requests": 2, "requests_per_s": rps, "tpot_p50": tpot, "spec": spec or {}}


def test_report_pairs_each_systems_speculative_arm_with_its_own_plain_arm_and_lists_what_was_not_driven():
    results = {"host": {"processor": "EPYC", "machine": "x86_64", "cpus": 2},
               "spec": {"method": "ngram", "num_speculative_tokens": 5},
               "our_arms": {"on@4": {"method": "ngram"}, "on@16": {"method": "ngram"}},
               "peers": {"llamacpp": {"on": {"speculative": {"spec_type": "ngram-simple"}}, "off": {}}},
               "runs": [_row("ours", "off", 0.030, 1.0), _row("ours", "on@4", 0.010, 2.5,
                                                               {"ngram": {"proposed": 10, "accepted": 6,
                                                                          "verifies": 2}}),
                        _row("ours", "on@16", 0.015, 2.0), _row("llamacpp", "off", 0.020, 1.0),
                        _row("llamacpp", "on", 0.016, 1.25, {"ngram": {"proposed": 8, "accepted": 2,
                                                                       "verifies": 4}}),
                        _row("openvino", "off", 0.040, 0.5),
                        _row("openvino", "on", 0.020, 1.0, {"ngram": {"accepted": 9, "verifies": 3}})],
               "not_driven": [{"model": "smollm2", "workload": "chat", "system": "llamacpp",
                               "why": "llama.cpp peer not installed (python -m handler bench install-peer llamacpp)"}]}
    md = spec_decode.report(results)
    table = [ln for ln in md.split("## Not driven")[0].splitlines() if ln.startswith("| smollm2")]
    lines = {tuple(c.strip() for c in ln.split("|")[4:6]): ln for ln in table}
    assert "| 30.0 / 10.0 | 0.33 | 1.00 / 2.50 | 2.50 | 0.60 | 4.00 |" in lines[("ours", "on@4")]
    assert "| 30.0 / 15.0 | 0.50 | 1.00 / 2.00 | 2.00 | - | - |" in lines[("ours", "on@16")]
    assert "| 20.0 / 16.0 | 0.80 | 1.00 / 1.25 | 1.25 | 0.25 | 1.50 |" in lines[("llama.cpp", "on")]
    assert "| 40.0 / 20.0 | 0.50 | 0.50 / 1.00 | 2.00 | - | 4.00 † |" in lines[("OpenVINO GenAI", "on")]
    order = [ln.split("|")[4].strip() for ln in table]
    assert order == ["ours", "ours", "OpenVINO GenAI", "llama.cpp"]
    assert "llama.cpp's speculative arm: `{\"spec_type\": \"ngram-simple\"}`" in md
    assert "## Not driven" in md and "| smollm2 | chat | llama.cpp | llama.cpp peer not installed" in md
    assert "† OpenVINO GenAI's step API" in md


def test_absent_peer_is_reported_as_not_driven_with_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv(openvino_peer.ENV_DIR, str(tmp_path / "no-ov"))
    monkeypatch.setenv(llamacpp_peer.ENV_DIR, str(tmp_path / "no-llama"))
    w = spec_decode.WORKLOADS["edit"]
    with pytest.raises(spec_decode.NotDriven, match="install-peer openvino"):
        spec_decode.openvino_arms("/m", w, "ngram", 5, 4, None, str(tmp_path))
    with pytest.raises(spec_decode.NotDriven, match="install-peer llamacpp"):
        spec_decode.llamacpp_arms("/m", w, "ngram", 5, 2, "ngram-simple", None, str(tmp_path), tok=None)


def test_openvino_front_refuses_a_draft_pipeline_without_its_ir(capsys):
    with pytest.raises(SystemExit) as e:
        openvino_peer.serve(["--ir", "/ir", "--tokenizer", "/m", "--kv-blocks", "4", "--spec", "draft_model"])
    assert e.value.code == 2 and "--spec draft_model needs --draft-ir" in capsys.readouterr().err
