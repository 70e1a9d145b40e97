"""What agent frameworks and evaluation harnesses send, against the real server on Qwen2.5-Coder-0.5B
(fp32, paged): instructor and langchain-openai get validated objects, an eval-harness log-likelihood
request gets the prompt's log-probs (equal to the LMI route's and to a transformers forward pass),
vLLM's sampling extras do what they mean, and /tokenize, /detokenize count as the tokenizer does."""
from __future__ import annotations

import json
import math

import pytest
import requests
from pydantic import BaseModel

from tests.support.server import Server
from tests.test_real_qwen import PROPERTIES, hf_tok, oai, qwen_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(qwen_dir, tmp_path_factory):  # noqa: F811
    s = Server(PROPERTIES, qwen_dir, tmp_path_factory.mktemp("agent"))
    yield s
    s.stop()


class City(BaseModel):
    name: str
    country: str


CITY_Q = [{"role": "user", "content": "Paris is a city. Give its name and the country it is in."}]


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


# ---- real clients
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_gets_a_validated_object(srv, mode):
    import instructor

    # JSON_SCHEMA: response_format json_schema; TOOLS: tools + tool_choice naming the function
    client = instructor.from_openai(oai(srv), mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(model="qwen", response_model=City, messages=CITY_Q, temperature=0,
                                          max_tokens=48, max_retries=0)
    assert isinstance(city, City)
    assert city.name.startswith("Paris") and "France" in city.country, city


def _chat_model(srv, **kw):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=srv.url + "/v1", api_key="unused", model="qwen", temperature=0, max_tokens=48,
                      max_retries=0, timeout=300, **kw)


def test_langchain_bind_tools_gets_a_tool_call(srv):
    # tool_choice is not sent (auto): the call comes from the model's own text, in Qwen's format
    msg = _chat_model(srv).bind_tools([get_weather]).invoke("What is the weather like in Paris right now?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"], msg
    assert msg.tool_calls[0]["args"]["city"].startswith("Paris")
    assert get_weather(**msg.tool_calls[0]["args"]).startswith("sunny in Paris")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(srv, method):
    city = _chat_model(srv).with_structured_output(City, method=method).invoke(CITY_Q)
    assert isinstance(city, City) and city.name.startswith("Paris") and "France" in city.country, city


