"""Real clients, unmodified, against a real server: `openai` (chat, completions, streaming, n > 1),
`huggingface_hub.InferenceClient` (text generation, details, streaming) against a tgi_compat server,
and plain `requests` replaying bodies from LMI's docs and integration client with exact key checks.
Greedy answers are checked against `model.generate` on the same (chat-templated) prompt."""
from __future__ import annotations

import json

import pytest
import requests
import torch

from tests.support.reference import _load, hf_greedy
from tests.support.server import Server

pytestmark = pytest.mark.slow

FILES = {
    "paged": "engine=MPI\noption.rolling_batch=auto\noption.max_rolling_batch_size=8\n"
             "option.kv_cache_tokens=4096\noption.block_size=8\n",
    "dynamic": "engine=Python\nbatch_size=4\nmax_batch_delay=20\n",
}
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is deep learning?"}]


@pytest.fixture(scope="module", params=list(FILES))
def server(request, demo_model_dir, tmp_path_factory):
    srv = Server(FILES[request.param], demo_model_dir, tmp_path_factory.mktemp("api"))
    srv.strategy = request.param
    yield srv
    srv.stop()


def chat_greedy(model_dir, messages, n):
    """`model.generate` on the chat-templated prompt: (prompt ids, generated ids, text)."""
    tok, model = _load(model_dir)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    gen = out[0, ids.shape[1]:].tolist()
    return ids[0].tolist(), gen, tok.decode(gen, skip_special_tokens=True)


def greedy_text(model_dir, prompt, n):
    tok, _ = _load(model_dir)
    return tok.decode(hf_greedy(model_dir, prompt, n), skip_special_tokens=True)


def oai(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- openai
def test_openai_chat_greedy_equals_generate(server, demo_model_dir):
    client = oai(server)
    prompt_ids, want_ids, want = chat_greedy(demo_model_dir, CHAT, 12)
    r = client.chat.completions.create(model="demo", messages=CHAT, temperature=0, max_tokens=12,
                                       logprobs=True)
    assert r.object == "chat.completion" and r.model == "demo" and len(r.choices) == 1
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want
    assert c.finish_reason == ("stop" if len(want_ids) < 12 else "length")
    assert "".join(t.token for t in c.logprobs.content) == want
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(want_ids)
    assert r.usage.total_tokens == len(prompt_ids) + len(want_ids)
    models = client.models.list()
    assert [m.id for m in models.data] == [demo_model_dir.rstrip("/").split("/")[-1]]


def test_openai_chat_streaming_with_usage(server, demo_model_dir):
    client = oai(server)
    _, want_ids, want = chat_greedy(demo_model_dir, CHAT, 10)
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT, temperature=0, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["stop" if len(want_ids) < 10 else "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_ids)


def test_openai_completions_greedy_stream_and_echo(server, demo_model_dir):
    client = oai(server)
    prompts = ["def fibonacci(n):", "import os\n"]
    r = client.completions.create(model="demo", prompt=prompts, max_tokens=6, temperature=0, logprobs=2)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts):
        assert c.text == greedy_text(demo_model_dir, p, 6)
        assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.top_logprobs) == len(c.logprobs.tokens)
    r = client.completions.create(model="demo", prompt=prompts[0], max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == prompts[0] + greedy_text(demo_model_dir, prompts[0], 6)
    parts = [ch.choices[0].text for ch in client.completions.create(
        model="demo", prompt=prompts[1], max_tokens=6, temperature=0, stream=True)]
    assert "".join(parts) == greedy_text(demo_model_dir, prompts[1], 6)


def test_openai_n_samples_reproducible_with_seed(server):
    client = oai(server)
    kw = dict(model="demo", messages=CHAT, max_tokens=8, n=3, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    streamed = {}
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in a.choices]


def test_openai_errors_are_openai_shaped(server):
    import openai
    client = oai(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=CHAT, temperature=5)
    assert e.value.body["param"] == "temperature" and "2" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:      # beyond the model's length: OpenAI's field name
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=100_000)
    assert e.value.body["param"] == "max_tokens" and "max_model_len" in e.value.body["message"]
    r = requests.post(server.url + "/v1/nope", json={}, timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- LMI bodies, replayed as LMI's docs and integration client send them
TOKEN_KEYS = {"id", "text", "log_prob"}


def _token_ok(t):
    assert set(t) in (TOKEN_KEYS, TOKEN_KEYS | {"special_token"}), t


def test_lmi_documented_bodies_exact_keys(server, demo_model_dir):
    post = server.post
    # lmi_input_output_schema.md, rolling batch example (non-streaming and streaming)
    body = {"inputs": "What is Deep Learning?", "parameters": {"do_sample": True, "max_new_tokens": 64,
                                                               "details": True}}
    out = post(body).json()
    assert set(out) == {"generated_text", "details"}
    assert set(out["details"]) == {"finish_reason", "generated_tokens", "inputs", "tokens"}
    assert out["details"]["inputs"] == "What is Deep Learning?"
    for t in out["details"]["tokens"]:
        _token_ok(t)
    # tests/integration/llm/client.py test_handler_rolling_batch, vLLM spec with decoder_input_details
    body = {"inputs": "DeepSpeed is a machine learning framework",
            "parameters": {"do_sample": False, "max_new_tokens": 16, "details": True}, "stream": False}
    out = post(body).json()
    assert out["generated_text"] == greedy_text(demo_model_dir, body["inputs"], 16)
    # client.py test_handler_performance: max_new_tokens at the top level is not a parameter (dropped)
    out = post({"inputs": "He is working on", "max_new_tokens": 8}).json()
    assert set(out) == {"generated_text"}
    # client.py test_handler: a client-side batch
    batch = ["DeepSpeed is a machine learning framework", "He is working on", "He has a", "He got all"]
    out = post({"inputs": batch, "parameters": {"max_new_tokens": 8}, "stream": False}).json()
    assert isinstance(out, list) and [set(o) for o in out] == [{"generated_text"}] * 4
    assert [o["generated_text"] for o in out] == [greedy_text(demo_model_dir, p, 8) for p in batch]
    # vLLM names LMI passes through
    body = {"inputs": "He has a", "parameters": {"max_new_tokens": 6, "top_k": -1, "stop": ["\n\n\n"],
                                                 "ignore_eos_token": False, "min_p": 0.0, "n": 1}}
    assert post(body).json()["generated_text"] == greedy_text(demo_model_dir, "He has a", 6)
    # text/plain: {"inputs": [text]} in LMI, so a list comes back
    r = requests.post(server.url + "/invocations", data="He got all", headers={"content-type": "text/plain"},
                      timeout=60)
    assert r.status_code == 200 and [set(o) for o in r.json()] == [{"generated_text"}]


def test_lmi_streaming_body_exact_keys(server):
    body = {"inputs": "What is Deep Learning?", "parameters": {"do_sample": True, "max_new_tokens": 32,
                                                               "details": True}, "stream": True}
    with requests.post(server.url + "/invocations", json=body, stream=True, timeout=120) as r:
        assert r.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(x) for x in r.iter_lines() if x]
    for ln in lines[:-1]:
        assert set(ln) == {"token"}
        _token_ok(ln["token"])
    assert set(lines[-1]) == {"token", "generated_text", "details"}
    assert set(lines[-1]["details"]) == {"finish_reason", "generated_tokens", "inputs"}
    assert lines[-1]["generated_text"] == "".join(ln["token"]["text"] for ln in lines)


