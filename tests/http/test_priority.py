"""A request's `priority` on every API (LMI parameters, OpenAI chat/completions, TGI) and SageMaker's
custom-attributes header, through the real app and engine with the fake runner (test_hardening's)."""
from __future__ import annotations

import pytest

from handler.engine.loop import Engine
from handler.http.routes.common import custom_attributes_priority
from handler.engine.request import RequestError
from tests.http.test_hardening import make_app
from tests.support.server import flat_metrics

HEADER = "X-Amzn-SageMaker-Custom-Attributes"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
BODIES = {   # route -> (body with priority p, the name the 400 gives the field)
    "/invocations": (lambda p: {"inputs": "hello", "parameters": {"max_new_tokens": 3, "priority": p}},
                     "parameters.priority"),
    "/generate": (lambda p: {"inputs": "hello", "parameters": {"max_new_tokens": 3, "priority": p}},
                  "parameters.priority"),
    "/v1/completions": (lambda p: {"prompt": "hello", "max_tokens": 3, "priority": p}, "priority"),
    "/v1/chat/completions": (lambda p: {**CHAT, "priority": p}, "priority"),
    "/invocations chat": (lambda p: {**CHAT, "priority": p}, "priority"),
}


@pytest.fixture(scope="module")
def servers(demo_model_dir, tmp_path_factory):
    made = {name: make_app(demo_model_dir, tmp_path_factory.mktemp(name), props)
            for name, props in (("fcfs", "option.rolling_batch=auto\n"),
                                ("priority", "option.rolling_batch=auto\noption.scheduling_policy=priority\n"))}
    yield {k: v[1] for k, v in made.items()}
    for state, _ in made.values():
        state.engine.shutdown()


@pytest.fixture
def submitted(monkeypatch):
    """The priority of every request the engine receives."""
    seen = []
    real = Engine.submit

    def spy(self, prompts_ids, params, stream=True):
        seen.append(params.priority)
        return real(self, prompts_ids, params, stream)
    monkeypatch.setattr(Engine, "submit", spy)
    return seen


def post(client, route, body, headers=None):
    return client.post(route.split()[0], json=body, headers=headers or {})


def field_of(r) -> str:
    body = r.get_json()
    return body.get("field") or body.get("error", {}).get("param") or body.get("error_type", "")


@pytest.mark.parametrize("route", list(BODIES))
def test_priority_reaches_the_engine_on_every_api(route, servers, submitted):
    make, _ = BODIES[route]
    r = post(servers["priority"], route, make(-3))
    assert r.status_code == 200, r.get_data(as_text=True)
    assert submitted == [-3]


@pytest.mark.parametrize("route", list(BODIES))
def test_a_non_integer_priority_is_a_400_naming_the_field(route, servers, submitted):
    make, field = BODIES[route]
    # /invocations under option.lmi_compat=current coerces as LMI's pydantic models do in lax mode ("1"
    # and true are 1: tests/http/test_lmi_compat.py); the other APIs take JSON integers only.
    lax = route.startswith("/invocations")
    for bad in ((1.5, [1], 2**40) if lax else ("1", 1.5, True, [1], 2**40)):
        r = post(servers["priority"], route, make(bad))
        assert r.status_code in (400, 422), (bad, r.get_data(as_text=True))
        assert field in r.get_data(as_text=True), (bad, r.get_data(as_text=True))
    assert submitted == []


@pytest.mark.parametrize("route", list(BODIES))
def test_priority_on_an_fcfs_server_is_refused_naming_the_field(route, servers, submitted):
    make, field = BODIES[route]
    r = post(servers["fcfs"], route, make(2))
    assert r.status_code in (400, 422)
    text = r.get_data(as_text=True)
    assert field in text and "option.scheduling_policy=priority" in text
    assert post(servers["fcfs"], route, make(0)).status_code == 200      # the default is fine
    assert submitted == [0]


def test_the_custom_attributes_header_sets_the_priority(servers, submitted):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
    for value in ("priority=4", "trace=abc; Priority = 4", "a=1,priority=4"):
        assert post(servers["priority"], "/invocations", body, {HEADER: value}).status_code == 200
    assert post(servers["priority"], "/v1/chat/completions", CHAT, {HEADER: "priority=4"}).status_code == 200
    messages = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}   # Anthropic's
    assert post(servers["priority"], "/v1/messages", messages, {HEADER: "priority=4"}).status_code == 200
    # The body's own field wins over the header; other attributes alone change nothing.
    with_field = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "priority": 1}}
    assert post(servers["priority"], "/invocations", with_field, {HEADER: "priority=4"}).status_code == 200
    assert post(servers["priority"], "/invocations", body, {HEADER: "tenant=7"}).status_code == 200
    assert submitted == [4, 4, 4, 4, 4, 1, 0]


def test_a_bad_or_unwelcome_header_priority_is_a_400_naming_the_header(servers, submitted):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
    r = post(servers["priority"], "/invocations", body, {HEADER: "priority=high"})
    assert r.status_code == 400 and r.get_json()["field"] == f"{HEADER}: priority"
    assert "must be an integer" in r.get_json()["error"]
    r = post(servers["fcfs"], "/invocations", body, {HEADER: "priority=2"})
    assert r.status_code == 400 and r.get_json()["field"] == f"{HEADER}: priority"
    assert submitted == []


def test_custom_attributes_parsing():
    assert custom_attributes_priority(None) is None
    assert custom_attributes_priority("") is None
    assert custom_attributes_priority("priorityx=3;x=priority=2") is None
    assert custom_attributes_priority(" priority=-2 ") == -2
    assert custom_attributes_priority("a=b;PRIORITY=+7,c") == 7
    for bad in ("priority=", "priority=1.0", "priority=99999999999", "priority=0x10"):
        with pytest.raises(RequestError, match="priority"):
            custom_attributes_priority(bad)


def test_metrics_count_queue_time_by_priority_and_preemptions_by_cause(servers):
    client = servers["priority"]
    before = flat_metrics(client.get("/metrics").get_data(as_text=True))
    key = 'lmi_request_queue_time_by_priority_seconds_count{priority="-5"}'
    assert post(client, "/invocations", BODIES["/invocations"][0](-5)).status_code == 200
    after = flat_metrics(client.get("/metrics").get_data(as_text=True))
    assert after[key] == before.get(key, 0) + 1
    assert {k for k in after if k.startswith("lmi_preemptions_by_cause_total")} == {
        'lmi_preemptions_by_cause_total{cause="kv_cache"}', 'lmi_preemptions_by_cause_total{cause="priority"}'}
