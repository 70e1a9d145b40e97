"""Every pooling route through the real app (Flask's test client; the pooling engine and runner on tiny
random checkpoints): each answer against the runner's own vectors or transformers' logits, and the bad
requests: each a 400 naming the field or the key."""
from __future__ import annotations

import base64
import math
import struct

import pytest
import torch

from handler.config import load_config
from handler.http.app import ServerState, create_app
from handler.server import build_engine


def make_app(model_dir, tmp_path, props=""):
    path = tmp_path / "serving.properties"
    path.write_text(props)
    cfg = load_config(str(path), model_dir, env={})
    state = ServerState(cfg)
    state.engine = build_engine(cfg)
    return state, create_app(state).test_client()


@pytest.fixture(scope="module")
def embedder(tiny_bert, tmp_path_factory):
    state, client = make_app(tiny_bert, tmp_path_factory.mktemp("emb"))
    yield state, client
    state.engine.shutdown()


@pytest.fixture(scope="module")
def cross(tiny_cross_encoder, tmp_path_factory):
    state, client = make_app(tiny_cross_encoder, tmp_path_factory.mktemp("ce"))
    yield state, client
    state.engine.shutdown()


def vectors(state, texts):
    """The runner's own vectors for texts, one forward each (the reference the routes must return)."""
    from handler.engine.pooling import PoolInput
    runner = state.engine.runner
    return [runner.pool([PoolInput(runner.tokenizer(t)["input_ids"])], "embed")[0] for t in texts]


def close(a, b, tol=1e-5):
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol, (a[:4], b[:4])


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


TEXTS = ["the cat", "paris is the capital of france", "a dog with a car"]


def test_task_detected_from_the_checkpoint(embedder, cross):
    assert embedder[0].cfg.task == "text_embedding" and embedder[0].client.pooling
    assert cross[0].cfg.task == "rerank"


def test_openai_embeddings_float_base64_dimensions_usage(embedder):
    state, c = embedder
    want = vectors(state, TEXTS)
    r = c.post("/v1/embeddings", json={"input": TEXTS, "model": "m"})
    assert r.status_code == 200, r.json
    body = r.json
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    for d, w in zip(body["data"], want):
        close(d["embedding"], w)
    tok = state.engine.runner.tokenizer
    n = sum(len(tok(t)["input_ids"]) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    one = c.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json["data"][0]["embedding"]
    raw = base64.b64decode(one)
    close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), want[1], 1e-6)
    short = c.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 8}).json["data"][0]["embedding"]
    head = want[0][:8]
    norm = math.sqrt(sum(x * x for x in head))
    close(short, [x / norm for x in head])
    ids = tok(TEXTS[2])["input_ids"]
    by_ids = c.post("/v1/embeddings", json={"input": [ids, ids]}).json["data"]
    close(by_ids[0]["embedding"], want[2])
    assert len(by_ids) == 2


def test_lmi_tei_and_openai_routes_agree(embedder):
    state, c = embedder
    want = vectors(state, TEXTS)
    single = c.post("/invocations", json={"inputs": TEXTS[0]}).json
    close(single, want[0])
    batch = c.post("/invocations", json={"inputs": TEXTS}).json
    for got, w in zip(batch, want):
        close(got, w)
    for got, w in zip(c.post("/embed", json={"inputs": TEXTS}).json, want):
        close(got, w)
    assert len(c.post("/embed", json={"inputs": TEXTS[0]}).json) == 1    # TEI: always a list of vectors
    openai_on_invocations = c.post("/invocations", json={"input": TEXTS[:1]}).json
    close(openai_on_invocations["data"][0]["embedding"], want[0])


def test_long_inputs_are_refused_with_the_limit_unless_truncation_is_asked(embedder):
    state, c = embedder
    limit = state.engine.max_model_len
    long = "cat " * (limit + 10)
    r = c.post("/v1/embeddings", json={"input": ["dog", long]})
    assert r.status_code == 400
    err = r.json["error"]
    assert err["param"] == "input[1]" and f"at most {limit}" in err["message"] and "truncate_prompt_tokens" in err["message"]
    r = c.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json["usage"]["prompt_tokens"] == limit
    r = c.post("/embed", json={"inputs": long})
    assert r.status_code == 400 and "inputs" in r.json["error"]
    r = c.post("/embed", json={"inputs": long, "truncate": True})
    assert r.status_code == 200
    close(r.json[0], vectors(state, ["cat " * (limit - 2)])[0])     # [CLS] + the first tokens + [SEP]


