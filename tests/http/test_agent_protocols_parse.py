"""Anthropic's Messages and OpenAI's Responses without a model: what each body becomes (the chat the
template gets, the constraint), what each answer becomes (checked by the official SDKs' own types,
streams event by event), errors in each protocol's shape; the response store's bounds; token-id
completion prompts; /invocations' custom-attributes switch; the stop string a sequence ended on."""
from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from handler.engine.detok import IncrementalDetokenizer
from handler.engine.request import RequestError
from handler.engine.types import DoneEvent, ErrorEvent, TokenEvent
from handler.http.protocols import Sample, anthropic, openai, responses
from handler.http.protocols.store import ResponseStore
from handler.http.routes import attributes


class Tok:
    """A tokenizer stand-in: one token per character; records what the chat template got."""
    chat_template = "{% if tools %}<tool_call>{% endif %}"

    def __init__(self):
        self.msgs = self.tools = self.kwargs = None

    def __len__(self):
        return 1000

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, msgs, tools=None, tokenize=False, add_generation_prompt=True, **kw):
        self.msgs, self.tools, self.kwargs = msgs, tools, kw
        return json.dumps(msgs)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLAUDE_TOOL = {"name": "get_weather", "description": "weather", "input_schema": SCHEMA}
RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
CALL = '{"name": "get_weather", "arguments": {"city": "Lyon"}}'
QWEN3 = openai.ServerOptions(reasoning="qwen3")


def _events(text: str, done: DoneEvent, step: int = 3):
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    return [(0, 0, TokenEvent(1, p, 0.0, done if i == len(pieces) - 1 else None)) for i, p in enumerate(pieces)]


def _sse(lines) -> list[dict]:
    out = []
    for chunk in lines:
        head, data = chunk.strip("\n").split("\n")
        d = json.loads(data.removeprefix("data: "))
        assert head == f"event: {d['type']}"
        out.append(d)
    return out


# ---- Anthropic: request -> chat
def test_messages_become_the_chat_the_template_gets():
    tok = Tok()
    gen = anthropic.parse({
        "model": "claude", "max_tokens": 20, "system": [{"type": "text", "text": "be brief"}], "tools": [CLAUDE_TOOL],
        "stop_sequences": ["END"], "temperature": 0, "top_k": 5, "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "checking"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "down"}],
                                          "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": "try again"}]}]}, tok)
    assert tok.msgs == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "try again"}]
    assert tok.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                           "description": "weather"}}]
    p = gen.params
    assert p.max_new_tokens == 20 and p.stop_sequences == ("END",) and not p.do_sample and p.top_k == 5
    assert not p.include_stop_str_in_output and gen.extra["tools"].choice == "auto"


@pytest.mark.parametrize("choice,kind,constrained", [
    ({"type": "auto"}, "auto", False), ({"type": "any"}, "required", True),
    ({"type": "tool", "name": "get_weather"}, "named", True), ({"type": "none"}, "none", False)])
def test_tool_choice(choice, kind, constrained):
    gen = anthropic.parse({"max_tokens": 5, "tools": [CLAUDE_TOOL], "tool_choice": choice,
                           "messages": [{"role": "user", "content": "hi"}]}, Tok())
    tools = gen.extra["tools"]
    assert (tools.choice if tools is not None else "none") == kind
    assert (gen.params.guide is not None) == constrained


def test_thinking_reaches_the_template_only_under_a_reasoning_parser():
    body = {"max_tokens": 5, "thinking": {"type": "enabled", "budget_tokens": 2048},
            "messages": [{"role": "user", "content": "hi"}]}
    tok = Tok()
    anthropic.parse(body, tok, QWEN3)
    assert tok.kwargs == {"enable_thinking": True}
    anthropic.parse({**body, "thinking": {"type": "disabled"}}, tok, QWEN3)
    assert tok.kwargs == {"enable_thinking": False}
    anthropic.parse(body, tok)
    assert tok.kwargs == {}


