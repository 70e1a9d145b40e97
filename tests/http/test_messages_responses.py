"""Anthropic's Messages API and OpenAI's Responses API driven by their official clients (`anthropic`,
`openai`, the OpenAI Agents SDK, langchain-anthropic) against the real server on Qwen2.5-Coder-0.5B (fp32,
paged): answers checked for content, streams parsed event by event by each SDK's own typed models,
tool round trips, the response store, /invocations' protocol switch, token-id completions, and bad
input answered in each protocol's error shape."""
from __future__ import annotations

import json

import pytest
import requests
from pydantic import BaseModel

from tests.support.server import Server
from tests.test_real_qwen import PROPERTIES, hf_tok, qwen_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow

STORE_ITEMS = 6


@pytest.fixture(scope="module")
def srv(qwen_dir, tmp_path_factory):  # noqa: F811
    s = Server(PROPERTIES + f"option.responses_store_max_items={STORE_ITEMS}\n", qwen_dir,
               tmp_path_factory.mktemp("agents"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def claude(srv):
    import anthropic
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(srv):
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)


FRANCE = "What is the capital of France? Answer in one sentence."
WEATHER_Q = "What is the weather like in Paris right now?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
                  "required": ["city"]}
CLAUDE_TOOL = {"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_SCHEMA}
RESP_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
             "parameters": WEATHER_SCHEMA}


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny, 22 C in {city}"


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# ---- Anthropic Messages (the anthropic SDK 2.x sends no temperature: the model's generation config decides,
# greedy for this checkpoint)
def test_messages_create_and_count_tokens(claude, hf_tok):  # noqa: F811
    msgs = [{"role": "user", "content": FRANCE}]
    m = claude.messages.create(model="qwen", max_tokens=24, messages=msgs,
                               system="You are a helpful assistant.")
    assert m.type == "message" and m.role == "assistant" and "Paris" in _text(m), m
    assert m.stop_reason in ("end_turn", "max_tokens")
    want = len(hf_tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant."}, *msgs],
                                          tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    assert m.usage.input_tokens == want and 0 < m.usage.output_tokens <= 24
    counted = claude.messages.count_tokens(model="qwen", messages=msgs, system="You are a helpful assistant.")
    assert counted.input_tokens == want


def test_messages_stream_is_typed_and_equals_the_whole_answer(claude):
    msgs = [{"role": "user", "content": FRANCE}]
    whole = claude.messages.create(model="qwen", max_tokens=16, messages=msgs)
    kinds, pieces = [], []
    with claude.messages.stream(model="qwen", max_tokens=16, messages=msgs) as stream:
        for event in stream:        # the SDK's typed events (an unknown or out-of-order one raises)
            kinds.append(event.type)
            if event.type == "text":
                pieces.append(event.text)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") < kinds.index("content_block_stop")
    assert "".join(pieces) == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_messages_stop_sequence_is_named(claude):
    msgs = [{"role": "user", "content": FRANCE}]
    base = _text(claude.messages.create(model="qwen", max_tokens=16, messages=msgs))
    stop = base.split()[2]          # a word in the middle of the greedy answer
    m = claude.messages.create(model="qwen", max_tokens=16, messages=msgs,
                               stop_sequences=["zzzz", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == base[:base.index(stop)]


def test_messages_tool_use_round_trip(claude):
    first = claude.messages.create(model="qwen", max_tokens=48, tools=[CLAUDE_TOOL],
                                   messages=[{"role": "user", "content": WEATHER_Q}])
    assert first.stop_reason == "tool_use", first
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input["city"].startswith("Paris")
    result = get_weather(**use.input)
    # tool_choice none: this 0.5B model, still offered the tool, calls it again rather than answer
    second = claude.messages.create(model="qwen", max_tokens=48, tools=[CLAUDE_TOOL], tool_choice={"type": "none"},
                                    messages=[
        {"role": "user", "content": WEATHER_Q},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}])
    # the answer carries the tool's result: it reached the model through Qwen's template
    assert second.stop_reason in ("end_turn", "max_tokens") and "22" in _text(second), second


def test_messages_streamed_forced_tool_call(claude):
    # tool_choice {"type": "tool"}: the output is constrained to the tool's input schema
    with claude.messages.stream(model="qwen", max_tokens=32, tools=[CLAUDE_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": WEATHER_Q}]) as stream:
        partial = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    use = final.content[-1]
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert json.loads("".join(partial)) == use.input and isinstance(use.input["city"], str)


def test_langchain_anthropic_bind_tools(srv):
    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(base_url=srv.url, api_key="unused", model="qwen", max_tokens=48,
                         max_retries=0, timeout=300)
    msg = chat.bind_tools([get_weather]).invoke(WEATHER_Q)
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"], msg
    assert msg.tool_calls[0]["args"]["city"].startswith("Paris")


def _anthropic_error(r, field: str):
    assert 400 <= r.status_code < 500, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"].startswith(field), body
    return body


@pytest.mark.parametrize("change,field", [
    (lambda b: b.pop("max_tokens"), "max_tokens"),
    (lambda b: b.update(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                                "content": "?"}]}]),
     "messages[0].content[0].tool_use_id"),
    (lambda b: b.update(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (lambda b: b.update(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]), "messages[0].content[0]"),
])
def test_messages_bad_input_is_an_anthropic_4xx(srv, claude, change, field):
    import anthropic

    body = {"model": "qwen", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    change(body)
    got = _anthropic_error(requests.post(srv.url + "/v1/messages", json=body, timeout=60), field)
    assert got["error"]["message"].startswith(field + ":")
    if "max_tokens" in body:        # the SDK raises its typed error on our shape
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(**body)
        assert e.value.status_code == 400 and e.value.body == got


# ---- OpenAI Responses
def test_responses_create_retrieve_delete(oai):
    import openai

    r = oai.responses.create(model="qwen", input=FRANCE, max_output_tokens=24, temperature=0,
                             instructions="Answer briefly.")
    assert r.status in ("completed", "incomplete") and "Paris" in r.output_text, r
    assert r.usage.output_tokens <= 24 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_responses_stream_is_typed_and_equals_the_whole_answer(oai):
    whole = oai.responses.create(model="qwen", input=FRANCE, max_output_tokens=16, temperature=0)
    kinds, seqs = [], []
    with oai.responses.stream(model="qwen", input=FRANCE, max_output_tokens=16, temperature=0) as stream:
        for event in stream:        # the SDK's typed events, accumulated into its snapshot
            kinds.append(event.type)
            seqs.append(event.sequence_number)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.delta" in kinds
    assert seqs == list(range(len(seqs)))
    assert final.output_text == whole.output_text and final.status == whole.status


def test_responses_function_call_then_output_with_previous_response_id(oai):
    first = oai.responses.create(model="qwen", input=WEATHER_Q, tools=[RESP_TOOL], max_output_tokens=48,
                                 temperature=0)
    call = next(o for o in first.output if o.type == "function_call")
    args = json.loads(call.arguments)
    assert call.name == "get_weather" and args["city"].startswith("Paris")
    second = oai.responses.create(model="qwen", previous_response_id=first.id, tools=[RESP_TOOL], tool_choice="none",
                                  max_output_tokens=48, temperature=0, input=[
                                      {"type": "function_call_output", "call_id": call.call_id,
                                       "output": get_weather(**args)}])
    assert second.previous_response_id == first.id and "22" in second.output_text, second


def test_responses_text_format_json_schema(oai):
    class City(BaseModel):
        name: str
        country: str

    r = oai.responses.create(model="qwen", input="Paris is a city. Give its name and the country it is in.",
                             max_output_tokens=48, temperature=0, text={"format": {
                                 "type": "json_schema", "name": "city", "schema": City.model_json_schema()}})
    city = City.model_validate_json(r.output_text)
    assert city.name.startswith("Paris") and "France" in city.country


def test_responses_bad_input_is_an_openai_4xx(oai):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="qwen", input="hi", previous_response_id="resp_nope", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="qwen", max_output_tokens=4, input=[
            {"type": "function_call_output", "call_id": "call_nope", "output": "?"}])
    assert e.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="qwen", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    assert e.value.body["param"] == "input[0].content[0]"


def test_the_store_keeps_its_last_responses(oai):
    import openai

    ids = [oai.responses.create(model="qwen", input=f"Say {i}.", max_output_tokens=1, temperature=0).id
           for i in range(STORE_ITEMS + 1)]
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(ids[0])              # the least recently used went first
    assert oai.responses.retrieve(ids[-1]).id == ids[-1]
    not_kept = oai.responses.create(model="qwen", input="Say 1.", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(not_kept.id)


def test_agents_sdk_runner_completes_a_tool_loop(srv):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    called = []

    @function_tool
    def weather(city: str) -> str:
        """The current weather in a city."""
        called.append(city)
        return get_weather(city)

    model = OpenAIResponsesModel(model="qwen", openai_client=AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused",
                                                                         max_retries=0, timeout=300))
    agent = Agent(name="weather", instructions="Use the weather tool to answer.", tools=[weather], model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=48))
    result = Runner.run_sync(agent, WEATHER_Q, max_turns=3)
    assert called and called[0].startswith("Paris")
    assert "22" in result.final_output, result.final_output


