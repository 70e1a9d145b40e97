"""End to end on a real instruct model (SmolLM2-135M-Instruct, tests/conftest.py `real_model_dir`):
greedy parity with `model.generate` under every strategy, factual chat answers through the HTTP
server under every strategy, and streaming equal to the whole answer."""
from __future__ import annotations

import json

import pytest
import requests

from handler.engine.request import SamplingParams
from tests.support.engine import STRATEGIES, make_engine, run_all
from tests.support.reference import hf_greedy, tokenizer
from tests.support.server import Server

# (question, a word its answer must contain): what this model answers correctly at greedy.
FACTS = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
         ("What is the chemical symbol for water?", "H2O"), ("How many days are in a week?", "7")]
STRATEGY_PROPERTIES = {
    "none": "batch_size=1\n",
    "dynamic": "batch_size=4\nmax_batch_delay=50\n",
    "rolling": "option.rolling_batch=auto\noption.paged_attention=false\noption.max_rolling_batch_size=4\n",
    "paged": "option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=4\n",
}


def chat_prompt(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_parity_with_generate_on_the_real_model(strategy, real_model_dir, tmp_path):
    tok = tokenizer(real_model_dir)
    prompts = [chat_prompt(tok, q) for q, _ in FACTS]
    news = [24, 9, 17, 12]
    engine = make_engine(real_model_dir, tmp_path, {**STRATEGIES[strategy], "option.kv_cache_tokens": "1024"})
    try:
        results = run_all(engine, prompts, [SamplingParams(max_new_tokens=n) for n in news])
    finally:
        engine.shutdown()
    for p, n, (ids, _) in zip(prompts, news, results):
        assert ids == hf_greedy(real_model_dir, p, n), (strategy, p[-40:])


@pytest.fixture(scope="module", params=list(STRATEGY_PROPERTIES))
def real_server(request, real_model_dir, tmp_path_factory):
    srv = Server(STRATEGY_PROPERTIES[request.param], real_model_dir, tmp_path_factory.mktemp("real"))
    yield request.param, srv
    srv.stop()


def chat(srv, question: str, **extra) -> requests.Response:
    return requests.post(f"{srv.url}/v1/chat/completions", timeout=120,
                         json={"model": "m", "messages": [{"role": "user", "content": question}],
                               "max_tokens": 40, "temperature": 0, **extra})


@pytest.mark.slow
def test_chat_answers_facts_under_every_strategy(real_server):
    strategy, srv = real_server
    for question, word in FACTS:
        r = chat(srv, question)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert word in answer, (strategy, question, answer)


@pytest.mark.slow
def test_streamed_chat_equals_the_whole_answer(real_server):
    strategy, srv = real_server
    whole = chat(srv, FACTS[0][0]).json()["choices"][0]["message"]["content"]
    r = chat(srv, FACTS[0][0], stream=True)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    pieces, finish = [], None
    for line in r.iter_lines(decode_unicode=True):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        pieces.append(choice["delta"].get("content") or "")
        finish = choice.get("finish_reason") or finish
    assert "".join(pieces) == whole and "Paris" in whole, (strategy, pieces)
    assert finish == "stop"


@pytest.mark.slow
def test_a_gguf_model_id_serves_the_same_model(real_gguf, tmp_path):
    # option.model_id names the .gguf file itself: dequantized once into the model cache, then served.
    cache = tmp_path / "cache"
    srv = Server(f"option.model_id={real_gguf}\noption.rolling_batch=auto\n", str(tmp_path / "unused"), tmp_path,
                 env={"LMI_MODEL_CACHE": str(cache)})
    try:
        r = chat(srv, FACTS[0][0])
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        assert "is a GGUF file: dequantizing it" in srv.output()
        assert list((cache / "gguf").glob("SmolLM2-135M-Instruct.Q4_1-*-fp32/config.json"))
    finally:
        srv.stop()
