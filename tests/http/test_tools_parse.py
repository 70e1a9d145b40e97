"""OpenAI tool calling without a model (handler/http/protocols/tools.py): tool_choice -> the
constraint, outputs -> tool_calls, and streamed deltas that add up to the same calls."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from handler.engine.request import RequestError
from handler.http.protocols import tools

FN = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FN2 = {"type": "function", "function": {"name": "get_time"}}
HERMES = SimpleNamespace(chat_template="{% if tools %}<tools>{{ tools }}</tools> Reply with <tool_call>"
                                       "{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}")
PLAIN = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")


def test_choices_and_their_constraints():
    t = tools.parse({"tools": [FN, FN2], "tool_choice": "required"}, PLAIN)
    schema = json.loads(tools.constraint(t).value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [a["properties"]["name"]["const"] for a in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    t = tools.parse({"tools": [FN, FN2], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                    PLAIN)
    assert json.loads(tools.constraint(t).value) == FN["function"]["parameters"]
    assert [x["function"]["name"] for x in t.template_tools()] == ["get_weather"]
    assert not tools.parse({"tools": [FN], "tool_choice": "none"}, PLAIN).active
    auto = tools.parse({"tools": [FN]}, HERMES)
    assert auto.choice == "auto" and auto.fmt == "hermes" and tools.constraint(auto) is None


@pytest.mark.parametrize("body,field", [
    ({"tools": [FN]}, "tool_choice"),                                   # auto, and no format documented
    ({"tools": [FN], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [FN, FN]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
])
def test_errors_name_the_field(body, field):
    with pytest.raises(RequestError) as e:
        tools.parse(body, PLAIN)
    assert e.value.field == field


def test_outputs_become_calls():
    req = tools.parse({"tools": [FN, FN2], "tool_choice": "required"}, PLAIN)
    content, calls = tools.parse_output(req, '[{"name": "get_time", "arguments": {}}, '
                                             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in calls}) == 2
    assert tools.parse_output(req, '[{"name": "get_ti') == ('[{"name": "get_ti', [])      # cut by max_tokens
    auto = tools.parse({"tools": [FN]}, HERMES)
    content, calls = tools.parse_output(auto, 'Let me look.\n<tool_call>\n{"name": "get_weather", '
                                              '"arguments": {"city": "Oslo"}}\n</tool_call>')
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert tools.parse_output(auto, "Just text.") == ("Just text.", [])


@pytest.mark.parametrize("choice,text", [
    ("auto", 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'),
    ("auto", "No call here, <tool but not a call"),
    ("required", '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Rome"}'),
])
def test_streamed_deltas_add_up_to_the_whole_answer(choice, text):
    req = tools.parse({"tools": [FN], "tool_choice": choice}, HERMES)
    want_content, want_calls = tools.parse_output(req, text)
    st = tools.Streamer(req)
    deltas = []
    for k in range(0, len(text), 3):        # three characters a token
        deltas += st.feed(text[k:k + 3])
    last, called = st.finish()
    deltas += last
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            acc = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            acc["name"] += tc.get("function", {}).get("name", "")
            acc["arguments"] += tc.get("function", {}).get("arguments", "")
    assert called == bool(want_calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls]
    assert content.strip() == (want_content or "").strip()
