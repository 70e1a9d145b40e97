"""Structured output on the real model (SmolLM2-135M-Instruct) behind the paged strategy, through the
real clients: OpenAI `response_format` (json_schema, json_object), `tools` with tool_choice required /
named / auto, TGI `grammar` (json, regex) through `huggingface_hub.InferenceClient` and
`text-generation`, LMI/vLLM `guided_*` parameters; whole and streamed, under concurrency. Every
JSON answer is validated against its schema by the `jsonschema` library."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from tests.support.server import Server

pytestmark = pytest.mark.slow

PAGED = ("option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=8\n"
         "option.kv_cache_tokens=8192\noption.enable_prefix_caching=true\n")

# (question, schema): nested objects, arrays (bounded), enums, required fields.
SCHEMAS = [
    ("Describe a person called Ann who is 31.",
     {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False}),
    ("Give me a book with its author and year.",
     {"type": "object", "properties": {
         "title": {"type": "string", "maxLength": 40},
         "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                     "last": {"type": "string", "maxLength": 20}},
                    "required": ["first", "last"]},
         "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
      "required": ["title", "author", "year"]}),
    ("What colours are in a rainbow? Pick some.",
     {"type": "object", "properties": {"colours": {"type": "array", "minItems": 1, "maxItems": 4,
                                                   "items": {"enum": ["red", "orange", "yellow", "green",
                                                                      "blue", "indigo", "violet"]}}},
      "required": ["colours"]}),
    ("Is Paris the capital of France? Answer with a verdict and a confidence.",
     {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]},
                                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["verdict", "confidence"]}),
    ("List two cities with their countries.",
     {"type": "object", "properties": {"cities": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
         "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                          "country": {"type": "string", "maxLength": 20}},
         "required": ["city", "country"]}}},
      "required": ["cities"]}),
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}


@pytest.fixture(scope="module")
def srv(real_model_dir, tmp_path_factory):
    s = Server(PAGED, real_model_dir, tmp_path_factory.mktemp("structured"), env={"OPTION_TGI_COMPAT": "true"})
    yield s
    s.stop()


def oai(srv):
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_under_concurrency(srv):
    client = oai(srv)

    def ask(case):
        (q, schema), sample = case
        extra = {"temperature": 0.8, "seed": 11} if sample else {"temperature": 0}
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=120,
                                           response_format=_json_schema_format(schema), **extra)
        return schema, r.choices[0]

    cases = [(c, sample) for c in SCHEMAS for sample in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for schema, choice in answers:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_schema_streamed_equals_whole_and_validates(srv):
    client = oai(srv)
    q, schema = SCHEMAS[1]
    body = dict(model="m", messages=[{"role": "user", "content": q}], max_tokens=120, temperature=0,
                response_format=_json_schema_format(schema))
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), schema)


def test_json_object_and_n_samples(srv):
    r = oai(srv).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me about the moon in JSON."}], max_tokens=150,
        temperature=0.7, seed=5, n=3, response_format={"type": "json_object"})
    assert len(r.choices) == 3
    for c in r.choices:
        if c.finish_reason == "stop":        # a complete answer is one JSON object
            assert isinstance(json.loads(c.message.content), dict)
        else:                                # cut by max_tokens: still a prefix of an object
            assert c.message.content.startswith("{")


def test_tool_choice_required_and_named_give_valid_calls(srv):
    client = oai(srv)
    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=150, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER, TIME], max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=0.9, seed=1)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), params["get_time"])
    # The call goes back as an assistant message, its result as a tool message.
    follow = messages + [{"role": "assistant", "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r = client.chat.completions.create(model="m", messages=follow, max_tokens=10, temperature=0)
    assert r.choices[0].message.content


def test_tool_calls_streamed_as_deltas(srv):
    client = oai(srv)
    messages = [{"role": "user", "content": "What is the weather like in Rome?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = dict(model="m", messages=messages, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=150,
                    temperature=0)
        whole = client.chat.completions.create(**body).choices[0].message.tool_calls
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**body, stream=True):
            d = chunk.choices[0].delta
            for tc in d.tool_calls or ():       # as the openai SDK's users accumulate them
                acc = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                acc["name"] += tc.function.name or "" if tc.function else ""
                acc["arguments"] += tc.function.arguments or "" if tc.function else ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(w.function.name, json.loads(w.function.arguments)) for w in whole]


def test_tool_choice_auto_without_a_template_format_is_a_clear_400(srv):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        oai(srv).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                         tools=[WEATHER], max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "required" in e.value.body["message"]


def test_bad_schemas_and_regexes_are_400s_naming_the_field(srv):
    url = srv.url + "/v1/chat/completions"
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    cases = [
        ({"response_format": _json_schema_format({"type": "strin"})}, "response_format.json_schema.schema"),
        ({"response_format": _json_schema_format({"type": "array", "uniqueItems": True})},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(abc"}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a", "b"]}, "guided_choice"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ]
    for extra, field in cases:
        r = requests.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"].startswith(field), (extra, r.json())
    r = requests.post(srv.url + "/generate", json={"inputs": "x", "parameters": {
        "grammar": {"type": "regex", "value": "[a-"}}}, timeout=60)
    assert r.status_code == 422 and "parameters.grammar.value" in r.json()["error"], r.text
    r = requests.post(srv.url + "/invocations", json={"inputs": "x", "parameters": {
        "guided_json": {"type": "object", "if": {}}}}, timeout=60)
    assert r.status_code in (400, 422) and "parameters.guided_json" in r.text and '\\"if\\"' in r.text


def test_tgi_grammar_json_and_regex_with_huggingface_hub(srv, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)    # our loopback server, not the hub
    client = InferenceClient(base_url=srv.url)
    prompt = "<|im_start|>user\nDescribe a person called Ann who is 31.<|im_end|>\n<|im_start|>assistant\n"
    schema = SCHEMAS[0][1]
    out = client.text_generation(prompt, max_new_tokens=80, grammar={"type": "json", "value": schema})
    jsonschema.validate(json.loads(out), schema)
    streamed = "".join(client.text_generation(prompt, max_new_tokens=80, stream=True,
                                              grammar={"type": "json", "value": schema}))
    assert streamed == out
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    ask = "<|im_start|>user\nGive me a phone number.<|im_end|>\n<|im_start|>assistant\n"
    out = client.text_generation(ask, max_new_tokens=30, grammar={"type": "regex", "value": phone})
    assert re.fullmatch(phone, out), out
    streamed = list(client.text_generation(ask, max_new_tokens=30, stream=True, details=True,
                                           grammar={"type": "regex", "value": phone}))
    assert re.fullmatch(phone, streamed[-1].generated_text)
    assert streamed[-1].details.finish_reason == "eos_token"


def test_text_generation_client_grammar(srv):
    from text_generation import Client
    from text_generation.types import Grammar, GrammarType

    client = Client(srv.url, timeout=120)
    schema = SCHEMAS[3][1]
    prompt = "<|im_start|>user\n" + SCHEMAS[3][0] + "<|im_end|>\n<|im_start|>assistant\n"
    r = client.generate(prompt, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=schema))
    jsonschema.validate(json.loads(r.generated_text), schema)
    text = "".join(t.token.text for t in client.generate_stream(
        prompt, max_new_tokens=60, grammar=Grammar(type=GrammarType.Json, value=schema)) if not t.token.special)
    assert text == r.generated_text


def test_lmi_guided_parameters_on_invocations(srv):
    prompt = "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    for params, check in [
        ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
        ({"guided_regex": r"[A-Z][a-z]+ [a-z]+\."}, lambda t: re.fullmatch(r"[A-Z][a-z]+ [a-z]+\.", t)),
        ({"guided_json": SCHEMAS[3][1]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3][1]) is None),
        ({"structured_outputs": {"choice": ["blue", "grey"]}}, lambda t: t in ("blue", "grey")),
        ({"guided_grammar": 'root ::= "The sky is " ("blue" | "grey") "."'},
         lambda t: t in ("The sky is blue.", "The sky is grey.")),
    ]:
        (out,) = srv.post({"inputs": prompt, "parameters": {"max_new_tokens": 40, **params}}).json()  # tgi_compat
        assert check(out["generated_text"]), (params, out)
        assert out["details"]["finish_reason"] == "eos_token"
        lines = [json.loads(x.removeprefix(b"data:")) for x in srv.post({   # tgi_compat streams SSE
            "inputs": prompt, "stream": True, "parameters": {"max_new_tokens": 40, **params}}, stream=True).iter_lines()
            if x]
        assert lines[-1]["generated_text"] == out["generated_text"]


def test_openai_stop_string_is_cut_off_lmi_keeps_it(srv):
    client = oai(srv)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="m", messages=messages, max_tokens=20,
                                           temperature=0).choices[0].message.content
    assert "Paris" in whole
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0, stop=["Paris"])
    assert r.choices[0].message.content == whole[:whole.index("Paris")]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=messages, max_tokens=20, temperature=0, stop=["Paris"], stream=True))
    assert streamed == whole[:whole.index("Paris")]
    kept = client.chat.completions.create(model="m", messages=messages, max_tokens=20, temperature=0,
                                          stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == whole[:whole.index("Paris") + len("Paris")]
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    (out,) = srv.post({"inputs": prompt, "parameters": {"max_new_tokens": 20, "stop_sequences": ["Paris"]}}).json()
    assert out["generated_text"].endswith("Paris")


def test_logit_bias(srv, real_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_dir)
    client = oai(srv)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    base = client.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0)
    first = tok(base.choices[0].message.content, add_special_tokens=False)["input_ids"][0]
    forced = tok(" banana", add_special_tokens=False)["input_ids"][0]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0,
                                       logit_bias={str(forced): 100, str(first): -100})
    assert tok(r.choices[0].message.content, add_special_tokens=False)["input_ids"][0] == forced
