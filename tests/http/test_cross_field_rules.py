"""docs/API.md "Rules across fields": each is a 400 naming its field. Those JSON Schema can state are in
/openapi.json too (a body breaking one is invalid against the document, its repair valid); the others
(comparisons between values) are excused in the fuzzer's hook only when the body really breaks them."""
from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from handler.engine.request import RequestError, parse_params
from handler.http.protocols import lmi, openai, openapi, tgi
from tests.http.test_agent_parse import MSG, Tok


def _valid(schema: str, body: dict) -> bool:
    doc = openapi.document()
    v = Draft202012Validator({"$ref": f"#/components/schemas/{schema}", "components": doc["components"]})
    return v.is_valid(body)


def _refused(parse, body) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body, Tok())
    assert e.value.status == 400 and "\n" not in e.value.message
    return e.value


CHAT = {"messages": MSG}
PROMPT = {"prompt": "x"}


@pytest.mark.parametrize("schema,parse,body,field,repair", [
    ("ChatCompletionRequest", openai.parse_chat, {**CHAT, "top_logprobs": 2}, "top_logprobs", {"logprobs": True}),
    ("ChatCompletionRequest", openai.parse_chat, {**CHAT, "stream": True, "prompt_logprobs": 1}, "stream",
     {"stream": False}),
    ("ChatCompletionRequest", openai.parse_chat, {**CHAT, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs.tokenize", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("ChatCompletionRequest", openai.parse_chat, {**CHAT, "chat_template_kwargs": {"a-b": 1}},
     "chat_template_kwargs.a-b", {"chat_template_kwargs": {"a_b": 1}}),
    ("CompletionRequest", openai.parse_completion, {**PROMPT, "max_tokens": 0}, "max_tokens", {"echo": True}),
    ("CompletionRequest", openai.parse_completion, {**PROMPT, "max_tokens": 0, "echo": True, "stream": True},
     "stream", {"stream": False}),
    ("CompletionRequest", openai.parse_completion, {**PROMPT, "echo": True, "logprobs": 1, "stream": True},
     "stream", {"logprobs": None}),
    ("CompletionRequest", openai.parse_completion, {**PROMPT, "prompt_logprobs": 1, "stream": True}, "stream",
     {"prompt_logprobs": None}),
    ("LMIRequest", lambda b, tok: lmi.parse(b), {"inputs": ["a", "b"], "stream": True}, "stream", {"inputs": "a"}),
    ("TGIRequest", lambda b, tok: tgi.parse(b), {"inputs": "a", "stream": True, "parameters": {"n": 2}},
     "parameters.n", {"stream": False}),
    ("LMIRequest", lambda b, tok: lmi.parse(b), {"inputs": "a", "stream": True, "parameters": {"best_of": 2}},
     "parameters.best_of", {"parameters": {"best_of": 1}}),
    ("TGIStreamRequest", lambda b, tok: tgi.parse(b, stream=True), {"inputs": "a", "parameters": {"best_of": 2}},
     "parameters.best_of", {"parameters": {"best_of": 1}}),
])
def test_rules_the_document_states(schema, parse, body, field, repair):
    assert _refused(parse, body).field == field
    assert not _valid(schema, body)
    fixed = {**body, **repair}
    assert _valid(schema, fixed)
    parse(fixed, Tok())


def _answer(e: RequestError) -> str:
    return json.dumps(openai.error_body(e.status, e.message, e.field))


@pytest.mark.parametrize("path,parse,broken,kept", [
    ("/invocations", lambda b, tok: parse_params(b["parameters"]),
     {"parameters": {"min_tokens": 5, "max_new_tokens": 3}},
     {"parameters": {"min_tokens": 3, "max_new_tokens": 3}}),
    ("/v1/completions", openai.parse_completion, {**PROMPT, "best_of": 2, "stream": True},
     {**PROMPT, "best_of": 2, "n": 2, "stream": True}),
    ("/invocations", lambda b, tok: lmi.parse(b), {"inputs": ["a", "b"], "adapters": ["x"]},
     {"inputs": ["a", "b"], "adapters": ["x", "x"]}),
    ("/invocations", lambda b, tok: parse_params(b["parameters"]), {"parameters": {"min_tokens": 40}},
     {"parameters": {"min_tokens": 40, "max_new_tokens": 40}}),    # the default max_new_tokens: 30
])
def test_the_fuzzers_exceptions_are_narrow(path, parse, broken, kept):
    hooks = pytest.importorskip("tests.support.fuzz_hooks", reason="the fuzzer: pip install -e '.[dev]'")
    refusal = _answer(_refused(parse, broken))
    assert hooks.excused(path, broken, 400, refusal)
    parse(kept, Tok())                  # the body that keeps the rule is accepted ...
    assert hooks.excused(path, kept, 400, refusal) is None   # ... so the same refusal of it is not excused
    assert hooks.excused(path, broken, 500, refusal) is None
    other = _answer(RequestError("temperature", "must be in [0, 2], got 3"))
    assert hooks.excused(path, broken, 400, other) is None


@pytest.mark.parametrize("params", [
    {"ignore_eos": 0}, {"ignore_eos_token": "yes"}, {"do_sample": "true"}, {"max_new_tokens": "5"},
    {"temperature": "0.5"}, {"top_k": "40"},
    {"ignore_eos": "maybe"}, {"ignore_eos": 2}, {"max_new_tokens": "x"}, {"max_new_tokens": "0"},
    {"temperature": "hot"}, {"max_new_tokens": "2.5"}, {"priority": False}, {"top_k": True},
    {"max_new_tokens": True}, {"temperature": True}, {"seed": False},
])
def test_the_lax_line_exception_is_what_the_lax_parser_takes(params):
    """The fuzzer excuses a schema-invalid /invocations body the server accepts only when its parameters,
    read as the lax line reads them, are valid: that is, when the lax parser really takes them."""
    hooks = pytest.importorskip("tests.support.fuzz_hooks", reason="the fuzzer: pip install -e '.[dev]'")
    body = {"inputs": "x", "parameters": params}
    try:
        lmi.parse(body, lax=True)
        taken = True
    except RequestError:
        taken = False
    assert hooks.lax_valid(openapi.document(1000, 64), body) == taken
    assert not _valid("LMIRequest", body)           # each is outside the strict document


def test_tool_choice_exception():
    hooks = pytest.importorskip("tests.support.fuzz_hooks", reason="the fuzzer: pip install -e '.[dev]'")
    tools = [{"name": "f", "input_schema": {}}]
    assert hooks._tool_choice("/v1/messages", {"tools": tools}, "")              # auto, implicitly
    assert not hooks._tool_choice("/v1/messages", {"tools": tools, "tool_choice": {"type": "none"}}, "")
    assert hooks._tool_choice("/v1/chat/completions", {"tool_choice": "required"}, "")   # no tools
    assert not hooks._tool_choice("/v1/chat/completions", {}, "")


def test_structured_outputs_holds_exactly_one_constraint():
    from handler.engine import guide
    for value, field in (({"regex": "a", "choice": ["x"]}, "structured_outputs"), ({}, "structured_outputs"),
                         ({"json_object": {}}, "structured_outputs.json_object")):
        with pytest.raises(RequestError) as e:
            guide.structured_outputs("structured_outputs", value)
        assert e.value.field == field
        assert not _valid("CompletionRequest", {**PROMPT, "structured_outputs": value})
    for value in ({"regex": "a", "json_object": False, "choice": None}, {"json_object": True}, {"json": True}):
        guide.structured_outputs("structured_outputs", value)
        assert _valid("CompletionRequest", {**PROMPT, "structured_outputs": value})
