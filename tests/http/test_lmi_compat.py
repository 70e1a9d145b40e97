"""option.lmi_compat's request behaviours on /invocations, through Flask's test client against the real app
and engine with a fake runner (tests/http/test_hardening.py's make_app): today's LMI bodies (the request
schema page's, djl-serving serving/docs/lmi/user_guides/lmi_input_output_schema.md and
chat_input_output_schema.md) answered as current LMI does, and as 0.31 did with option.lmi_compat=0.31.

Current LMI (djl_python/lmi_vllm/vllm_async_service.py@HEAD:282-317): `prompt` -> OpenAI Completions,
`inputs` -> LMI's schema read by vLLM's lax pydantic models, `messages` -> Chat Completions with no
max_tokens meaning the model's length; sampling inferred from the parameters (LMI >= 0.32)."""
from __future__ import annotations

import json

import pytest

from handler.engine.request import RequestError, parse_params
from handler.http.protocols import lmi
from tests.http.test_hardening import assert_json_error, make_app

MAX_MODEL_LEN = 96      # the fake model never ends a sequence: a chat without max_tokens runs to here


@pytest.fixture(scope="module")
def apps(demo_model_factory, tmp_path_factory):
    """line -> (state, client): one app per LMI line, shared by the module."""
    model_dir = demo_model_factory("llama")
    made = {}
    for line in ("current", "0.31"):
        made[line] = make_app(model_dir, tmp_path_factory.mktemp(line.replace(".", "_")),
                              f"option.lmi_compat={line}\n", max_model_len=MAX_MODEL_LEN)
    yield made
    for state, _ in made.values():
        state.engine.runner.hold.set()
        state.engine.shutdown()


def _post(client, body):
    return client.post("/invocations", data=json.dumps(body), content_type="application/json")


def _last_params(state):
    """The SamplingParams the engine ran the last request's sequence with."""
    return state.engine.runner.calls[-1][0].params


def test_both_apps_run_the_paged_engine_by_default(apps):
    for line, (state, _) in apps.items():
        assert (state.cfg.lmi_compat, state.cfg.strategy, state.cfg.max_rolling_batch_size) == (line, "paged", 256)


# ---- sampling without do_sample ------------------------------------------------------------
@pytest.mark.parametrize("params, sampled", [
    ({}, False),                                   # a bare request stays greedy (LMI's do_sample default)
    ({"temperature": 0.7}, True),
    ({"top_p": 0.9}, True),
    ({"top_k": 40}, True),
    ({"min_p": 0.05}, True),
    ({"typical_p": 0.5}, True),
    ({"temperature": 0.0}, False),                 # temperature 0 is greedy
    ({"top_p": 1.0, "top_k": -1}, False),          # values that do not sample
    ({"top_k": 1}, False),
    ({"do_sample": False, "temperature": 0.7}, False),   # an explicit do_sample wins
])
def test_sampling_is_inferred_from_the_parameters(params, sampled):
    assert parse_params(params, infer_sampling=True).do_sample is sampled
    assert parse_params(params).do_sample is ("do_sample" in params and params["do_sample"])


def test_sampling_without_do_sample_reaches_the_engine(apps):
    body = {"inputs": "What is Deep Learning?", "parameters": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 4}}
    for line, sampled in (("current", True), ("0.31", False)):
        state, client = apps[line]
        r = _post(client, body)
        assert r.status_code == 200, r.get_data(as_text=True)
        p = _last_params(state)
        assert (p.do_sample, p.temperature, p.top_p, p.greedy) == (sampled, 0.7, 0.9, not sampled), line


# ---- numbers as LMI's (vLLM's) lax models read them ----------------------------------------
@pytest.mark.parametrize("given, field, value", [
    ({"max_new_tokens": "5"}, "max_new_tokens", 5),
    ({"max_new_tokens": 5.0}, "max_new_tokens", 5),
    ({"max_tokens": "6"}, "max_new_tokens", 6),
    ({"top_k": "40", "do_sample": "true"}, "top_k", 40),
    ({"top_k": 40.0}, "top_k", 40),
    ({"temperature": "0.5"}, "temperature", 0.5),
    ({"seed": "7"}, "seed", 7),
    ({"details": "true"}, "details", True),
])
def test_lax_numbers(given, field, value):
    assert getattr(parse_params(given, lax=True), field) == value
    with pytest.raises(RequestError) as e:             # strict (0.31, 0.26): a 400 naming the field
        parse_params(given)
    assert e.value.field == f"parameters.{next(iter(given))}"


