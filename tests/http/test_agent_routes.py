"""The Messages and Responses routes through the Flask app on the engine with a fake runner (no
model): each protocol's shape on its routes (framework errors included), the response store behind
GET / DELETE and previous_response_id with its property bound, /invocations' custom-attributes
switch, and token-id completion prompts."""
from __future__ import annotations

import json

import pytest

from tests.http.test_hardening import make_app

MSG = [{"role": "user", "content": "Hello there"}]


@pytest.fixture
def app(demo_model_dir, tmp_path):
    made = []

    def make(props="option.rolling_batch=auto\n"):
        made.append(make_app(demo_model_dir, tmp_path, props, max_model_len=256))
        return made[-1][1]

    yield make
    for state, _ in made:
        state.engine.shutdown()


def _sse(r) -> list[dict]:
    out = []
    for chunk in r.get_data(as_text=True).strip().split("\n\n"):
        head, data = chunk.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {out[-1]['type']}"
    return out


def test_messages_route(app):
    import anthropic
    client = app()
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSG},
                    headers={"anthropic-version": "2023-06-01", "x-api-key": "k"})
    assert r.status_code == 200, r.get_data(as_text=True)
    m = anthropic.types.Message.model_validate(r.get_json())
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4 and m.content[0].type == "text"
    counted = client.post("/v1/messages/count_tokens", json={"model": "m", "messages": MSG}).get_json()
    assert counted == {"input_tokens": m.usage.input_tokens}
    events = _sse(client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSG, "stream": True}))
    assert [e["type"] for e in events][:2] == ["message_start", "ping"] and events[-1]["type"] == "message_stop"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == m.content[0].text and events[0]["message"]["usage"]["input_tokens"] == m.usage.input_tokens


@pytest.mark.parametrize("method,path,body,status,kind,start", [
    ("post", "/v1/messages", {"messages": MSG}, 400, "invalid_request_error", "max_tokens: is required"),
    ("post", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]}, 400, "invalid_request_error",
     "messages[0].content[0].tool_use_id:"),
    ("post", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "txt"}]}]}, 400,
     "invalid_request_error", "messages[0].content[0]: has an unknown type"),
    ("get", "/v1/messages", None, 405, "invalid_request_error", "GET is not allowed"),
    ("post", "/v1/messages/batches", {}, 404, "not_found_error", "no route"),
])
def test_messages_errors_are_anthropics_shape(app, method, path, body, status, kind, start):
    r = getattr(app(), method)(path, json=body)
    assert r.status_code == status
    got = r.get_json()
    assert got["type"] == "error" and got["error"]["type"] == kind and got["error"]["message"].startswith(start), got


def test_responses_store_get_delete_and_continue(app):
    client = app()
    first = client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3}).get_json()
    assert first["object"] == "response" and first["status"] == "incomplete" and first["store"]
    assert client.get(f"/v1/responses/{first['id']}").get_json() == first
    second = client.post("/v1/responses", json={"input": "More", "max_output_tokens": 3,
                                                "previous_response_id": first["id"]}).get_json()
    # the stored conversation (the first input, its answer) precedes the new input
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 3
    assert client.delete(f"/v1/responses/{first['id']}").get_json() == {
        "id": first["id"], "object": "response", "deleted": True}
    gone = client.get(f"/v1/responses/{first['id']}")
    assert gone.status_code == 404 and gone.get_json()["error"]["param"] == "response_id"
    r = client.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]})
    assert r.status_code == 404 and r.get_json()["error"]["param"] == "previous_response_id"
    assert client.delete(f"/v1/responses/{first['id']}").status_code == 404
    unstored = client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2, "store": False})
    assert client.get(f"/v1/responses/{unstored.get_json()['id']}").status_code == 404