def test_lmi_chat_bodies_exact_keys(server, demo_model_dir):
    # chat_input_output_schema.md example, and client.py batch_generation_chat with logprobs
    out = server.post({"messages": CHAT, "logprobs": True, "top_logprobs": 1, "max_tokens": 16,
                       "temperature": 0}).json()
    assert set(out) == {"id", "object", "created", "choices", "usage"} and out["object"] == "chat.completion"
    (c,) = out["choices"]
    assert set(c) == {"index", "message", "logprobs", "finish_reason"}
    assert c["message"] == {"role": "assistant", "content": chat_greedy(demo_model_dir, CHAT, 16)[2]}
    assert c["finish_reason"] in ("length", "eos_token")           # LMI's names on /invocations
    for lp in c["logprobs"]["content"]:
        assert set(lp) == {"token", "logprob", "bytes", "top_logprobs"} and len(lp["top_logprobs"]) == 1
    assert set(out["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    msgs = [{"role": "user", "content": "hello, can you help me?"},
            {"role": "assistant", "content": "Hi, what can i help you with today?"},
            {"role": "user", "content": "What is deep learning in your opinion? How does it help human?"}]
    body = {"messages": msgs, "max_tokens": 16, "logprobs": True, "top_logprobs": 1, "stream": True}
    with requests.post(server.url + "/invocations", json=body, stream=True, timeout=120) as r:
        assert r.headers["content-type"].startswith("application/jsonlines")
        chunks = [json.loads(x) for x in r.iter_lines() if x]
    assert all(set(ch) == {"id", "object", "created", "choices"} for ch in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


def test_top_tokens_and_prefill(server, demo_model_dir):
    tok, model = _load(demo_model_dir)
    out = server.post({"messages": CHAT, "logprobs": True, "top_logprobs": 2, "max_tokens": 4,
                       "temperature": 0}).json()
    for lp in out["choices"][0]["logprobs"]["content"]:
        assert len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["logprob"] >= lp["top_logprobs"][1]["logprob"]
        assert lp["top_logprobs"][0]["token"] == lp["token"]          # greedy: the chosen one is the top one
    prompt = "DeepSpeed is a machine learning framework"
    out = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 4, "details": True,
                                                        "decoder_input_details": True, "top_n_tokens": 3}}).json()
    ids = tok(prompt)["input_ids"]
    pre = out["details"]["prefill"]
    assert [p["id"] for p in pre] == ids and pre[0]["log_prob"] is None
    with torch.no_grad():   # the oracle: HF's logits over the prompt positions
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for i in range(1, len(ids)):
        assert abs(pre[i]["log_prob"] - want[i - 1, ids[i]].item()) < 1e-3
    assert all(len(t) == 3 for t in out["details"]["top_tokens"])


