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
    # (a bounded KV pool: the default takes 70 % of the memory free, a lot on a shared test host)
    srv = Server(f"option.model_id={real_gguf}\noption.rolling_batch=auto\noption.kv_cache_tokens=16384\n",
                 str(tmp_path / "unused"), tmp_path,
                 env={"LMI_MODEL_CACHE": str(cache)})
    try:
        r = chat(srv, FACTS[0][0])
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        assert "is a GGUF file: dequantizing it" in srv.output()
        assert list((cache / "gguf").glob("SmolLM2-135M-Instruct.Q4_1-*-fp32/config.json"))
    finally:
        srv.stop()


@pytest.mark.slow
def test_stop_sequences_and_several_samples_on_the_real_model(real_server):
    strategy, srv = real_server
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    whole = srv.post({"inputs": prompt, "parameters": {"max_new_tokens": 20}}).json()["generated_text"]
    assert "Paris" in whole
    # LMI: the text ends right after the first stop sequence, finish_reason stop_sequence.
    r = srv.post({"inputs": prompt, "parameters": {"max_new_tokens": 20, "stop_sequences": ["Paris"],
                                                   "details": True}}).json()
    assert r["generated_text"] == whole[:whole.index("Paris") + len("Paris")], (strategy, r)
    assert r["details"]["finish_reason"] == "stop_sequence"
    # n samples: the answer and n - 1 others, each a real answer, all seeded (repeatable).
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 12, "n": 3, "do_sample": True, "temperature": 0.7,
                                             "seed": 7, "details": True}}
    first, again = srv.post(body).json(), srv.post(body).json()
    others = first["details"]["best_of_sequences"]
    assert len(others) == 2 and all(o["generated_text"] for o in others), first
    assert first == again


def test_a_lora_adapter_on_the_real_model_matches_peft_merged_generate(real_model_dir, tmp_path):
    import os

    from transformers import AutoModelForCausalLM

    from tests.support.lora import build_adapter, greedy

    model_dir = tmp_path / "model"          # the real model's files, plus adapters/ of our own
    model_dir.mkdir()
    for name in os.listdir(real_model_dir):
        (model_dir / name).symlink_to(os.path.join(real_model_dir, name))
    merged = build_adapter(str(model_dir), str(model_dir / "adapters" / "fr"), 3, ["q_proj", "v_proj", "down_proj"],
                           r=8, alpha=256)   # strong enough to change a 135 M model's answer
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = tokenizer(real_model_dir)
    prompts = [chat_prompt(tok, q) for q, _ in FACTS[:2]]
    engine = make_engine(str(model_dir), tmp_path, {"option.rolling_batch": "auto", "option.enable_lora": "true",
                                                    "option.max_loras": "1", "option.kv_cache_tokens": "1024"})
    try:
        lora = engine.runner.lora
        params = [SamplingParams(max_new_tokens=10, adapter=a) for a in (lora.get("fr"), None)] * 2
        got = run_all(engine, [prompts[0], prompts[0], prompts[1], prompts[1]], params)
    finally:
        engine.shutdown()
    for (ids, _), p, model in zip(got, [prompts[0], prompts[0], prompts[1], prompts[1]], [merged, base] * 2):
        assert ids == greedy(model, tok, p, 10)
    assert got[0][0] != got[1][0] or got[2][0] != got[3][0]     # the adapter changes the answers
