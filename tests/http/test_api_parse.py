"""The protocol layer without a server: LMI's parameter table (aliases, nulls, unknown names dropped
with one warning, bounds), content types, chat templates, OpenAI/TGI bodies and encoders."""
from __future__ import annotations

import json
import logging

import pytest

from handler.config import compat
from handler.engine import request as reqmod
from handler.http.protocols import Generation, Sample, lmi, openai, tgi
from handler.engine.loop import DoneEvent, TokenEvent
from handler.engine.request import RequestError, SamplingParams, parse_params
from tests.support.reference import tokenizer


def parse(payload, **kw):
    return lmi.parse(payload, **kw)


def test_aliases_nulls_and_tgi_parameters():
    # The 17 parameters the `text-generation` client always sends, nulls included (FACTS.md).
    tgi_body = {"best_of": None, "decoder_input_details": False, "details": True, "do_sample": False,
                "max_new_tokens": 5, "repetition_penalty": None, "return_full_text": False, "seed": None,
                "stop": [], "temperature": None, "top_k": None, "top_p": None, "truncate": None,
                "typical_p": None, "watermark": False, "top_n_tokens": None, "grammar": None}
    g = parse({"inputs": "x", "parameters": tgi_body})
    assert g.params.max_new_tokens == 5 and g.params.details and g.params.stop_sequences == ()
    assert g.truncate is None
    p = parse_params({"stop": ["a"], "ignore_eos_token": True, "top_k": -1, "max_tokens": 7, "truncate": 3})
    assert p.stop_sequences == ("a",) and p.ignore_eos and p.top_k == 0 and p.max_new_tokens == 7
    g = parse({"inputs": "x", "parameters": {"truncate": 3, "n": 2, "best_of": 3, "top_n_tokens": 2,
                                             "decoder_input_details": True, "typical_p": 0.5, "min_p": 0.1,
                                             "presence_penalty": 0.5, "frequency_penalty": -0.5}})
    assert g.truncate == 3
    assert (g.params.n, g.params.best_of, g.params.num_samples, g.params.top_n_tokens) == (2, 3, 3, 2)
    assert g.params.decoder_input_details and g.params.typical_p == 0.5 and g.params.min_p == 0.1
    assert (g.params.presence_penalty, g.params.frequency_penalty) == (0.5, -0.5)
    with pytest.raises(RequestError) as e:
        parse_params({"stop": ["a"], "stop_sequences": ["b"]})
    assert e.value.field in ("parameters.stop", "parameters.stop_sequences")


def test_unknown_names_are_dropped_with_one_warning(caplog):
    reqmod._warned.clear()
    with caplog.at_level(logging.WARNING, logger="lmi.request"):
        for _ in range(3):
            g = parse({"inputs": "x", "parameters": {"num_beams": 1, "max_new_tokens": 2}, "max_new_tokens": 9})
            assert g.params.max_new_tokens == 2        # a top-level max_new_tokens is not a parameter (LMI)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("'num_beams'" in m or '"num_beams"' in m for m in msgs) == 1, msgs
    assert sum('"max_new_tokens"' in m and "field" in m for m in msgs) == 1, msgs
    # `adapters` is kept for the app, which refuses it when LoRA is off (tests/model/test_lora.py):
    # running the base model instead would be a silent change.
    assert parse({"inputs": "x", "adapters": "a1"}).adapter == "a1"


def test_the_benchmark_knob_eos_after_is_not_public(monkeypatch, caplog):
    monkeypatch.delenv("LMI_BENCH_EOS_AFTER", raising=False)
    reqmod._warned.clear()
    with caplog.at_level(logging.WARNING, logger="lmi.request"):
        p = parse_params({"eos_after": 3, "max_new_tokens": 9})
    assert p.eos_after is None and p.max_new_tokens == 9
    assert any("unknown request parameter" in r.getMessage() and "eos_after" in r.getMessage()
               for r in caplog.records)
    assert "eos_after" not in reqmod.ALLOWED_PARAMETERS
    # the bench and tune tools start our servers with the switch on
    monkeypatch.setenv("LMI_BENCH_EOS_AFTER", "1")
    assert parse_params({"eos_after": 3}).eos_after == 3
    with pytest.raises(RequestError) as e:
        parse_params({"eos_after": 0})
    assert e.value.field == "parameters.eos_after"