def test_lmi_samples_best_of_and_truncate(server, demo_model_dir):
    tok, model = _load(demo_model_dir)
    prompt = "DeepSpeed is a machine learning framework"
    # greedy samples are all model.generate's answer
    out = server.post({"inputs": prompt, "parameters": {"max_new_tokens": 6, "n": 2}}).json()
    want = greedy_text(demo_model_dir, prompt, 6)
    assert out["generated_text"] == want
    assert [s["generated_text"] for s in out["details"]["best_of_sequences"]] == [want]
    # sampled: the answer is the most likely of best_of, the others follow in order
    out = server.post({"inputs": prompt, "parameters": {"do_sample": True, "best_of": 3, "seed": 7,
                                                        "max_new_tokens": 6, "details": True}}).json()
    seqs = [out["details"]] + out["details"]["best_of_sequences"]
    assert len(seqs) == 3 and set(out["details"]["best_of_sequences"][0]) == {
        "finish_reason", "generated_tokens", "tokens", "generated_text"}
    scores = [sum(t["log_prob"] for t in s["tokens"]) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    assert out["generated_text"] == "".join(t["text"] for t in seqs[0]["tokens"])
    # truncate keeps the last N prompt tokens (TGI's meaning)
    ids = tok(prompt)["input_ids"]
    out = server.post({"inputs": prompt, "parameters": {"truncate": 4, "max_new_tokens": 5, "details": True,
                                                        "decoder_input_details": True}}).json()
    assert [p["id"] for p in out["details"]["prefill"]] == ids[-4:]
    with torch.no_grad():
        x = torch.tensor([ids[-4:]])
        want_ids = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False,
                                  pad_token_id=tok.pad_token_id)[0, 4:].tolist()
    assert [t["id"] for t in out["details"]["tokens"]] == want_ids


# ---- TGI
@pytest.fixture(scope="module")
def tgi_server(demo_model_dir, tmp_path_factory):
    srv = Server(FILES["paged"], demo_model_dir, tmp_path_factory.mktemp("tgi"), env={"OPTION_TGI_COMPAT": "true"})
    yield srv
    srv.stop()


@pytest.mark.parametrize("route", ["", "/invocations"])
def test_huggingface_hub_text_generation(tgi_server, demo_model_dir, route, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    # The client refuses every URL under HF_HUB_OFFLINE, even loopback; this one is our server.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(base_url=tgi_server.url + route)
    prompt = "def fibonacci(n):"
    want_ids = hf_greedy(demo_model_dir, prompt, 10)
    want = greedy_text(demo_model_dir, prompt, 10)
    assert client.text_generation(prompt, max_new_tokens=10) == want
    r = client.text_generation(prompt, max_new_tokens=10, details=True)
    assert r.generated_text == want and [t.id for t in r.details.tokens] == want_ids
    assert r.details.finish_reason == ("eos_token" if len(want_ids) < 10 else "length")
    assert r.details.generated_tokens == len(want_ids)
    stream = list(client.text_generation(prompt, max_new_tokens=10, stream=True, details=True))
    assert [s.token.id for s in stream] == want_ids
    assert all(isinstance(s.token.logprob, float) for s in stream)
    assert stream[-1].generated_text == want and stream[-1].details.generated_tokens == len(want_ids)
    assert "".join(client.text_generation(prompt, max_new_tokens=10, stream=True)) == want


def test_tgi_routes_and_compat_shapes(tgi_server, demo_model_dir):
    r = requests.post(tgi_server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 3}},
                      timeout=60)
    assert set(r.json()) == {"generated_text"}                      # TGI: details only when asked
    r = requests.post(tgi_server.url + "/invocations", json={"inputs": "x", "parameters": {"max_new_tokens": 3}},
                      timeout=60)
    (out,) = r.json()                                               # LMI tgi_compat: a list, details on
    assert set(out["details"]) == {"finish_reason", "generated_tokens", "inputs", "tokens"}
    assert all({"id", "text", "logprob"} <= set(t) for t in out["details"]["tokens"])
    r = requests.post(tgi_server.url + "/generate", json={"inputs": "x", "parameters": {"temperature": -1}},
                      timeout=60)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