@pytest.mark.parametrize("given, field", [({"max_new_tokens": 5.5}, "parameters.max_new_tokens"),
                                          ({"max_new_tokens": "five"}, "parameters.max_new_tokens"),
                                          ({"top_k": "4.5"}, "parameters.top_k"),
                                          ({"max_new_tokens": "0"}, "parameters.max_new_tokens")])
def test_lax_numbers_still_refuse_what_is_not_one(given, field):
    with pytest.raises(RequestError) as e:
        parse_params(given, lax=True)
    assert e.value.field == field


def test_lax_numbers_on_invocations(apps):
    body = {"inputs": "What is Deep Learning?", "parameters": {"max_new_tokens": "5", "details": True}}
    state, client = apps["current"]
    r = _post(client, body)
    assert r.status_code == 200, r.get_data(as_text=True)
    assert r.get_json()["details"]["generated_tokens"] == 5
    _, old = apps["0.31"]
    e = assert_json_error(_post(old, body), 400)
    assert e["field"] == "parameters.max_new_tokens" and "integer" in e["error"]
    # a chat body's numbers too (vLLM's ChatCompletionRequest)
    r = _post(client, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"})
    assert r.status_code == 200 and r.get_json()["usage"]["completion_tokens"] == 3


# ---- the body's shape picks the API -------------------------------------------------------
def test_prompt_body_is_a_completion(apps):
    body = {"prompt": "What is Deep Learning?", "max_tokens": 7}
    _, client = apps["current"]
    r = _post(client, body)
    assert r.status_code == 200, r.get_data(as_text=True)
    out = r.get_json()
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 7
    assert isinstance(out["choices"][0]["text"], str) and out["choices"][0]["finish_reason"] == "length"
    # Streamed: jsonlines of completion chunks (as LMI strips vLLM's `data: `), the usage last when asked.
    r = _post(client, {**body, "stream": True, "stream_options": {"include_usage": True}})
    lines = [json.loads(x) for x in r.get_data(as_text=True).splitlines() if x.strip()]
    assert r.mimetype == "application/jsonlines"
    assert all(x["object"] == "text_completion" for x in lines)
    assert lines[-1]["usage"]["completion_tokens"] == 7
    assert "".join(c["text"] for x in lines for c in x["choices"]) == out["choices"][0]["text"]   # greedy: same text
    # LMI 0.31: LMI's schema only, so `inputs` is required.
    _, old = apps["0.31"]
    assert assert_json_error(_post(old, body), 400)["field"] == "inputs"


def test_prompt_body_errors_name_the_field(apps):
    _, client = apps["current"]
    e = assert_json_error(_post(client, {"prompt": ["a", 3]}), 400)
    assert e["field"] == "prompt"
    e = assert_json_error(_post(client, {"prompt": "a", "max_tokens": -1}), 400)
    assert e["field"] == "max_tokens"


def test_chat_without_max_tokens_runs_to_the_context_limit(apps):
    body = {"messages": [{"role": "user", "content": "What is Deep Learning?"}]}     # chat schema page, no max_tokens
    for line in ("current", "0.31"):
        _, client = apps[line]
        r = _post(client, body)
        assert r.status_code == 200, r.get_data(as_text=True)
        usage = r.get_json()["usage"]
        want = MAX_MODEL_LEN - usage["prompt_tokens"] if line == "current" else 30
        assert usage["completion_tokens"] == want, line
        assert r.get_json()["choices"][0]["finish_reason"] == "length"


def test_inputs_still_win_over_nothing_and_messages_keep_chat(apps):
    # The schema page's own example (do_sample, details, stream) is answered as before on both lines.
    body = {"inputs": "What is Deep Learning?", "parameters": {"do_sample": True, "max_new_tokens": 6, "details": True}}
    for line in ("current", "0.31"):
        state, client = apps[line]
        r = _post(client, body)
        assert r.status_code == 200 and r.get_json()["details"]["generated_tokens"] == 6
        assert _last_params(state).do_sample
        lines = [json.loads(x) for x in _post(client, {**body, "stream": True}).get_data(as_text=True).splitlines()]
        assert lines[-1]["details"]["generated_tokens"] == 6 and "token" in lines[0]


def test_lmi_parse_passes_the_line_through():
    g = lmi.parse({"inputs": "x", "parameters": {"temperature": 0.5, "max_new_tokens": "3"}}, lax=True,
                  infer_sampling=True)
    assert (g.params.do_sample, g.params.max_new_tokens) == (True, 3)