@pytest.mark.parametrize("params,field", [
    ({"max_new_tokens": 2**40}, "parameters.max_new_tokens"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens"),
    ({"n": 17}, "parameters.n"), ({"best_of": 0}, "parameters.best_of"),
    ({"n": 3, "best_of": 2}, "parameters.best_of"),
    ({"top_n_tokens": 21}, "parameters.top_n_tokens"),
    ({"temperature": 1e9}, "parameters.temperature"), ({"temperature": float("nan")}, "parameters.temperature"),
    ({"top_k": -2}, "parameters.top_k"), ({"top_k": 1.5}, "parameters.top_k"),
    ({"repetition_penalty": 1e6}, "parameters.repetition_penalty"),
    ({"presence_penalty": 3}, "parameters.presence_penalty"),
    ({"seed": 2**64}, "parameters.seed"), ({"truncate": 0}, "parameters.truncate"),
    ({"stop": ["x" * 513]}, "parameters.stop"), ({"stop_sequences": ["s"] * 17}, "parameters.stop_sequences"),
    ({"details": "yes"}, "parameters.details"), ({"ignore_eos_token": 1}, "parameters.ignore_eos_token"),
])
def test_known_parameters_keep_strict_bounded_checks(params, field):
    with pytest.raises(RequestError) as e:
        parse({"inputs": "x", "parameters": params})
    assert e.value.field == field and e.value.status == 400
    assert len(e.value.message) < 200          # a client's value is echoed at most ~100 characters


def test_huge_top_k_is_off_and_never_reaches_the_sampler():
    assert parse_params({"top_k": 2**63}).top_k == 0
    assert parse_params({"top_k": 10**30}).top_k == 0
    assert parse_params({"top_k": 40}).top_k == 40


def test_long_values_are_not_echoed_in_full():
    with pytest.raises(RequestError) as e:
        parse({"inputs": "x", "parameters": {"temperature": "h" * 10_000}})
    assert len(e.value.message) < 150 and "..." in e.value.message


@pytest.mark.parametrize("ctype,raw,want", [
    ("application/json", b'{"inputs": "a"}', (["a"], False)),
    ("application/json; charset=utf-8", b'{"inputs": ["a", "b"]}', (["a", "b"], True)),
    ("application/jsonlines", b'{"inputs": "a"}\n', (["a"], False)),     # LMI reads it as JSON
    ("text/plain", "héllo".encode(), (["héllo"], True)),                 # LMI: {"inputs": [text]}
    ("text/csv", b"inputs\nfirst\nsecond\n", (["first", "second"], True)),
    (None, b'{"inputs": "a"}', (["a"], False)),
    ("application/x-www-form-urlencoded", b'{"inputs": "a"}', (["a"], False)),   # curl -d
])
def test_content_types_as_lmi_decodes_them(ctype, raw, want):
    g = parse(lmi.decode_body(raw, ctype))
    assert (g.prompts, g.is_list) == want


@pytest.mark.parametrize("ctype", ["image/png", "application/octet-stream", "multipart/form-data"])
def test_other_content_types_get_415_naming_the_type(ctype):
    with pytest.raises(RequestError) as e:
        lmi.decode_body(b"xx", ctype)
    assert e.value.status == 415 and ctype in e.value.message


def test_several_jsonlines_objects_are_one_bad_body():
    with pytest.raises(RequestError) as e:
        lmi.decode_body(b'{"inputs": "a"}\n{"inputs": "b"}\n', "application/jsonlines")
    assert e.value.field == "body" and "one JSON object" in e.value.message


# ---- chat / OpenAI
@pytest.fixture(scope="module")
def tok(demo_model_dir):
    return tokenizer(demo_model_dir)


def test_chat_uses_the_template_and_openai_sampling_defaults(tok):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    g = openai.parse_chat({"messages": msgs, "max_tokens": 4, "model": "anything"}, tok)
    want = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hi\nthere"}],
                                   tokenize=False, add_generation_prompt=True)
    assert g.prompts == [want] and not g.add_special_tokens
    assert g.params.max_new_tokens == 4 and g.params.do_sample and g.params.temperature == 1.0
    g = openai.parse_chat({"messages": msgs, "temperature": 0, "n": 3, "stop": "x", "seed": 5,
                           "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 6}, tok)
    p = g.params
    assert p.greedy and p.n == 3 and p.stop_sequences == ("x",) and p.seed == 5 and p.top_n_tokens == 2
    assert p.max_new_tokens == 6 and g.extra["logprobs"]
    assert openai.parse_chat({"messages": msgs}, tok).fill_max_tokens         # vLLM: up to the model length
    assert openai.parse_chat({"messages": msgs}, tok, lmi=True).fill_max_tokens   # current LMI: the model's length
    old = openai.ServerOptions(line=compat.LINES["0.31"])
    assert not openai.parse_chat({"messages": msgs}, tok, lmi=True, server=old).fill_max_tokens   # LMI <= 0.31: 30


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
])
def test_chat_errors_name_the_field(tok, body, field):
    with pytest.raises(RequestError) as e:
        openai.parse_chat(body, tok)
    assert e.value.field == field