def test_input_items_through_the_openai_sdk(app):
    """GET /v1/responses/<id>/input_items in OpenAI's list shape, read by the openai SDK itself (over WSGI)."""
    import httpx
    import openai
    client = app()
    sdk = openai.OpenAI(base_url="http://lmi/v1", api_key="k",
                        http_client=httpx.Client(transport=httpx.WSGITransport(app=client.application)))
    first = sdk.responses.create(model="m", input="Hello", max_output_tokens=2)
    second = sdk.responses.create(model="m", max_output_tokens=2, previous_response_id=first.id, input=[
        {"role": "user", "content": "More"}, {"type": "message", "role": "user", "content": "please"}])
    # the whole conversation second answered: Hello, first's answer, More, please; newest first by default
    page = sdk.responses.input_items.list(second.id)
    texts = [it.content[0].text for it in page.data]
    assert texts == ["please", "More", first.output_text, "Hello"]
    assert [it.role for it in page.data] == ["user", "user", "assistant", "user"]
    assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id and not page.has_more
    assert len({it.id for it in page.data}) == 4
    assert [it.content[0].text for it in sdk.responses.input_items.list(first.id).data] == ["Hello"]
    # limit / order / after: pages in ascending order, each after the last one's id
    one = sdk.responses.input_items.list(second.id, limit=2, order="asc")
    assert [it.content[0].text for it in one.data] == ["Hello", first.output_text] and one.has_more
    two = sdk.responses.input_items.list(second.id, limit=2, order="asc", after=one.last_id)
    assert [it.content[0].text for it in two.data] == ["More", "please"] and not two.has_more
    assert [it.id for it in sdk.responses.input_items.list(second.id, order="asc")] == \
        [it.id for it in one.data + two.data]      # the SDK's auto-paging follows `after` too
    with pytest.raises(openai.NotFoundError, match="no stored response 'resp_nope'"):
        sdk.responses.input_items.list("resp_nope")
    for query, field in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"), ("after=zz", "after")):
        r = client.get(f"/v1/responses/{second.id}/input_items?{query}")
        assert r.status_code == 400 and r.get_json()["error"]["param"] == field, (query, r.get_json())


def test_a_streamed_response_is_stored_whole(app):
    client = app()
    events = _sse(client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 3, "stream": True}))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["output"][0]["content"][0]["text"]
    assert client.get(f"/v1/responses/{final['id']}").get_json() == final


def test_the_store_bound_is_the_property(app):
    client = app("option.rolling_batch=auto\noption.responses_store_max_items=2\n")
    ids = [client.post("/v1/responses", json={"input": f"n{i}", "max_output_tokens": 1}).get_json()["id"]
           for i in range(3)]
    assert [client.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]


def test_invocations_custom_attributes(app):
    client = app()
    body = {"max_tokens": 3, "messages": MSG}
    pick = {"X-Amzn-SageMaker-Custom-Attributes": "protocol=anthropic-messages"}
    r = client.post("/invocations", json=body, headers=pick)
    assert r.status_code == 200 and r.get_json()["type"] == "message"
    assert r.get_json()["content"] == client.post("/v1/messages", json=body).get_json()["content"]
    bad = client.post("/invocations", json={"messages": MSG},
                      headers={"X-Amzn-SageMaker-Custom-Attributes": "protocol=anthropic-messages"})
    assert bad.status_code == 400 and bad.get_json()["error"]["message"].startswith("max_tokens")
    r = client.post("/invocations", json={"input": "Hi", "max_output_tokens": 2},
                    headers={"X-Amzn-SageMaker-Custom-Attributes": "a=b,protocol=openai-responses"})
    assert r.status_code == 200 and r.get_json()["object"] == "response"
    lmi = client.post("/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                      headers={"X-Amzn-SageMaker-Custom-Attributes": "trace=on"})
    assert lmi.status_code == 200 and "generated_text" in lmi.get_json()
    r = client.post("/invocations", json=body, headers={"X-Amzn-SageMaker-Custom-Attributes": "protocol=x"})
    assert r.status_code == 400 and r.get_json()["field"] == "X-Amzn-SageMaker-Custom-Attributes"


def test_completions_token_id_prompts(app, demo_model_dir):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(demo_model_dir)("def main():")["input_ids"]
    client = app()
    by_text = client.post("/v1/completions", json={"prompt": "def main():", "max_tokens": 3, "temperature": 0})
    by_ids = client.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 3, "temperature": 0})
    assert by_ids.status_code == 200, by_ids.get_data(as_text=True)
    assert [c["text"] for c in by_ids.get_json()["choices"]] == [by_text.get_json()["choices"][0]["text"]] * 2
    assert by_ids.get_json()["usage"]["prompt_tokens"] == 2 * len(ids)


def test_a_full_queue_is_anthropics_overloaded_on_messages(demo_model_dir, tmp_path):
    state, client = make_app(demo_model_dir, tmp_path, "option.rolling_batch=auto\noption.max_rolling_batch_size=1\n"
                                                       "job_queue_size=1\n")
    try:
        while state.admission.enter():      # every place taken, as by requests in flight
            pass
        r = client.post("/v1/messages", json={"max_tokens": 2, "messages": MSG})
        assert r.status_code == 529 and r.get_json()["error"]["type"] == "overloaded_error"
        assert "job_queue_size" in r.get_json()["error"]["message"]
        lmi = client.post("/invocations", json={"inputs": "x"})
        assert lmi.status_code == 503 and "job_queue_size" in lmi.get_json()["error"]
    finally:
        state.engine.shutdown()