# ---- prompt log-probs (lm-evaluation-harness local-completions, HELM)
TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def test_eval_harness_loglikelihood_equals_the_lmi_route_and_a_forward_pass(srv, qwen_dir, hf_tok):  # noqa: F811
    import torch

    from tests.support import reference as ref

    r = requests.post(f"{srv.url}/v1/completions", timeout=300,
                      json={"model": "qwen", "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1,
                            "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == TEXT and r.json()["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    ids = hf_tok(TEXT)["input_ids"]
    assert "".join(lp["tokens"]) == TEXT and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]

    lmi = srv.post({"inputs": TEXT, "parameters": {"max_new_tokens": 1, "details": True,
                                                   "decoder_input_details": True}}).json()
    prefill = lmi["details"]["prefill"]
    assert [p["id"] for p in prefill] == ids and prefill[0]["log_prob"] is None
    for ours, theirs in zip(lp["token_logprobs"][1:], prefill[1:]):
        assert abs(ours - theirs["log_prob"]) <= 1e-4

    tok, model = ref._load(qwen_dir)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    argmax = logits[:-1].argmax(dim=-1).tolist()
    ref._load.cache_clear()
    for k, (ours, w) in enumerate(zip(lp["token_logprobs"][1:], want)):
        assert abs(ours - w) <= 2e-3, (k, ours, w)
    # is_greedy as the harness computes it: the token is the most likely of top_logprobs
    tops = lp["top_logprobs"]
    greedy = [lp["tokens"][i] == max(tops[i], key=tops[i].get) for i in range(1, len(ids))]
    assert greedy == [a == t for a, t in zip(argmax, ids[1:])]


def test_vllm_prompt_logprobs(srv, hf_tok):  # noqa: F811
    r = requests.post(f"{srv.url}/v1/completions", timeout=300,
                      json={"model": "qwen", "prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0,
                            "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    pl, ids = choice["prompt_logprobs"], hf_tok(TEXT)["input_ids"]
    assert pl[0] is None and len(pl) == len(ids)
    for k in range(1, len(ids)):
        entry = pl[k][str(ids[k])]
        assert abs(entry["logprob"] - choice["logprobs"]["token_logprobs"][k]) <= 1e-6
        best = [v for v in pl[k].values() if v["rank"] == 1]
        assert len(best) == 1 and best[0]["logprob"] >= entry["logprob"]
        assert (entry["rank"] == 1) == (best[0]["decoded_token"] == entry["decoded_token"])


# ---- the sampling extras, by what they mean (LMI parameters and OpenAI fields: one request model)
def lmi(srv, inputs, **params):
    r = srv.post({"inputs": inputs, "parameters": {"max_new_tokens": 12, "details": True, **params}})
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_end_the_sequence(srv):
    base = lmi(srv, "def fibonacci(n):")
    ids = [t["id"] for t in base["details"]["tokens"]]
    k = 4
    stop = ids[k]
    cut = lmi(srv, "def fibonacci(n):", stop_token_ids=[stop])
    got = [t["id"] for t in cut["details"]["tokens"]]
    assert got == ids[:ids.index(stop) + 1] and cut["details"]["finish_reason"] == "stop_sequence"
    r = requests.post(f"{srv.url}/v1/completions", timeout=300,
                      json={"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop]})
    assert r.json()["choices"][0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == len(got)


def test_min_tokens_suppresses_eos_until_reached(srv, hf_tok):  # noqa: F811
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "Reply with only the word yes."}],
                                        tokenize=False, add_generation_prompt=True)
    base = lmi(srv, prompt, max_new_tokens=20)
    n = base["details"]["generated_tokens"]
    assert base["details"]["finish_reason"] == "eos_token" and n < 10, base
    longer = lmi(srv, prompt, max_new_tokens=20, min_tokens=n + 4)
    toks = longer["details"]["tokens"]
    assert len(toks) >= n + 4
    eos = {hf_tok.convert_tokens_to_ids("<|im_end|>"), hf_tok.convert_tokens_to_ids("<|endoftext|>")}
    assert not eos & {t["id"] for t in toks[:n + 3]}
    assert [t["id"] for t in toks[:n - 1]] == [t["id"] for t in base["details"]["tokens"][:n - 1]]
    # the stop token ids too: the token that ended `base` is banned before min_tokens
    r = lmi(srv, prompt, max_new_tokens=20, min_tokens=n + 2, stop_token_ids=list(eos))
    assert r["details"]["generated_tokens"] >= n + 2


def test_bad_words_are_never_produced(srv):
    base = lmi(srv, "The capital of France is")
    assert "Paris" in base["generated_text"], base
    banned = lmi(srv, "The capital of France is", bad_words=["Paris"])
    assert "Paris" not in banned["generated_text"], banned
    r = requests.post(f"{srv.url}/v1/completions", timeout=300,
                      json={"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                            "bad_words": ["Paris", "France"]})
    text = r.json()["choices"][0]["text"]
    assert "Paris" not in text and "France" not in text, text


def test_skip_special_tokens_and_the_spaces_between_them(srv, hf_tok):  # noqa: F811
    start = hf_tok.convert_tokens_to_ids("<|im_start|>")
    force = {"logit_bias": {str(start): 100.0}, "max_new_tokens": 3}
    assert lmi(srv, "Hello", **force)["generated_text"] == ""
    assert lmi(srv, "Hello", skip_special_tokens=False, **force)["generated_text"] == \
        "<|im_start|> <|im_start|> <|im_start|>"
    assert lmi(srv, "Hello", skip_special_tokens=False, spaces_between_special_tokens=False,
               **force)["generated_text"] == "<|im_start|><|im_start|><|im_start|>"


def test_truncate_prompt_tokens_keeps_the_last_tokens(srv, hf_tok):  # noqa: F811
    prompt = "import os\nimport sys\nimport json\n" * 4 + "def main():"
    r = requests.post(f"{srv.url}/v1/completions", timeout=300,
                      json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 8 < len(hf_tok(prompt)["input_ids"])
    tail = hf_tok.decode(hf_tok(prompt)["input_ids"][-8:])
    same = requests.post(f"{srv.url}/v1/completions", timeout=300,
                         json={"prompt": tail, "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]


# ---- /tokenize, /detokenize
def test_tokenize_and_detokenize(srv, hf_tok):  # noqa: F811
    for path in ("/tokenize", "/v1/tokenize"):
        r = requests.post(srv.url + path, json={"prompt": "Hello, world!"}, timeout=60).json()
        assert r["tokens"] == hf_tok("Hello, world!")["input_ids"] and r["count"] == len(r["tokens"])
        assert r["max_model_len"] >= 4096
    msgs = [{"role": "user", "content": "Hi"}]
    r = requests.post(srv.url + "/tokenize", json={"messages": msgs}, timeout=60).json()
    assert r["tokens"] == hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True)["input_ids"]
    back = requests.post(srv.url + "/v1/detokenize", json={"tokens": r["tokens"]}, timeout=60).json()
    assert back["prompt"] == hf_tok.decode(r["tokens"]) and "<|im_start|>user\nHi" in back["prompt"]
    bad = requests.post(srv.url + "/detokenize", json={"tokens": [10 ** 7]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert math.isfinite(len(json.dumps(bad.json())))


def test_openai_streamed_auto_tool_call(srv):
    # the model's own (untagged) call, streamed: held back as a possible call, then OpenAI's tool-call deltas
    from tests.test_real_qwen import WEATHER
    stream = oai(srv).chat.completions.create(
        model="qwen", temperature=0, max_tokens=48, tools=[WEATHER], stream=True,
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}])
    content, heads, args, finish = "", [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id:
                heads.append((tc.index, tc.type, tc.function.name))
            args += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and heads == [(0, "function", "get_weather")] and finish == "tool_calls"
    assert json.loads(args)["city"].startswith("Paris"), args
