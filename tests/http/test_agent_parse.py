"""The agent/eval request fields without a model: vLLM's sampling extras in the one request model
(handler/engine/request.py) and what the sampler and detokenizer do with them, OpenAI's echo /
max_tokens 0 / prompt_logprobs / chat_template_kwargs / reasoning parsing (handler/http/protocols/openai.py)."""
from __future__ import annotations

import json

import pytest
import torch

from handler.engine.detok import IncrementalDetokenizer
from handler.engine.request import RequestError, SamplingParams, parse_params
from handler.engine.types import DoneEvent, StepItem, TokenEvent
from handler.http.protocols import Sample, openai
from handler.model.sampling import Sampler


# ---- the request model
def test_lmi_parameters_take_the_extras():
    opts: dict = {}
    p = parse_params({"stop_token_ids": [7, 9], "min_tokens": 3, "bad_words": ["foo", "bar baz"],
                      "skip_special_tokens": False, "spaces_between_special_tokens": False,
                      "prompt_logprobs": 2, "truncate_prompt_tokens": 5}, options=opts)
    assert p.stop_token_ids == (7, 9) and p.min_tokens == 3 and p.bad_words == ("foo", "bar baz")
    assert not p.skip_special_tokens and not p.spaces_between_special_tokens
    assert p.decoder_input_details and p.prompt_top_n == 2 and opts == {"truncate": 5}


@pytest.mark.parametrize("raw,field", [
    ({"stop_token_ids": [1, -2]}, "parameters.stop_token_ids"),
    ({"stop_token_ids": "7"}, "parameters.stop_token_ids"),
    ({"min_tokens": -1}, "parameters.min_tokens"),
    ({"min_tokens": 40, "max_new_tokens": 10}, "parameters.min_tokens"),
    ({"bad_words": [""]}, "parameters.bad_words"),
    ({"bad_words": [1]}, "parameters.bad_words"),
    ({"skip_special_tokens": "no"}, "parameters.skip_special_tokens"),
    ({"prompt_logprobs": 99}, "parameters.prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "parameters.truncate_prompt_tokens"),
])
def test_bad_extras_are_one_line_400s_naming_the_field(raw, field):
    with pytest.raises(RequestError) as e:
        parse_params(raw, options={})
    assert e.value.field == field and e.value.status == 400 and "\n" not in e.value.message


class Tok:
    """A tokenizer stand-in: one token per character; records what the chat template got."""
    chat_template = "{{ messages }}"

    def __init__(self):
        self.kwargs = None

    def __len__(self):
        return 1000

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, msgs, tools=None, tokenize=False, add_generation_prompt=True, **kw):
        self.kwargs = kw
        return "".join(m["content"] for m in msgs)


MSG = [{"role": "user", "content": "hi"}]


def test_openai_fields_reach_the_request_model():
    gen = openai.parse_completion({"prompt": "x", "stop_token_ids": [3], "min_tokens": 2, "bad_words": ["no"],
                                   "skip_special_tokens": False, "truncate_prompt_tokens": 4, "prompt_logprobs": 1,
                                   "max_tokens": 8}, Tok())
    p = gen.params
    assert (p.stop_token_ids, p.min_tokens, p.bad_words, p.skip_special_tokens) == ((3,), 2, ("no",), False)
    assert gen.truncate == 4 and p.decoder_input_details and p.prompt_top_n == 1