def test_rerank_and_score_on_an_embedding_model_use_the_cosine(embedder):
    state, c = embedder
    q, docs = "capital of france", ["the cat", "paris is the capital of france", "a dog"]
    vq, *vd = vectors(state, [q, *docs])
    want = [cos(vq, v) for v in vd]
    tei = c.post("/rerank", json={"query": q, "texts": docs, "return_text": True}).json
    assert [d["index"] for d in tei] == sorted(range(3), key=lambda i: -want[i])
    for d in tei:
        assert abs(d["score"] - want[d["index"]]) < 1e-5 and d["text"] == docs[d["index"]]
    cohere = c.post("/v1/rerank", json={"query": q, "documents": docs, "top_n": 2}).json
    assert len(cohere["results"]) == 2
    best = max(range(3), key=lambda i: want[i])
    assert cohere["results"][0]["index"] == best and cohere["results"][0]["document"] == {"text": docs[best]}
    assert abs(cohere["results"][0]["relevance_score"] - want[best]) < 1e-5
    same = c.post("/rerank", json={"query": q, "documents": [{"text": d} for d in docs],
                                   "return_documents": False}).json
    assert [r["index"] for r in same["results"]] == [d["index"] for d in tei] and "document" not in same["results"][0]
    score = c.post("/score", json={"text_1": q, "text_2": docs}).json
    for d in score["data"]:
        assert abs(d["score"] - want[d["index"]]) < 1e-5


