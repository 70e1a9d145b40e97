"""all-MiniLM-L6-v2 (sentence-transformers', from its pinned PyPI wheel) served by us equals
sentence-transformers' own embeddings: cosine >= 0.99999 in fp32, >= 0.999 with option.quantize=int8, for
short, long, non-English and code texts, alone and batched, on every embedding route of a live server;
the openai SDK and langchain-openai as clients; a rerank call."""
from __future__ import annotations

import base64
import struct

import pytest
import requests
import torch

from handler.engine.pooling import PoolInput
from handler.model.pooling import PoolingRunner
from tests.support.server import Server

LONG = ("Retrieval-augmented generation systems first embed a user's question, then search a vector index "
        "for the passages whose embeddings lie closest to it, rerank the candidates with a cross-encoder, "
        "and finally hand the best passages to a language model as context. Each stage has its own "
        "latency budget: the embedding call must return within a few milliseconds, the vector search "
        "scans millions of rows with an approximate index such as HNSW or IVF, and the reranker reads "
        "every candidate together with the question. ") * 2
TEXTS = {
    "short": "Hello world",
    "question": "What is the capital of France?",
    "long": LONG,
    "german": "Der schnelle braune Fuchs springt über den faulen Hund, während die Züge pünktlich fahren.",
    "japanese": "東京は日本の首都であり、世界有数の大都市です。",
    "chinese": "机器学习是人工智能的一个分支。",
    "arabic": "القاهرة هي عاصمة مصر وأكبر مدنها.",
    "code": "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "json": '{"name": "lmi-serve", "tags": ["llm", "embedding"], "version": 1.0}',
}
ALL = list(TEXTS.values())


@pytest.fixture(scope="module")
def reference(st_minilm):
    return torch.tensor(st_minilm.encode(ALL, convert_to_numpy=True, batch_size=1))


def cosines(got, ref) -> list[float]:
    return torch.nn.functional.cosine_similarity(torch.tensor(got, dtype=torch.float32), ref).tolist()


def test_the_long_text_fits_the_model_and_is_long(minilm_dir, st_minilm):
    n = len(st_minilm.tokenizer(LONG)["input_ids"])
    assert 150 < n <= 256, n       # under the model's max_seq_length: sentence-transformers does not cut it


@pytest.mark.parametrize("quantize,floor", [(None, 0.99999), ("int8", 0.999)])
def test_runner_equals_sentence_transformers(minilm_dir, reference, quantize, floor):
    r = PoolingRunner(minilm_dir, "text_embedding", quantize=quantize)
    assert r.max_model_len == 256 and r.spec.mode == "mean" and r.spec.normalize
    inputs = [PoolInput(r.tokenizer(t)["input_ids"]) for t in ALL]
    batched = cosines(r.pool(inputs, "embed"), reference)
    alone = cosines([r.pool([x], "embed")[0] for x in inputs], reference)
    assert min(batched) >= floor and min(alone) >= floor, (dict(zip(TEXTS, batched)), dict(zip(TEXTS, alone)))


def _routes(url: str) -> dict[str, tuple[list, list]]:
    """Each route's vectors for every text: (alone, batched)."""
    def post(path, body):
        r = requests.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, (path, r.text)
        return r.json()

    def unb64(s):
        raw = base64.b64decode(s)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))

    out = {
        "/v1/embeddings": ([post("/v1/embeddings", {"input": t})["data"][0]["embedding"] for t in ALL],
                           [d["embedding"] for d in post("/v1/embeddings", {"input": ALL})["data"]]),
        "/v1/embeddings base64": (
            [unb64(post("/v1/embeddings", {"input": t, "encoding_format": "base64"})["data"][0]["embedding"])
             for t in ALL],
            [unb64(d["embedding"]) for d in post("/v1/embeddings", {"input": ALL, "encoding_format": "base64"})["data"]]),
        "/invocations": ([post("/invocations", {"inputs": t}) for t in ALL], post("/invocations", {"inputs": ALL})),
        "/embed": ([post("/embed", {"inputs": t})[0] for t in ALL], post("/embed", {"inputs": ALL})),
    }
    return out


