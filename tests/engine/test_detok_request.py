"""Incremental detokenisation, stop sequences and the request schema (no model, no server)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from handler.engine.detok import IncrementalDetokenizer
from handler.http.protocols import lmi
from handler.engine.request import RequestError, SamplingParams
from tests.support.reference import tokenizer

TEXTS = ["héllo wörld — 日本語 def  foo():\n    return 'x'  🎉 end",
         "  leading spaces and\ttabs\n\n\nnewlines",
         "emoji 👩‍👩‍👧 family, ñ, ü, 中文字符"]


@pytest.fixture(scope="module")
def tok(demo_model_dir):
    return tokenizer(demo_model_dir)


def stream(tok, prompt_ids, ids, stops=(), include_stop=True):
    d = IncrementalDetokenizer(tok, prompt_ids, stops, include_stop=include_stop)
    parts = []
    for i, t in enumerate(ids):
        parts.append(d.add(t))
        if d.stopped:
            break
    parts.append(d.flush())
    return parts, d


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_concatenate_to_the_text(tok, text):
    ids = tok(text)["input_ids"]
    parts, d = stream(tok, tok("prefix: ")["input_ids"], ids)
    assert "".join(parts) == d.text == tok.decode(ids)
    # a multi-byte character is never split into replacement characters
    assert "\ufffd" not in "".join(parts)


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_any_text_roundtrips_through_the_stream(tok, text):
    ids = tok(text)["input_ids"]
    parts, d = stream(tok, [], ids)
    assert "".join(parts) == tok.decode(ids)


def test_stop_sequence_across_token_boundaries(tok):
    text = "alpha beta gamma delta epsilon"
    ids = tok(text)["input_ids"]
    parts, d = stream(tok, [], ids, stops=("ta gam",))     # spans tokens
    assert d.stopped
    assert "".join(parts) == "alpha beta gam"
    parts, d = stream(tok, [], ids, stops=("zzz",))
    assert not d.stopped and "".join(parts) == text


def test_stop_sequence_cut_off_when_not_included(tok):
    """OpenAI: the text ends before the stop sequence, also streamed (nothing of it is emitted
    first); text that only looked like a stop sequence's start is emitted in the end."""
    text = "alpha beta gamma delta epsilon"
    ids = tok(text)["input_ids"]
    for stop, want in [("ta gam", "alpha be"), ("alpha", ""), ("epsilon", "alpha beta gamma delta ")]:
        parts, d = stream(tok, [], ids, stops=(stop,), include_stop=False)
        assert d.stopped and "".join(parts) == d.text == want, stop
    # "gamma d" begins like the stop "gamma dx": held back, then emitted when the end comes.
    parts, d = stream(tok, [], ids, stops=("gamma dx", "silon!"), include_stop=False)
    assert not d.stopped and "".join(parts) == d.text == text
    assert any(p == "" for p in parts[:-1]) or parts[-1]      # something was held back at some point


def body(**kw):
    return json.dumps(kw).encode()


def parse_invocation(raw: bytes, content_type: str = "application/json", **kw):
    return lmi.parse(lmi.decode_body(raw, content_type), **kw)


def test_defaults_and_lists():
    inv = parse_invocation(body(inputs="hi"))
    assert inv.prompts == ["hi"] and not inv.is_list and not inv.stream
    assert inv.params == SamplingParams() and inv.params.max_new_tokens == 30
    inv = parse_invocation(body(inputs=["a", "b"], parameters={"max_new_tokens": 3, "stop_sequences": "x"}))
    assert inv.is_list and inv.prompts == ["a", "b"] and inv.params.stop_sequences == ("x",)
    # LMI decodes text/plain as {"inputs": [text]}: a list (encode_decode.py), answered with a list
    inv = parse_invocation(b"plain prompt", "text/plain; charset=utf-8")
    assert inv.prompts == ["plain prompt"] and inv.is_list
    assert parse_invocation(body(inputs="x"), default_stream=True).stream


@pytest.mark.parametrize("raw,field", [
    (b"[1]", "body"), (body(inputs="x", parameters=[]), "parameters"),
    (body(inputs="x", parameters={"seed": -1}), "parameters.seed"),
    (body(inputs="x", parameters={"max_new_tokens": True}), "parameters.max_new_tokens"),
    (body(inputs="x", parameters={"temperature": "hot"}), "parameters.temperature"),
    (body(inputs="x", parameters={"top_p": 0}), "parameters.top_p"),
    (body(inputs=["a", "b"], stream=True), "stream"),
])
def test_errors_name_the_field(raw, field):
    with pytest.raises(RequestError) as e:
        parse_invocation(raw)
    assert e.value.field == field and e.value.message