def test_a_tokenizer_without_template_is_a_clear_400(tok):
    import copy
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(RequestError) as e:
        openai.parse_chat({"messages": [{"role": "user", "content": "x"}]}, bare)
    assert "chat template" in e.value.message


# ---- encoders, on hand-made events in the engine's contract
def _sample(p, s, toks, reason="length", prefill=None):
    evs = [TokenEvent(i, t, lp, top_tokens=((i, t, lp), (9, "z", -9.0))) for i, t, lp in toks]
    done = DoneEvent(reason, "".join(t for _, t, _ in toks), len(toks), 3, prefill=prefill)
    evs[-1] = TokenEvent(*toks[-1], done=done, special=reason == "eos_token",
                         top_tokens=evs[-1].top_tokens)
    return Sample(p, s, evs, done)


def test_lmi_details_shape_with_best_of_prefill_and_top_tokens():
    params = SamplingParams(details=True, n=1, best_of=2, top_n_tokens=2, decoder_input_details=True)
    gen = Generation(["hi"], params)
    pre = ((5, "h", None), (6, "i", -1.5))
    worse = _sample(0, 0, [(1, "a", -3.0), (2, "</s>", -1.0)], "eos_token", pre)
    better = _sample(0, 1, [(3, "b", -0.5)], "length", pre)
    out = lmi.encode(gen, [worse, better])
    assert out["generated_text"] == "b"
    d = out["details"]
    assert set(d) == {"inputs", "finish_reason", "generated_tokens", "tokens", "prefill", "top_tokens",
                      "best_of_sequences"}
    assert d["inputs"] == "hi" and d["tokens"] == [{"id": 3, "text": "b", "log_prob": -0.5}]
    assert d["prefill"] == [{"id": 5, "text": "h", "log_prob": None}, {"id": 6, "text": "i", "log_prob": -1.5}]
    assert d["top_tokens"] == [[{"id": 3, "text": "b", "log_prob": -0.5}, {"id": 9, "text": "z", "log_prob": -9.0}]]
    (other,) = d["best_of_sequences"]
    assert other["generated_text"] == "a</s>" and other["finish_reason"] == "eos_token"
    assert other["tokens"][-1] == {"id": 2, "text": "</s>", "log_prob": -1.0, "special_token": True}
    tg = lmi.encode(Generation(["hi"], SamplingParams(details=True)), [better], tgi=True)
    assert isinstance(tg, list) and tg[0]["details"]["tokens"] == [{"id": 3, "text": "b", "logprob": -0.5}]


def test_lmi_stream_last_line_as_lmi_writes_it():
    gen = Generation(["hi"], SamplingParams(details=True), stream=True)
    s = _sample(0, 0, [(1, "a", -1.0), (2, "b", -2.0)])
    lines = [json.loads(x) for x in lmi.stream(gen, ((0, 0, ev) for ev in s.tokens), sse=False)]
    assert lines[0] == {"token": {"id": 1, "text": "a", "log_prob": -1.0}}
    assert set(lines[1]) == {"token", "generated_text", "details"} and lines[1]["generated_text"] == "ab"
    assert lines[1]["details"] == {"finish_reason": "length", "generated_tokens": 2, "inputs": "hi"}


