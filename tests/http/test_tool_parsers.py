"""Tool-call parsers per family (handler/http/protocols/tool_parsers.py), their detection from chat
templates, their streamed deltas, and the reasoning split (handler/http/protocols/reasoning.py).

Each family's strings are written from its documented format (the model card / the chat template
that teaches the model the format), not from our parser's output."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from handler.engine.request import RequestError
from handler.http.protocols import reasoning, tool_parsers as tp, tools
from handler.http.protocols.openai import ChoiceStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# (family, model output, content, [(name, arguments)])
CASES = [
    # Qwen2.5's template: "For each function call, return a json object with function name and arguments
    # within <tool_call></tool_call> XML tags: <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>"
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check both.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    # what Qwen2.5-Coder-0.5B really writes: the object without the tags, bare or fenced
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None,
     [("get_weather", {"city": "Paris"})]),
    # Llama 3.1 model card (JSON-based tool calling): <|python_tag|>{"name": ..., "parameters": {...}}<|eom_id|>
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "celsius"}}',
     None, [("get_weather", {"city": "San Francisco", "unit": "celsius"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    # Mistral (v3 tokenizer): [TOOL_CALLS] [{"name": ..., "arguments": {...}}]
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # Mistral v11 tokenizer (Magistral/Devstral): [TOOL_CALLS]name[ARGS]{...}
    ("mistral", 'On it.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}[TOOL_CALLS]get_time[ARGS]{}',
     "On it.", [("get_weather", {"city": "Lyon"}), ("get_time", {})]),
    # Llama 3.2 (pythonic): [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]
    ("pythonic", '[get_weather(city="San Francisco", unit="fahrenheit"), get_time()]', None,
     [("get_weather", {"city": "San Francisco", "unit": "fahrenheit"}), ("get_time", {})]),
    # Llama 4 wraps it: <|python_start|>[...]<|python_end|>
    ("pythonic", '<|python_start|>[get_weather(city="Oslo")]<|python_end|>', None, [("get_weather", {"city": "Oslo"})]),
    # Granite 3.x: <|tool_call|>[{"name": ..., "arguments": {...}}]
    ("granite", '<|tool_call|>[{"arguments": {"city": "Boston"}, "name": "get_weather"}]', None,
     [("get_weather", {"city": "Boston"})]),
    # Qwen3-Coder's template: <tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n...
    ("qwen3_coder", 'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
                    '<parameter=unit>\n{"scale": "celsius"}\n</parameter>\n</function>\n</tool_call>',
     "Checking.", [("get_weather", {"city": "New York", "unit": {"scale": "celsius"}})]),
]


def _calls(parsed):
    return [(c["name"], c["arguments"]) for c in parsed[1]]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_each_family_parses_its_documented_format(family, text, content, calls):
    got = tp.parse(family, text, {"get_weather", "get_time"})
    assert got is not None, text
    assert got[0] == content and _calls(got) == calls


@pytest.mark.parametrize("family,text", [
    ("hermes", "The weather in Paris is sunny."),
    ("hermes", '{"city": "Paris"}'),                                  # JSON, but no call
    ("hermes", '{"name": "send_email", "arguments": {}}'),             # bare: not a declared tool
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu'),         # cut by max_tokens
    ("llama3_json", "Sure, here it is."),
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_weather\", "),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", '[get_weather(city=__import__("os").system("true"))]'),   # not a literal: never evaluated
    ("pythonic", "[get_weather('Paris')]"),                            # positional: no argument names
    ("granite", "Nothing to call."),
])
def test_text_that_is_not_a_complete_call_stays_content(family, text):
    assert tp.parse(family, text, {"get_weather", "get_time"}) is None


@pytest.mark.parametrize("template,family", [
    ('{% if tools %}<tools>{{ tools }}</tools> <tool_call>\\n{"name": <function-name>, "arguments": '
     '<args-json-object>}\\n</tool_call>{% endif %}', "hermes"),
    ('{%- if tools is not none %}Respond in the format {"name": function name, "parameters": dictionary of argument '
     'name and its value}.{% endif %}{{ "<|python_tag|>" }}', "llama3_json"),
    ('{%- if tools is not none %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}'
     '{% if message.tool_calls %}[TOOL_CALLS]{% endif %}', "mistral"),
    ('{% if tools %}[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]'
     '{% endif %}', "pythonic"),
    ('{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools }}{% endif %}<|tool_call|>', "granite"),
    ('{% if tools %}<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>{% endif %}',
     "qwen3_coder"),
    ('{% for m in messages %}{{ m.content }}{% endfor %}', None),
    ('{% if tools %}<tool_call> or [TOOL_CALLS]{% endif %}', None),       # two formats: ambiguous
])
def test_the_family_is_detected_from_the_template_only_when_unambiguous(template, family):
    assert tp.detect(template) == family


def test_the_option_names_the_family_and_can_switch_auto_off():
    plain = SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    t = tools.parse({"tools": [WEATHER]}, plain, tools.Options(parser="mistral"))
    assert t.fmt == "mistral"
    with pytest.raises(RequestError) as e:
        tools.parse({"tools": [WEATHER]}, plain)
    assert e.value.field == "tool_choice" and "option.tool_call_parser" in e.value.message
    with pytest.raises(RequestError) as e:
        tools.parse({"tools": [WEATHER]}, plain, tools.Options(parser="hermes", enable_auto=False))
    assert "option.enable_auto_tool_choice" in e.value.message
    # required and named still work with auto off
    assert tools.parse({"tools": [WEATHER], "tool_choice": "required"}, plain,
                       tools.Options(enable_auto=False)).choice == "required"


def _stream(req, text, step=3):
    st = tools.Streamer(req)
    deltas = []
    for k in range(0, len(text), step):
        deltas += st.feed(text[k:k + step])
    last, called = st.finish()
    return deltas + last, called


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_streamed_deltas_are_openai_shaped_and_add_up(family, text, content, calls):
    plain = SimpleNamespace(chat_template="")
    req = tools.parse({"tools": [WEATHER, TIME]}, plain, tools.Options(parser=family))
    deltas, called = _stream(req, text)
    assert called
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed.strip() == (content or "")
    got: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            if "id" in tc:         # the head: id, type, name (and empty arguments), before any arguments
                assert tc["type"] == "function" and tc["id"].startswith("call_") and tc["index"] not in got
                got[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                got[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert [(c["name"], json.loads(c["arguments"])) for c in got.values()] == calls


def test_content_streams_before_a_call_and_all_of_it_when_none_comes():
    req = tools.parse({"tools": [WEATHER]}, SimpleNamespace(chat_template=""), tools.Options(parser="hermes"))
    st = tools.Streamer(req)
    assert st.feed("Checking ") == [{"content": "Checking "}]
    assert st.feed("now <tool") == [{"content": "now "}]          # a marker may be starting: held
    deltas, called = _stream(req, "Sunny, 21 degrees, no call.")
    assert not called and "".join(d["content"] for d in deltas) == "Sunny, 21 degrees, no call."
    deltas, called = _stream(req, '{"answer": 42}')                 # held as a possible call, then content
    assert not called and "".join(d["content"] for d in deltas) == '{"answer": 42}'


# ---- reasoning
@pytest.mark.parametrize("parser,text,want", [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\n4", ("\nThe user wants 2+2.\n", "4")),
    ("qwen3", "4", (None, "4")),                                       # enable_thinking=false: no tags
    ("qwen3", "<think>\nstill thinking", ("\nstill thinking", "")),    # cut by max_tokens
    ("deepseek_r1", "The template opened it.\n</think>\n\nAnswer.", ("The template opened it.\n", "Answer.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "no end yet", ("no end yet", "")),
])
def test_reasoning_split(parser, text, want):
    assert reasoning.split(parser, text) == want


@pytest.mark.parametrize("parser,text", [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\n4"),
    ("qwen3", "Just 4."),
    ("deepseek_r1", "Hmm.\n</think>\n\nAnswer."),
    ("deepseek_r1", "<think>a<b</think>c"),
])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_reasoning_adds_up_to_the_split(parser, text, step):
    sp = reasoning.Splitter(parser)
    parts = []
    for k in range(0, len(text), step):
        parts += sp.feed(text[k:k + step])
    parts += sp.finish()
    thought = "".join(t for kind, t in parts if kind == "reasoning")
    content = "".join(t for kind, t in parts if kind == "content")
    want_thought, want_content = reasoning.split(parser, text)
    assert (thought or None, content) == (want_thought or None, want_content)


def test_thinking_never_reaches_a_calls_arguments_or_content():
    req = tools.parse({"tools": [WEATHER]}, SimpleNamespace(chat_template=""), tools.Options(parser="hermes"))
    text = ('<think>\nMaybe <tool_call>{"name": "get_weather", "arguments": {"city": "WRONG"}}</tool_call>\n'
            '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    cs = ChoiceStream(req, "qwen3")
    deltas = []
    for k in range(0, len(text), 4):
        deltas += cs.feed(text[k:k + 4])
    last, called = cs.finish()
    deltas += last
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", ()))
    assert called and json.loads(args) == {"city": "Paris"}
    assert "WRONG" in "".join(d.get("reasoning_content", "") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas).strip() == ""