# ---- /invocations' protocol switch, token-id completions
def test_invocations_picks_a_protocol_by_custom_attributes(srv):
    body = {"model": "qwen", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": FRANCE}]}
    h = {"X-Amzn-SageMaker-Custom-Attributes": "trace=1; protocol=anthropic-messages"}
    r = requests.post(srv.url + "/invocations", json=body, headers=h, timeout=300)
    direct = requests.post(srv.url + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["type"] == "message"
    assert r.json()["content"] == direct.json()["content"]
    r = requests.post(srv.url + "/invocations", json={"input": FRANCE, "max_output_tokens": 8, "temperature": 0},
                      headers={"X-Amzn-SageMaker-Custom-Attributes": "protocol=openai-responses"}, timeout=300)
    assert r.status_code == 200 and r.json()["object"] == "response" and r.json()["output"], r.text
    r = requests.post(srv.url + "/invocations", json=body, timeout=60,
                      headers={"X-Amzn-SageMaker-Custom-Attributes": "protocol=bedrock"})
    assert r.status_code == 400 and r.json()["field"] == "X-Amzn-SageMaker-Custom-Attributes"


def test_completions_take_token_id_prompts(srv, hf_tok):  # noqa: F811
    text = "def fibonacci(n):"
    ids = hf_tok(text)["input_ids"]
    body = {"model": "qwen", "max_tokens": 8, "temperature": 0}
    by_text = requests.post(srv.url + "/v1/completions", json={**body, "prompt": text}, timeout=300).json()
    one = requests.post(srv.url + "/v1/completions", json={**body, "prompt": ids}, timeout=300).json()
    many = requests.post(srv.url + "/v1/completions", json={**body, "prompt": [ids, ids[:3]]}, timeout=300).json()
    assert one["choices"][0]["text"] == by_text["choices"][0]["text"] == many["choices"][0]["text"]
    assert one["usage"]["prompt_tokens"] == len(ids) and len(many["choices"]) == 2
    echo = requests.post(srv.url + "/v1/completions", timeout=300,
                         json={**body, "prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    assert echo["choices"][0]["text"] == text and len(echo["choices"][0]["logprobs"]["tokens"]) == len(ids)
    bad = requests.post(srv.url + "/v1/completions", json={**body, "prompt": [[1, 10 ** 9]]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[0]"


# ---- lm-evaluation-harness: its local-completions model (token-id prompts, echo + logprobs) scores a
# log-likelihood task written here (the hub's datasets are unreachable); its numbers are the model's own
CAPITALS = [("France", ["Paris", "Lyon", "Madrid"], 0), ("Japan", ["Osaka", "Tokyo", "Seoul"], 1),
            ("Germany", ["Munich", "Vienna", "Berlin"], 2), ("Italy", ["Rome", "Milan", "Athens"], 0),
            ("Spain", ["Lisbon", "Madrid", "Barcelona"], 1), ("Canada", ["Toronto", "Vancouver", "Ottawa"], 2)]


def _capitals_task(d) -> str:
    with open(d / "capitals.jsonl", "w") as f:
        for country, choices, answer in CAPITALS:
            f.write(json.dumps({"country": country, "choices": choices, "answer": answer}) + "\n")
    (d / "capitals.yaml").write_text(
        "task: capitals_local\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {d / 'capitals.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: What is the capital of {{country}}?\\nAnswer:\"\n"
        "doc_to_target: answer\ndoc_to_choice: choices\ntarget_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return "capitals_local"


def test_lm_eval_local_completions_scores_a_loglikelihood_task(srv, qwen_dir, tmp_path, monkeypatch):  # noqa: F811
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[dev]'")
    import torch
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = _capitals_task(tmp_path)
    # No tokenizer on the client: lm-eval finds GET /tokenizer_info and tokenizes through /tokenize
    lm = LocalCompletionsAPI(base_url=srv.url + "/v1/completions", model="qwen", num_concurrent=2)
    assert lm.tokenizer_backend == "remote"
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tmp_path)),
                                  log_samples=True)
    samples = out["samples"][task]
    assert len(samples) == len(CAPITALS)
    # The oracle: transformers' fp32 forward over context + continuation, the continuation's log-probs summed
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    model = AutoModelForCausalLM.from_pretrained(qwen_dir, torch_dtype=torch.float32).eval()
    right = 0
    for s in samples:
        ctx = s["arguments"][0][0]
        want = []
        for (_, cont), resp in zip(s["arguments"], s["resps"]):
            a, b = tok(ctx, add_special_tokens=False)["input_ids"], tok(cont, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([a + b])).logits[0].double(), -1)
            want.append(sum(logp[len(a) + i - 1, t].item() for i, t in enumerate(b)))
            assert resp[0][0] == pytest.approx(want[-1], abs=2e-3), (ctx, cont)
        right += max(range(len(want)), key=want.__getitem__) == s["doc"]["answer"]
    assert out["results"][task]["acc,none"] == pytest.approx(right / len(CAPITALS))
    assert right >= len(CAPITALS) - 1       # the real model knows its capitals