def test_cross_encoder_rerank_predict_and_score_equal_transformers(cross, tiny_cross_encoder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    _, c = cross
    tok = AutoTokenizer.from_pretrained(tiny_cross_encoder)
    hf = AutoModelForSequenceClassification.from_pretrained(tiny_cross_encoder, dtype=torch.float32).eval()
    q, docs = "capital of france", ["the cat", "paris is the capital of france", "a dog"]
    with torch.no_grad():
        logits = [hf(**tok(q, d, return_tensors="pt")).logits[0, 0].item() for d in docs]
    sig = [1 / (1 + math.exp(-x)) for x in logits]
    tei = c.post("/rerank", json={"query": q, "texts": docs}).json
    assert [d["index"] for d in tei] == sorted(range(3), key=lambda i: -sig[i])
    for d in tei:
        assert abs(d["score"] - sig[d["index"]]) < 1e-5
    raw = c.post("/rerank", json={"query": q, "texts": docs, "raw_scores": True}).json
    for d in raw:
        assert abs(d["score"] - logits[d["index"]]) < 1e-4
    cohere = c.post("/v1/rerank", json={"query": q, "documents": docs}).json["results"]
    assert [r["index"] for r in cohere] == [d["index"] for d in tei]
    score = c.post("/v1/score", json={"text_1": [q, q], "text_2": docs[:2]}).json["data"]
    assert [round(d["score"], 5) for d in score] == [round(s, 5) for s in sig[:2]]
    pred = c.post("/predict", json={"inputs": [q, docs[1]]}).json
    assert pred[0]["label"] == "LABEL_0" and abs(pred[0]["score"] - sig[1]) < 1e-5
    inv = c.post("/invocations", json={"inputs": [[q, docs[0]], [q, docs[1]]]}).json
    assert [round(p[0]["score"], 5) for p in inv] == [round(s, 5) for s in sig[:2]]


@pytest.mark.parametrize("path,body,field", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["ok", 7]}, "input[1]"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input[1]"),
    ("/v1/embeddings", {"model": "m"}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input[1]"),
    ("/v1/embeddings", {"input": [[1, 2], [3, 10 ** 9]]}, "input[1]"),
    ("/v1/embeddings", {"input": [-1, 2]}, "input"),
    ("/invocations", {"inputs": []}, "inputs"),
    ("/invocations", {"inputs": [None]}, "inputs[0]"),
    ("/embed", {"inputs": ["a", {"t": 1}]}, "inputs[1]"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/rerank", {"query": "q", "texts": ["a", 3]}, "texts[1]"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "option.task"),
    ("/generate", {"inputs": "hi"}, "option.task"),
    ("/predict", {"inputs": "hi"}, "option.task"),
])
def test_bad_requests_name_the_field(embedder, path, body, field):
    r = embedder[1].post(path, json=body)
    assert r.status_code in (400, 422), (path, r.status_code, r.json)
    text = r.get_data(as_text=True)
    assert field in text, (path, text)
    if path == "/generate":
        return      # TGI's shape (422)
    assert r.status_code == 400


def test_embedding_request_to_a_text_generator_names_option_task(demo_model_dir, tmp_path):
    path = tmp_path / "serving.properties"
    path.write_text("")
    cfg = load_config(str(path), demo_model_dir, env={})
    assert cfg.task == "generate"
    state = ServerState(cfg)
    state.engine = object()     # a generator's engine: never reached, the routes refuse first
    c = create_app(state).test_client()
    for route, body in (("/v1/embeddings", {"input": "hi"}), ("/embed", {"inputs": "hi"}),
                        ("/v1/rerank", {"query": "q", "documents": ["a"]})):
        r = c.post(route, json=body)
        assert r.status_code == 400 and "option.task" in r.get_data(as_text=True), (route, r.json)


def test_metrics_count_the_pooling_engine(embedder):
    from tests.support.server import flat_metrics
    c = embedder[1]
    before = flat_metrics(c.get("/metrics").get_data(as_text=True))
    assert c.post("/v1/embeddings", json={"input": ["the cat", "a dog"]}).status_code == 200
    after = flat_metrics(c.get("/metrics").get_data(as_text=True))
    assert after["lmi_pooling_inputs_total"] - before["lmi_pooling_inputs_total"] == 2
    assert after["lmi_pooling_requests_total"] - before["lmi_pooling_requests_total"] == 1


def test_openapi_declares_the_pooling_routes_the_app_serves(embedder):
    c = embedder[1]
    doc = c.get("/openapi.json").json
    pooled = ["/v1/embeddings", "/embed", "/predict", "/rerank", "/v1/rerank", "/score"]
    for path in pooled:
        assert path in doc["paths"], path
        r = c.post(path, json={})
        assert r.status_code == 400, (path, r.status_code)     # a served route refusing an empty body
    assert doc["components"]["schemas"]["EmbeddingsRequest"]["required"] == ["input"]


def test_option_normalize_false_serves_the_pooled_vectors(tiny_bert, tmp_path):
    state, c = make_app(tiny_bert, tmp_path, "option.normalize=false\n")
    try:
        runner = state.engine.runner
        assert state.cfg.normalize is False and not runner.spec.normalize
        got = c.post("/v1/embeddings", json={"input": "the cat"}).json["data"][0]["embedding"]
        ids = runner.tokenizer("the cat")["input_ids"]
        h = runner.model(torch.tensor(ids), torch.zeros(len(ids), dtype=torch.long), [(0, len(ids))])
        close(got, h.mean(0).tolist())
        assert abs(math.sqrt(sum(x * x for x in got)) - 1.0) > 1e-3      # not unit length
        close(c.post("/embed", json={"inputs": "the cat"}).json[0], [x / math.sqrt(sum(y * y for y in got))
                                                                     for x in got])   # TEI's normalize=true
    finally:
        state.engine.shutdown()


def test_vectors_response_is_the_json_of_its_body():
    # orjson's floats parse back to the same floats as json's; what orjson refuses (a lone surrogate
    # echoed from a client) still answers, through json_response's escape
    import json

    from handler.http.routes.common import json_response, vectors_response
    g = torch.Generator().manual_seed(0)
    vec = torch.nn.functional.normalize(torch.randn(384, generator=g), dim=0).tolist() + [1e-300, 3.0, -0.0]
    body = {"data": [{"index": 0, "embedding": vec}], "model": "m", "usage": {"prompt_tokens": 3}}
    resp = vectors_response(body)
    assert resp.mimetype == "application/json" and resp.status_code == 200
    assert json.loads(resp.get_data()) == body == json.loads(json_response(body).get_data())
    odd = {"model": "a\udc80b", "data": [0.5]}
    data = vectors_response(odd).get_data()
    assert b"a\\udc80b" in data and json.loads(data) == odd
