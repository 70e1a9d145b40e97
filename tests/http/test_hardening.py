"""Hostile input and overload at the HTTP layer, through Flask's test client against
the real app and engine with a fake model runner (a deterministic function of each sequence's own
tokens), so that thousands of requests fit in CI time. The real server: test_server_hardening.py."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings, strategies as st

from handler.http.app import ServerState, create_app, running_width
from handler.config import load_config
from handler.engine.loop import Engine
from handler.engine.scheduler import SchedulerPolicy
from tests.support.fakes import FakeRunner, history_hash
from tests.support.server import flat_metrics
from tests.support.hostile import _body, _bounded


class CountingTokenizer:
    """The real tokenizer, counting encodes (what a refusal must never reach)."""

    def __init__(self, tok):
        self._tok, self.calls = tok, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self._tok(*a, **kw)

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


class Boom:
    """A request body that must never be read."""

    def read(self, *a):
        raise AssertionError("the body was read")

    readline = read


class Endless:
    """A body (no Content-Length) that never ends; counts what was read."""

    def __init__(self):
        self.read_bytes = 0

    def read(self, n=-1):
        n = 1 << 16 if n is None or n < 0 else n
        self.read_bytes += n
        return b"x" * n


class Truncated:
    """A client that hangs up after a few bytes of its declared body."""

    def __init__(self, data):
        self.data = data

    def read(self, n=-1):
        d, self.data = self.data, b""
        return d


def post_stream(client, stream, content_length: str = "", **kw):
    """POST whose body is read from `stream` (Content-Length as given; "" for a chunked body)."""
    return client.post("/invocations", content_type="application/json",
                       environ_overrides={"wsgi.input": stream, "CONTENT_LENGTH": content_length}, **kw)


class BufferedClient(FlaskClient):
    """Reads each response whole and closes it, as gunicorn does after sending (that is when
    the app's admission counter lets the request go)."""

    def open(self, *a, **kw):
        kw.setdefault("buffered", True)
        return super().open(*a, **kw)


_TOKENIZERS = {}


def make_app(model_dir, tmp_path, props="option.rolling_batch=auto\n", max_model_len=64):
    from transformers import AutoTokenizer

    path = os.path.join(str(tmp_path), "serving.properties")
    with open(path, "w") as f:
        f.write(props)
    cfg = load_config(path, model_dir, env={})
    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    tok = CountingTokenizer(_TOKENIZERS[model_dir])
    # The next token: a hash of the sequence's own history, among the tokenizer's plain tokens.
    first = min(tok.all_special_ids or [0]) + 300
    span = len(tok) - first - 1
    runner = FakeRunner(cfg.block_size, lambda toks: first + history_hash(toks) % span,
                        tokenizer=tok, logprob=-1.0)
    policy = SchedulerPolicy(cfg.strategy, max_batch_size=running_width(cfg),
                             max_batch_delay_s=cfg.max_batch_delay_ms / 1000.0,
                             prefill_token_budget=cfg.max_rolling_batch_prefill_tokens,
                             max_waiting=cfg.job_queue_size, max_model_len=max_model_len)
    state = ServerState(cfg)
    state.engine = Engine(runner, policy, cfg.block_size, cfg.enable_prefix_caching).start()
    app = create_app(state)
    app.test_client_class = BufferedClient
    return state, app.test_client()


@pytest.fixture
def served(demo_model_dir, tmp_path):
    made = []

    def make(*a, **kw):
        made.append(make_app(demo_model_dir, tmp_path, *a, **kw))
        return made[-1]

    yield make
    for state, _ in made:
        state.engine.runner.hold.set()
        state.engine.shutdown()


def metrics(client) -> dict:
    return flat_metrics(client.get("/metrics").get_data(as_text=True))


def assert_json_error(r, status):
    assert r.status_code == status, r.get_data(as_text=True)[:500]
    body = r.get_json()
    assert body["code"] == status and isinstance(body["error"], str) and body["error"]
    return body


def wait_for(pred, timeout=30.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


# ---- finding 2: body size, prompt length before tokenizing --------------------------------
def test_declared_body_over_the_limit_is_413_before_reading(served):
    state, client = served()
    assert client.get("/execution-parameters").get_json()["MaxPayloadInMB"] == 6   # the default
    r = post_stream(client, Boom(), str(6_000_001))
    assert "6000000 bytes" in assert_json_error(r, 413)["error"]
    assert state.engine.tokenizer.calls == 0


def test_unbounded_chunked_body_is_cut_at_the_limit(served):
    state, client = served("option.rolling_batch=auto\noption.max_payload_mb=0.5\n")
    assert client.get("/execution-parameters").get_json()["MaxPayloadInMB"] == 0.5
    body = Endless()
    r = post_stream(client, body)
    assert_json_error(r, 413)
    assert 500_000 < body.read_bytes <= 500_000 + (1 << 16)
    assert client.post("/invocations", json={"inputs": "x" * 400_000}).status_code != 413


def test_prompt_longer_than_any_tokenization_can_fit_is_refused_without_tokenizing(served):
    state, client = served(max_model_len=64)
    longest = max(len(t) for t in state.engine.tokenizer.get_vocab())
    r = client.post("/invocations", json={"inputs": ["ok", "a" * (4 * 64 * longest + 1)]})
    body = assert_json_error(r, 400)
    assert body["field"] == "inputs[1]" and "64 tokens" in body["error"]
    assert state.engine.tokenizer.calls == 0


# ---- finding 3: client errors that were 500s ------------------------------------------------
@pytest.mark.parametrize("body,field", [
    (b'{"inputs": "abc\\ud800def"}', "inputs"),
    (b'{"inputs": ["fine", "\\udfff"]}', "inputs[1]"),
])
def test_lone_surrogates_are_400_naming_the_input(served, body, field):
    state, client = served()
    r = client.post("/invocations", data=body, content_type="application/json")
    assert assert_json_error(r, 400)["field"] == field
    assert state.engine.tokenizer.calls == 0


def test_an_error_echoing_a_lone_surrogate_is_a_json_400(served):
    # The bad value is quoted back in the message; a lone surrogate cannot be UTF-8 encoded.
    _, client = served()
    r = client.post("/invocations", data=b'{"inputs": "a", "parameters": {"top_k": "\\ud800"}}',
                    content_type="application/json")
    body = assert_json_error(r, 400)
    assert body["field"] == "parameters.top_k" and "\ud800" in body["error"]


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"inputs": "a", "parameters": ' + b'{"a": ' * 50_000],
                         ids=["arrays", "objects"])
def test_deeply_nested_json_is_400(served, body):
    _, client = served()
    assert assert_json_error(client.post("/invocations", data=body, content_type="application/json"),
                             400)["field"] == "body"


def test_openapi_document_is_served_and_its_bounds_are_the_ones_enforced(served):
    _, client = served()
    r = client.get("/openapi.json")
    assert r.status_code == 200 and r.mimetype == "application/json"
    props = r.get_json()["components"]["schemas"]["Parameters"]["properties"]
    top = props["max_new_tokens"]["anyOf"][0]["maximum"]        # the loaded model's length, less the prompt's one
    _, null = props["max_new_tokens"]["anyOf"]
    assert null == {"type": "null"}
    body = {"inputs": "x", "parameters": {"max_new_tokens": top + 1}}
    err = assert_json_error(client.post("/invocations", json=body), 400)
    assert err["field"] == "parameters.max_new_tokens"
    assert f"exceeds this model's {top + 1} tokens" in err["error"]


def test_framework_errors_are_json(served):
    _, client = served()
    assert_json_error(client.get("/invocations"), 405)
    assert_json_error(client.post("/nowhere"), 404)
    assert_json_error(client.delete("/ping"), 405)


# ---- finding 5: refusals before any work; a queue exactly at capacity admits ---------------
def test_queue_exactly_at_capacity_admits_and_the_next_is_refused_before_parsing(served):
    # 2 running slots + 1 waiting place: capacity 3.
    state, client = served("option.rolling_batch=auto\noption.max_rolling_batch_size=2\njob_queue_size=1\n")
    runner = state.engine.runner
    runner.hold.clear()
    results = []

    def post(text):
        results.append(client.post("/invocations", json={"inputs": text,
                                                         "parameters": {"max_new_tokens": 3}}))

    threads = [threading.Thread(target=post, args=("first",))]
    threads[0].start()
    assert runner.in_step.wait(30)          # the engine is inside a step with one sequence
    for text in ("second", "third"):         # both arrive while that step runs
        threads.append(threading.Thread(target=post, args=(text,)))
        threads[-1].start()
    assert wait_for(lambda: state.admission.inside == 3 and state.engine.tokenizer.calls == 3)
    calls = state.engine.tokenizer.calls
    r = post_stream(client, Boom(), "30")
    assert "job_queue_size" in assert_json_error(r, 503)["error"]
    assert state.engine.tokenizer.calls == calls           # refused before parsing or tokenizing
    runner.hold.set()
    for t in threads:
        t.join(30)
    assert [r.status_code for r in results] == [200, 200, 200], [r.get_json() for r in results]
    assert metrics(client)["lmi_rejected_queue_full_total"] == 1
    assert state.admission.inside == 0


# ---- finding 6: disconnects apart from server errors; prefix-cache occupancy -----------------
def test_client_disconnects_are_counted_apart_from_server_errors(served):
    state, client = served()
    r = post_stream(client, Truncated(b'{"inputs": "a'), "1000")
    assert r.status_code == 400
    r = client.post("/invocations", json={"inputs": "x", "stream": True,
                                          "parameters": {"max_new_tokens": 60, "ignore_eos": True}},
                    buffered=False)
    next(r.response)                                     # one token, then the client goes away
    r.close()
    m = metrics(client)
    assert m["lmi_http_client_disconnects_total"] == 2
    assert m['lmi_http_responses_total{class="other"}'] == 0
    assert wait_for(lambda: metrics(client)["lmi_running"] == 0 and state.admission.inside == 0)


def test_prefix_cache_occupancy_is_exported(served):
    state, client = served("option.rolling_batch=auto\noption.enable_prefix_caching=true\noption.block_size=4\n")
    assert metrics(client)["lmi_prefix_cache_blocks_cached"] == 0
    prompt = "def add(a, b):\n    return a + b\n"
    n = len(state.engine.tokenizer(prompt)["input_ids"])
    r = client.post("/invocations", json={"inputs": prompt, "parameters": {"max_new_tokens": 5, "ignore_eos": True}})
    assert r.status_code == 200
    # Every full block of the computed tokens (prompt + 4 fed-back outputs) is cached, none in use.
    full = (n + 5 - 1) // 4
    assert wait_for(lambda: metrics(client)["lmi_running"] == 0)
    m = metrics(client)
    assert m["lmi_prefix_cache_blocks_cached"] == full
    assert m["lmi_prefix_cache_blocks_evictable"] == full
    assert m["lmi_kv_tokens_allocated"] == 0


def check_answer(r):
    assert r.status_code < 500, r.get_data(as_text=True)[:500]
    if r.status_code >= 400:
        assert_json_error(r, r.status_code)
    elif r.mimetype == "application/json":
        r.get_json()
    else:
        for line in r.get_data(as_text=True).splitlines():
            json.loads(line)


@pytest.fixture
def fuzz_target(served):
    state, client = served("option.rolling_batch=auto\noption.max_payload_mb=0.05\n")
    mate_params = {"max_new_tokens": 40, "ignore_eos": True, "details": True}
    alone = client.post("/invocations", json={"inputs": "the batch mate", "parameters": mate_params}).get_json()
    box = {}
    stop = threading.Event()

    def mate():                    # an innocent request running all through the fuzz
        n = 0
        while not stop.is_set():
            r = client.post("/invocations", json={"inputs": "the batch mate", "parameters": mate_params})
            box.setdefault("answers", []).append((r.status_code, r.get_json()))
            n += 1

    t = threading.Thread(target=mate)
    t.start()
    yield client
    stop.set()
    t.join(60)
    assert box["answers"] and all(a == (200, alone) for a in box["answers"])
    assert client.get("/ping").status_code == 200
    assert wait_for(lambda: metrics(client)["lmi_kv_tokens_allocated"] == 0)
    assert state.admission.inside == 0


def test_fuzz_request_schema_and_raw_bytes(fuzz_target):
    client = fuzz_target
    cases = {"schema": 0, "raw": 0}

    @settings(max_examples=1500, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_body.map(_bounded))
    def schema(body):
        cases["schema"] += 1
        check_answer(client.post("/invocations", data=json.dumps(body), content_type="application/json"))

    @settings(max_examples=700, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=300) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
           st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8",
                            "application/octet-stream", ""]))
    def raw(data, ctype):
        cases["raw"] += 1
        check_answer(client.post("/invocations", data=data, content_type=ctype or None))

    schema()
    raw()
    assert cases["schema"] >= 1000 and cases["raw"] >= 500