def test_echo_with_logprobs_and_max_tokens_zero():
    gen = openai.parse_completion({"prompt": "abc", "echo": True, "logprobs": 2, "max_tokens": 0}, Tok())
    assert gen.params.decoder_input_details and gen.params.prompt_top_n == 2 and gen.params.max_new_tokens == 1
    with pytest.raises(RequestError) as e:
        openai.parse_completion({"prompt": "abc", "max_tokens": 0}, Tok())
    assert e.value.field == "max_tokens"
    with pytest.raises(RequestError) as e:
        openai.parse_completion({"prompt": "abc", "echo": True, "logprobs": 1, "stream": True}, Tok())
    assert e.value.field == "stream"
    # the engine's answer -> OpenAI's log-probs over prompt + completion, the completion dropped for max_tokens 0
    done = DoneEvent("length", "d", 1, 3, prefill=((97, "a", None), (98, "b", -1.5), (99, "c", -0.25)),
                     prefill_top=(None, (2, ((120, "x", -0.5), (98, "b", -1.5))), (1, ((99, "c", -0.25),))))
    tok = TokenEvent(100, "d", -0.1, done)
    body = openai.encode(gen, [Sample(0, 0, [tok], done)], "m")
    c = body["choices"][0]
    assert c["text"] == "abc" and body["usage"]["completion_tokens"] == 0 and c["finish_reason"] == "length"
    assert c["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [None, -1.5, -0.25],
                             "top_logprobs": [None, {"x": -0.5, "b": -1.5}, {"c": -0.25}], "text_offset": [0, 1, 2]}
    gen = openai.parse_completion({"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 2}, Tok())
    c = openai.encode(gen, [Sample(0, 0, [tok], done)], "m")["choices"][0]
    assert c["text"] == "d" and c["prompt_logprobs"][0] is None
    assert c["prompt_logprobs"][1] == {"98": {"logprob": -1.5, "rank": 2, "decoded_token": "b"},
                                       "120": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}}


def test_chat_template_kwargs_reach_the_template():
    tok = Tok()
    openai.parse_chat({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False, "custom": 1}}, tok)
    assert tok.kwargs == {"enable_thinking": False, "custom": 1}
    with pytest.raises(RequestError) as e:
        openai.parse_chat({"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, tok)
    assert e.value.field == "chat_template_kwargs.tokenize"


def test_a_guided_answer_under_a_reasoning_parser():
    tok = Tok()
    fmt = {"type": "json_object"}
    openai.parse_chat({"messages": MSG, "response_format": fmt}, tok,
                      server=openai.ServerOptions(reasoning="qwen3"))
    assert tok.kwargs == {"enable_thinking": False}      # the constraint covers the whole answer: no thinking
    for server, kwargs in ((openai.ServerOptions(reasoning="qwen3"), {"enable_thinking": True}),
                           (openai.ServerOptions(reasoning="deepseek_r1"), {})):
        with pytest.raises(RequestError) as e:
            openai.parse_chat({"messages": MSG, "response_format": fmt, "chat_template_kwargs": kwargs}, tok,
                              server=server)
        assert e.value.field == "response_format" and "reasoning_parser" in e.value.message


def test_reasoning_content_in_the_message_and_never_in_the_call():
    tok = Tok()
    tok.chat_template = "{% if tools %}<tool_call>{% endif %}"
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    gen = openai.parse_chat({"messages": MSG, "tools": [fn]}, tok, server=openai.ServerOptions(reasoning="qwen3"))
    text = '<think>call f with {"x": 1}?</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'
    done = DoneEvent("eos_token", text, 9, 2)
    msg = openai.encode(gen, [Sample(0, 0, [], done)], "m")["choices"][0]["message"]
    assert msg["reasoning_content"] == 'call f with {"x": 1}?'
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"x": 2}


# ---- the sampler: bans
def _item(history, num_prompt, **params):
    return StepItem(1, [history[-1]], len(history) - 1, [0], True, SamplingParams(**params), history, num_prompt)


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    s = Sampler(eos_token_ids=(5,))
    logits = torch.zeros(1, 10)
    logits[0, 5], logits[0, 7], logits[0, 2] = 9.0, 8.0, 1.0
    assert s.sample(logits, [_item([1, 1], 1, min_tokens=3, stop_token_ids=(7,))])[0].token == 2
    assert s.sample(logits, [_item([1, 1, 1], 1, min_tokens=3)])[0].token == 7
    assert s.sample(logits, [_item([1, 1, 1, 1], 1, min_tokens=3)])[0].token == 5    # reached: EOS again


def test_bad_words_ban_the_last_token_after_the_rest():
    s = Sampler()
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 6] = 9.0, 8.0
    words = ((4,), (3, 6))
    assert s.sample(logits, [_item([1, 2], 1, bad_words_ids=words)])[0].token == 6   # (3, 6) not started
    assert s.sample(logits, [_item([1, 3], 1, bad_words_ids=words)])[0].token not in (4, 6)
    assert s.sample(logits, [_item([3, 1], 1, bad_words_ids=((3, 4),))])[0].token == 4   # the prompt's 3 does not count