@pytest.fixture(scope="module")
def server(minilm_dir, tmp_path_factory):
    srv = Server("batch_size=8\nmax_batch_delay=5\n", minilm_dir, tmp_path_factory.mktemp("minilm"))
    yield srv
    srv.stop()


def test_every_route_equals_sentence_transformers_fp32(server, reference):
    for route, (alone, batched) in _routes(server.url).items():
        for name, got in (("alone", alone), ("batched", batched)):
            c = cosines(got, reference)
            assert min(c) >= 0.99999, (route, name, dict(zip(TEXTS, c)))


def test_every_route_equals_sentence_transformers_int8(minilm_dir, reference, tmp_path):
    srv = Server("option.quantize=int8\n", minilm_dir, tmp_path)
    try:
        for route, (alone, batched) in _routes(srv.url).items():
            for name, got in (("alone", alone), ("batched", batched)):
                c = cosines(got, reference)
                assert min(c) >= 0.999, (route, name, dict(zip(TEXTS, c)))
    finally:
        srv.stop()


def test_openai_sdk_embeddings_create(server, reference):
    openai = pytest.importorskip("openai", reason="the openai SDK (dev extras) is the client under test")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    resp = client.embeddings.create(model="all-minilm-l6-v2", input=ALL)    # the SDK asks for base64
    assert min(cosines([d.embedding for d in resp.data], reference)) >= 0.99999
    assert resp.usage.prompt_tokens > len(ALL)
    one = client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS["code"], encoding_format="float")
    assert cosines([one.data[0].embedding], reference[ALL.index(TEXTS["code"])][None])[0] >= 0.99999
    short = client.embeddings.create(model="m", input="Hello world", dimensions=64).data[0].embedding
    assert len(short) == 64 and abs(sum(x * x for x in short) - 1.0) < 1e-5


def test_langchain_openai_embeddings(server, reference):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai (dev extras) is the client under test")
    # check_embedding_ctx_length=False: send the texts (the default sends tiktoken ids, OpenAI's own vocabulary)
    emb = lc.OpenAIEmbeddings(model="all-minilm-l6-v2", base_url=server.url + "/v1", api_key="none",
                              check_embedding_ctx_length=False)
    docs = emb.embed_documents(ALL)
    assert min(cosines(docs, reference)) >= 0.99999
    q = emb.embed_query(TEXTS["question"])
    assert cosines([q], reference[1][None])[0] >= 0.99999


def test_rerank_orders_by_sentence_transformers_similarity(server, st_minilm):
    from sentence_transformers.util import cos_sim
    q = "Which city is the capital of France?"
    docs = ["Bananas are rich in potassium.", "Paris is the capital and largest city of France.",
            "The Eiffel Tower is in Paris.", TEXTS["code"]]
    want = cos_sim(st_minilm.encode([q]), st_minilm.encode(docs))[0].tolist()
    r = requests.post(server.url + "/v1/rerank", json={"model": "m", "query": q, "documents": docs, "top_n": 3},
                      timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -want[i])[:3]
    assert results[0]["index"] == 1 and results[0]["document"]["text"] == docs[1]
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5


def test_sagemaker_runtime_invoke_endpoint_gets_embeddings(server, reference):
    """boto3's sagemaker-runtime InvokeEndpoint (what SageMaker's Predictor calls) through the loopback
    stand-in of the runtime API, with LMI's embedding body."""
    import json

    import boto3

    from tests.support.sagemaker_standin import RuntimeStandIn
    with RuntimeStandIn({"emb": server.url}) as standin:
        rt = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                   region_name="us-east-1").client("sagemaker-runtime", endpoint_url=standin.url)
        out = rt.invoke_endpoint(EndpointName="emb", ContentType="application/json", Accept="application/json",
                                 Body=json.dumps({"inputs": ALL}))
        vectors = json.loads(out["Body"].read())
    assert min(cosines(vectors, reference)) >= 0.99999