def test_tgi_generate_details_shape():
    gen = Generation(["hi"], SamplingParams(details=True, seed=3))
    out = tgi.encode(gen, [_sample(0, 0, [(1, "a", -1.0)])])
    assert set(out["details"]) == {"finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens"}
    assert out["details"]["tokens"] == [{"id": 1, "text": "a", "logprob": -1.0, "special": False}]
    assert out["details"]["seed"] == 3


def test_openai_constraints_stop_strings_and_logit_bias(tok):
    msgs = [{"role": "user", "content": "x"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = openai.parse_chat({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema, "strict": True}}, "logit_bias": {"5": -3}}, tok)
    assert g.params.guide.kind == "json_schema" and json.loads(g.params.guide.value) == schema
    assert g.params.logit_bias == ((5, -3.0),)
    assert not g.params.include_stop_str_in_output              # OpenAI: the stop string is cut off
    assert openai.parse_chat({"messages": msgs}, tok, lmi=True).params.include_stop_str_in_output   # LMI keeps it
    assert openai.parse_chat({"messages": msgs, "include_stop_str_in_output": True},
                             tok).params.include_stop_str_in_output
    assert openai.parse_chat({"messages": msgs, "response_format": {"type": "text"}}, tok).params.guide is None
    c = openai.parse_completion({"prompt": "x", "guided_choice": ["a", "b"]}, tok)
    assert c.params.guide.kind == "choice" and c.params.guide.field == "guided_choice"
    c = openai.parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}, tok)
    assert c.params.guide.kind == "json_object"
    with pytest.raises(RequestError) as e:
        openai.parse_completion({"prompt": "x", "logit_bias": {str(len(tok)): 1}}, tok)
    assert e.value.field == "logit_bias" and "vocabulary" in e.value.message


def test_errors_from_the_declared_models_keep_the_one_line_form():
    # field path, what is allowed, the client's value: as the API docs give them
    cases = [({"max_new_tokens": 0}, "parameters.max_new_tokens", "must be between 1 and 1048576, got 0"),
             ({"top_p": 0}, "parameters.top_p", "must be in (0, 1], got 0"),
             ({"temperature": "hot"}, "parameters.temperature", 'must be a number, got "hot"'),
             ({"max_tokens": 2.5}, "parameters.max_tokens", "must be an integer, got 2.5"),
             ({"do_sample": "true"}, "parameters.do_sample", 'must be true or false, got "true"'),
             ({"logit_bias": {"7": 101}}, "parameters.logit_bias.7", "must be in [-100, 100], got 101")]
    for params, field, message in cases:
        with pytest.raises(RequestError) as e:
            parse({"inputs": "x", "parameters": params})
        assert (e.value.field, e.value.message, e.value.status) == (field, message, 400)
    from handler.http.protocols import openai
    for body, field, message in [({"temperature": 2.5}, "temperature", "must be in [0, 2], got 2.5"),
                                 ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage",
                                  "must be true or false, got 1"),
                                 ({"stream_options": 3}, "stream_options", "must be an object, got 3"),
                                 ({"logprobs": 6}, "logprobs", "must be between 0 and 5, got 6")]:
        with pytest.raises(RequestError) as e:
            openai.parse_completion({"prompt": "x", **body})
        assert (e.value.field, e.value.message) == (field, message)


def test_the_openapi_document_declares_the_bodies_with_their_bounds():
    from handler.http.protocols import openapi
    doc = openapi.document()
    assert set(doc["paths"]) >= {"/invocations", "/v1/chat/completions", "/v1/completions", "/generate"}
    s = doc["components"]["schemas"]

    def declared(prop):     # an optional field takes null too (a null is an absent field)
        value, null = prop["anyOf"]
        assert null == {"type": "null"}
        return value
    # LMI's temperature goes to 100, OpenAI's to 2 (docs/API.md); max_new_tokens from 1
    assert declared(s["Parameters"]["properties"]["temperature"])["maximum"] == 100
    assert declared(s["ChatCompletionRequest"]["properties"]["temperature"])["maximum"] == 2
    assert declared(s["Parameters"]["properties"]["max_new_tokens"])["minimum"] == 1
    assert declared(s["Parameters"]["properties"]["stop"])["description"] == "the same as stop_sequences"
    assert "eos_after" not in s["Parameters"]["properties"]
    assert "#/$defs/" not in json.dumps(doc)