# ---- the detokenizer
class CharTok:
    """decode: one character per id; ids >= 1000 are special tokens <sN>."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join((f"<s{i}>" if not skip_special_tokens else "") if i >= 1000 else chr(i) for i in ids)


def _run(detok, ids):
    """The text until a stop string ends it (the engine ends the sequence there)."""
    out = ""
    for i in ids:
        out += detok.add(i)
        if detok.stopped:
            return out
    return out + detok.flush()


def test_stop_strings_wait_for_min_tokens():
    ids = [ord(c) for c in "ab.cd.ef"]
    assert _run(IncrementalDetokenizer(CharTok(), [65], (".",), include_stop=False), ids) == "ab"
    d = IncrementalDetokenizer(CharTok(), [65], (".",), include_stop=False, min_tokens=4)
    assert _run(d, ids) == "ab.cd" and d.stopped


def test_special_tokens_kept_and_spaced():
    ids = [1001, ord("h"), ord("i"), 1002]
    assert _run(IncrementalDetokenizer(CharTok(), [65]), ids) == "hi"
    kept = IncrementalDetokenizer(CharTok(), [65], skip_special_tokens=False, special_ids={1001, 1002})
    assert _run(kept, ids) == "<s1001> hi <s1002>"
    tight = IncrementalDetokenizer(CharTok(), [65], skip_special_tokens=False, spaces_between_special_tokens=False,
                                   special_ids={1001, 1002})
    assert _run(tight, ids) == "<s1001>hi<s1002>"


# ---- the sampler: a thinking budget (Anthropic's thinking.budget_tokens)
OPEN_ID, CLOSE_ID = 8, 9


@pytest.mark.parametrize("output,opener,forced", [
    ([OPEN_ID, 2, 2], OPEN_ID, False),             # qwen3: 2 thinking tokens of 3
    ([OPEN_ID, 2, 2, 2], OPEN_ID, True),           # 3 of 3: the close tag is the only choice
    ([OPEN_ID, 2, CLOSE_ID, 2, 2, 2, 2], OPEN_ID, False),   # closed by the model itself
    ([2, 2, 2, 2], OPEN_ID, False),                # no thinking opened: an answer
    ([2, 2, 2], None, True),                       # deepseek_r1: the thinking starts with the output
    ([2, 2], None, False),
])
def test_a_spent_thinking_budget_closes_the_thinking(output, opener, forced):
    s = Sampler()
    logits = torch.zeros(1, 10)
    logits[0, 4] = 9.0
    got = s.sample(logits, [_item([1, *output], 1, thinking_budget=(3, CLOSE_ID, opener))])[0]
    assert got.token == (CLOSE_ID if forced else 4)
    # fp32 log-probs: the sampler's one-read log-sum-exp (a C kernel, its sum order per ISA) and torch's
    # log_softmax round differently, so both are held to the float64 value within fp32's error at this size.
    want = 0.0 if forced else torch.log_softmax(logits[0].double(), -1)[4].item()
    assert got.logprob == pytest.approx(want, abs=1e-6)


class ThinkTok(Tok):
    """Tok with `<think>` / `</think>` as one token each (Qwen3's, DeepSeek-R1's)."""

    def __call__(self, text, add_special_tokens=True):
        if text in ("<think>", "</think>"):
            return {"input_ids": [OPEN_ID if text == "<think>" else CLOSE_ID]}
        return super().__call__(text, add_special_tokens)


def test_messages_thinking_budget_reaches_the_sampler():
    from handler.http.protocols import anthropic
    body = {"max_tokens": 50, "messages": MSG, "thinking": {"type": "enabled", "budget_tokens": 7}}
    for parser, opener in (("qwen3", OPEN_ID), ("deepseek_r1", None)):
        gen = anthropic.parse(body, ThinkTok(), openai.ServerOptions(reasoning=parser))
        assert gen.params.thinking_budget == (7, CLOSE_ID, opener)
    # no reasoning parser, thinking disabled or no budget, or a close tag of several tokens: no budget
    assert anthropic.parse(body, ThinkTok()).params.thinking_budget is None
    off = {**body, "thinking": {"type": "disabled"}}
    assert anthropic.parse(off, ThinkTok(), openai.ServerOptions(reasoning="qwen3")).params.thinking_budget is None
    assert anthropic.parse(body, Tok(), openai.ServerOptions(reasoning="qwen3")).params.thinking_budget is None