@pytest.mark.parametrize("change,field", [
    (lambda b: b.pop("max_tokens"), "max_tokens"),
    (lambda b: b.update(max_tokens="8"), "max_tokens"),
    (lambda b: b.update(temperature=1.5), "temperature"),
    (lambda b: b.update(messages=[]), "messages"),
    (lambda b: b.update(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (lambda b: b.update(messages=[{"role": "user", "content": [{"type": "video"}]}]), "messages[0].content[0]"),
    (lambda b: b.update(messages=[{"role": "system", "content": "x"}]), "messages[0].role"),
    (lambda b: b.update(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]), "messages[0].content[0].tool_use_id"),
    (lambda b: b.update(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0]"),
    (lambda b: b.update(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), "messages[0].content[0]"),
    (lambda b: b.update(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (lambda b: b.update(tools=[{**CLAUDE_TOOL, "input_schema": {"type": "nonsense"}}]), "tools[0].input_schema"),
    (lambda b: b.update(tools=[CLAUDE_TOOL], tool_choice={"type": "tool"}), "tool_choice.name"),
    (lambda b: b.update(tools=[CLAUDE_TOOL], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
])
def test_bad_messages_name_the_field(change, field):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    change(body)
    with pytest.raises(RequestError) as e:
        anthropic.parse(body, Tok())
    assert e.value.field.startswith(field) and e.value.status == 400, (e.value.field, e.value.message)


def test_without_sampling_fields_the_generation_config_decides(tmp_path):
    from handler.http.protocols import answer
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    greedy = answer.model_sampling(str(tmp_path))             # no generation_config.json: transformers' default
    assert greedy == {"temperature": 0.0} and not anthropic.parse(body, Tok(), sampling=greedy).params.do_sample
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    p = anthropic.parse(body, Tok(), sampling=answer.model_sampling(str(tmp_path / "s"))).params
    assert p.do_sample and (p.temperature, p.top_p, p.top_k) == (0.7, 0.8, 20)
    p = anthropic.parse({**body, "top_k": 3}, Tok(), sampling=greedy).params    # a field given: Anthropic's defaults
    assert p.do_sample and p.temperature == 1.0 and p.top_k == 3


def test_count_tokens_needs_no_max_tokens():
    gen = anthropic.parse({"messages": [{"role": "user", "content": "hi"}]}, Tok(), count=True)
    assert gen.prompts == [json.dumps([{"role": "user", "content": "hi"}])]


def test_errors_in_anthropics_shape_and_codes():
    assert anthropic.error_body(400, "must be an integer", "max_tokens") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: must be an integer"}}
    assert anthropic.status(503) == 529 and anthropic.error_body(503, "full")["error"]["type"] == "overloaded_error"
    assert anthropic.status(424) == 500 and anthropic.error_body(424, "x")["error"]["type"] == "api_error"
    assert anthropic.error_body(504, "slow")["error"]["type"] == "timeout_error"


# ---- Anthropic: answer -> message / events (the SDK's types)
@pytest.mark.parametrize("finish,stop,text,want", [
    ("eos_token", None, "Paris.", ("end_turn", None)),
    ("length", None, "Paris", ("max_tokens", None)),
    ("stop_sequence", "END", "Paris", ("stop_sequence", "END")),
    ("stop_sequence", None, "Paris", ("end_turn", None)),       # a stop token id: no string to name
    ("eos_token", None, CALL, ("tool_use", None))])
def test_message_stop_reasons(finish, stop, text, want):
    import anthropic as sdk
    gen = anthropic.parse({"max_tokens": 9, "tools": [CLAUDE_TOOL], "messages": [{"role": "user", "content": "?"}]},
                          Tok())
    out = sdk.types.Message.model_validate(
        anthropic.encode(gen, [Sample(0, 0, [], DoneEvent(finish, text, 4, 7, stop_string=stop))], "m"))
    assert (out.stop_reason, out.stop_sequence) == want and out.usage.input_tokens == 7
    if want[0] == "tool_use":
        assert out.content[0].type == "tool_use" and out.content[0].input == {"city": "Lyon"}
        assert out.content[0].id.startswith("toolu_")
    else:
        assert [b.type for b in out.content] == ["text"] and out.content[0].text == text


@pytest.mark.parametrize("text,server,blocks", [
    ("The capital is Paris.", openai.ServerOptions(), [("text", "The capital is Paris.")]),
    ("<think>easy</think>\n\nParis.", QWEN3, [("thinking", "easy"), ("text", "Paris.")]),
    (CALL, openai.ServerOptions(), [("tool_use", {"city": "Lyon"})]),
])
def test_message_stream_is_anthropics_event_sequence(text, server, blocks):
    import anthropic as sdk
    from anthropic.lib.streaming._messages import accumulate_event
    gen = anthropic.parse({"max_tokens": 9, "stream": True, "tools": [CLAUDE_TOOL],
                           "messages": [{"role": "user", "content": "?"}]}, Tok(), server)
    gen.prompt_tokens = [11]
    done = DoneEvent("eos_token", text, 6, 11)
    events = _sse(anthropic.stream(gen, iter(_events(text, done)), "m"))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    typed = TypeAdapter(sdk.types.RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for e in events:
        if e["type"] != "ping":
            snapshot = accumulate_event(event=typed.validate_python(e), current_snapshot=snapshot, json_bufs=bufs)
    got = [(b.type, b.text if b.type == "text" else b.thinking if b.type == "thinking" else b.input)
           for b in snapshot.content]
    if blocks[0][0] == "tool_use":
        assert got[-1] == blocks[0] and snapshot.stop_reason == "tool_use"
    else:
        assert got == blocks and snapshot.stop_reason == "end_turn"
    assert snapshot.usage.input_tokens == 11 and snapshot.usage.output_tokens == 6


def test_message_stream_error_event():
    gen = anthropic.parse({"max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "?"}]}, Tok())
    events = _sse(anthropic.stream(gen, iter([(0, 0, TokenEvent(1, "Pa", 0.0)), (0, 0, ErrorEvent(504, "timed out"))]),
                                   "m"))
    assert events[-1] == {"type": "error", "error": {"type": "timeout_error", "message": "timed out"}}


# ---- Responses: request -> chat
def test_responses_items_become_the_chat():
    tok = Tok()
    gen = responses.parse({
        "model": "m", "instructions": "be brief", "tools": [RESP_TOOL], "max_output_tokens": 7, "temperature": 0,
        "input": [{"role": "developer", "content": "use tools"},
                  {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
                   "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}, tok)
    assert tok.msgs == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "use tools"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    assert gen.params.max_new_tokens == 7 and not gen.params.do_sample


def test_responses_text_format_is_guided_decoding():
    gen = responses.parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA}}},
                          Tok())
    assert gen.params.guide is not None and json.loads(gen.params.guide.value) == SCHEMA
    assert responses.parse({"input": "x", "text": {"format": {"type": "json_object"}}}, Tok()).params.guide.kind == \
        "json_object"
    assert responses.parse({"input": "x", "text": {"format": {"type": "text"}}}, Tok()).params.guide is None


@pytest.mark.parametrize("body,field,status", [
    ({}, "input", 400),
    ({"input": 3}, "input", 400),
    ({"input": "x", "previous_response_id": "resp_x"}, "previous_response_id", 404),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "?"}]}, "input[0].call_id", 400),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", 400),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", 400),
    ({"input": [{"content": "no role, no type"}]}, "input[0]", 400),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    ({"input": "x", "background": True}, "background", 400),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", 400),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "c", "schema": {"type": 5}}}},
     "text.format.schema", 400),
    ({"input": "x", "tools": [RESP_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name",
     400),
])
def test_bad_responses_name_the_field(body, field, status):
    with pytest.raises(RequestError) as e:
        responses.parse(body, Tok())
    assert e.value.field.startswith(field) and e.value.status == status, (e.value.field, e.value.message)
    assert "\n" not in e.value.message and "Input tag" not in e.value.message and "Unable to" not in e.value.message


# ---- Responses: answer -> response / events (the SDK's types), the store
def test_response_object_and_its_record_continue_the_conversation():
    from openai.types.responses import Response
    tok, store = Tok(), ResponseStore(10, 10 ** 6)
    gen = responses.parse({"input": "weather?", "tools": [RESP_TOOL]}, tok)
    out = Response.model_validate(responses.encode(gen, [Sample(0, 0, [], DoneEvent("eos_token", CALL, 9, 5))], "m"))
    call = out.output[0]
    assert out.status == "completed" and call.type == "function_call" and json.loads(call.arguments) == {"city": "Lyon"}
    store.put(out.id, responses.record(gen, out.model_dump()))
    responses.parse({"previous_response_id": out.id, "tools": [RESP_TOOL],
                     "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]}, tok,
                    lookup=store.get)
    assert [m["role"] for m in tok.msgs] == ["user", "assistant", "tool"]
    assert tok.msgs[1]["tool_calls"][0]["id"] == call.call_id
    cut = responses.encode(gen, [Sample(0, 0, [], DoneEvent("length", "It is", 2, 5))], "m")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("text,server,kinds", [
    ("Paris.", openai.ServerOptions(), ["message"]),
    ("<think>easy</think>Paris.", QWEN3, ["reasoning", "message"]),
    (CALL, openai.ServerOptions(), ["function_call"]),
])
def test_response_stream_is_the_responses_event_sequence(text, server, kinds):
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent
    gen = responses.parse({"input": "?", "tools": [RESP_TOOL], "stream": True}, Tok(), server)
    done, kept = DoneEvent("eos_token", text, 6, 11), []
    events = _sse(responses.stream(gen, iter(_events(text, done)), "m", kept.append))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed" and kept == [events[-1]["response"]]
    typed, state = TypeAdapter(ResponseStreamEvent), ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(typed.validate_python(e))    # the SDK's own accumulator, as responses.stream uses it
    assert [o.type for o in state._completed_response.output] == kinds


def test_store_is_bounded_by_count_and_bytes():
    rec = {"text": "x" * 100}
    n = ResponseStore.size(rec)
    s = ResponseStore(3, 10 * n)
    for i in range(4):
        assert s.put(f"r{i}", rec)
    assert s.get("r0") is None and len(s) == 3 and s.bytes == 3 * n        # by count, oldest first
    s.get("r1")                                                             # r1 is now the most recent
    s = ResponseStore(100, 2 * n + n // 2)
    for i in range(3):
        s.put(f"r{i}", rec)
    assert s.get("r0") is None and s.get("r1") == rec and s.bytes == 2 * n  # by bytes
    s.get("r1")
    s.put("r3", rec)
    assert s.get("r2") is None and s.get("r1") == rec                      # least recently used went
    assert not s.put("big", {"text": "x" * 10 * n}) and s.get("big") is None
    assert s.delete("r1") and not s.delete("r1") and s.bytes == n
    assert not ResponseStore(0, 10 ** 6).put("r", rec)


# ---- token-id prompts, the custom-attributes switch, the stop string
def test_completion_prompts_as_token_ids():
    tok = Tok()
    one = openai.parse_completion({"prompt": [104, 105]}, tok)
    assert one.prompt_ids == [[104, 105]] and one.prompts == ["hi"] and not one.is_list
    many = openai.parse_completion({"prompt": [[104], [105, 106]]}, tok)
    assert many.prompt_ids == [[104], [105, 106]] and many.is_list and many.fields == ["prompt[0]", "prompt[1]"]
    assert openai.parse_completion({"prompt": ["a", "b"]}, tok).prompt_ids is None
    for bad, field in (([], "prompt"), ([[]], "prompt"), ([1, "a"], "prompt"), ([[1], "a"], "prompt"),
                       ([True], "prompt"), ([[5, 1000]], "prompt[0]"), ([-1], "prompt")):
        with pytest.raises(RequestError) as e:
            openai.parse_completion({"prompt": bad}, tok)
        assert e.value.field == field, bad


def test_custom_attributes_pick_the_protocol():
    assert attributes.protocol(None) is None and attributes.protocol("trace=1") is None
    assert attributes.protocol("trace=1; protocol=anthropic-messages") == "anthropic-messages"
    assert attributes.protocol("protocol = openai-responses,x=y") == "openai-responses"
    with pytest.raises(RequestError) as e:
        attributes.protocol("protocol=bedrock")
    assert e.value.field == attributes.HEADER and "protocol=anthropic-messages" in e.value.message


class CharTok:
    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("include", [True, False])
def test_the_detokenizer_names_the_stop_string_it_ended_on(include):
    d = IncrementalDetokenizer(CharTok(), [], stop_sequences=["zz", "cde", "bc"], include_stop=include)
    text = ""
    for c in "abcdef":
        text += d.add(ord(c))
        if d.stopped:
            break
    assert d.matched == "bc" and text == ("abc" if include else "a")
