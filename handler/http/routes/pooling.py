"""Pooling models' routes (option.task = text_embedding | classify | rerank; handler/engine/pooling.py):

  OpenAI   POST /v1/embeddings                       protocols/pool_openai.py
  vLLM     POST /score, /v1/score                    protocols/pool_openai.py
  TEI      POST /embed, /predict, /rerank {texts}    protocols/pool_tei.py
  Cohere   POST /v1/rerank, /rerank {documents}      protocols/pool_rerank.py (Jina's and vLLM's shape)
  LMI      POST /invocations (from routes/sagemaker.py: `invocations` below)

Each route parses its body into one `Pooling` request, `pooled` tokenizes and runs it, and the protocol
module writes the answer. Rerank and score use the cross-encoder where the model is one, else the cosine
of the embeddings. On a text generator these routes are a 400 naming option.task.
"""
from __future__ import annotations

from flask import Blueprint, g

from handler.engine.client import CapacityError, QueueFull
from handler.engine.request import RequestError
from handler.http.protocols import pool_lmi, pool_openai, pool_rerank, pool_tei
from handler.http.protocols.pooling import CLASSIFY, EMBED, Pooling, cosine, labels, relevance, tokenize
from handler.http.routes.common import (TIMEOUT_HINT, _loading, body_json, current_state, error_response,
                                        json_response, model_name, openai_error, vectors_response)

bp = Blueprint("pooling", __name__)


class Refused(Exception):
    """An answer other than 200: (status, message, field)."""

    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def tei_error(status, message, field=None):
    kind = {400: "validation", 413: "validation", 503: "overloaded", 504: "timeout"}.get(status, "backend")
    return json_response({"error": f"{field}: {message}" if field else message, "error_type": kind}, status)


def _client():
    state = current_state()
    client = state.client
    if client is None:
        g.trace.reason = "loading"
        raise Refused(503, _loading(state))
    if not client.pooling:
        raise Refused(400, "this server serves a text generator, not an embedding or rerank model; start it "
                           "with option.task=text_embedding (or classify / rerank) and such a model",
                      "option.task")
    return state, client


def pooled(req: Pooling) -> tuple[list, int]:
    """Tokenize, submit, wait: (one result per input, prompt tokens)."""
    state, client = _client()
    if req.kind == CLASSIFY and client.task == "text_embedding":
        raise Refused(400, "this model is an embedding model (option.task=text_embedding), not a classifier",
                      "option.task")
    try:
        inputs = tokenize(client.tokenizer, req, client.max_model_len)
        job = client.pool(inputs, req.kind)
    except RequestError as e:
        raise Refused(e.status, e.message, e.field) from None
    except CapacityError as e:
        raise Refused(400, e.message if hasattr(e, "message") else str(e), e.field) from None
    except QueueFull as e:
        g.trace.reason = "queue_full"
        raise Refused(503, str(e)) from None
    if not job.wait(state.cfg.request_timeout_s):
        raise Refused(504, f"request timed out after {state.cfg.request_timeout_s:g} s ({TIMEOUT_HINT})")
    if job.error is not None:
        raise Refused(424, job.error)
    return job.results, job.prompt_tokens


def scores(query: str, docs: list[str], req: Pooling, raw: bool = False) -> tuple[list[float], int]:
    """Each document's relevance to the query: a cross-encoder's, else the embeddings' cosine."""
    _, client = _client()
    if client.task in ("rerank", "classify"):
        req.kind, req.texts = CLASSIFY, [(query, d) for d in docs]
        out, n = pooled(req)
        return [relevance(x, raw) for x in out], n
    req.kind, req.texts = EMBED, [query, *docs]
    req.fields = ["query", *req.fields]
    vecs, n = pooled(req)
    return [cosine(vecs[0], v) for v in vecs[1:]], n


def _answer(error, work):
    try:
        return vectors_response(work())
    except RequestError as e:
        return error(e.status, e.message, e.field)
    except Refused as e:
        return error(e.status, e.message, e.field)


def _hidden() -> int:
    client = current_state().client
    return getattr(client, "hidden_size", None) or 1 << 20


# ---- OpenAI / vLLM
@bp.post("/v1/embeddings")
@bp.post("/embeddings")
def embeddings():
    def work():
        req, opts = pool_openai.parse_embeddings(body_json(), _hidden())
        _embed_only()
        vecs, n = pooled(req)
        return pool_openai.encode_embeddings(vecs, opts, model_name(current_state().cfg), n)
    return _answer(openai_error, work)


def _embed_only():
    _, client = _client()
    if client.task != "text_embedding":
        raise Refused(400, f"this model is a {client.task} model (option.task={client.task}); embeddings need "
                           "option.task=text_embedding", "option.task")


@bp.post("/score")
@bp.post("/v1/score")
def score():
    def work():
        a, b = pool_openai.parse_score(body_json())
        _, client = _client()
        if client.task in ("rerank", "classify"):
            out, n = pooled(Pooling(CLASSIFY, texts=list(zip(a, b)),
                                    fields=[f"text_2[{i}]" for i in range(len(b))]))
            values = [relevance(x) for x in out]
        else:
            vecs, n = pooled(Pooling(EMBED, texts=[*a, *b],
                                     fields=[f"text_1[{i}]" for i in range(len(a))]
                                     + [f"text_2[{i}]" for i in range(len(b))]))
            values = [cosine(vecs[i], vecs[len(a) + i]) for i in range(len(a))]
        return pool_openai.encode_score(values, model_name(current_state().cfg), n)
    return _answer(openai_error, work)


# ---- TEI
@bp.post("/embed")
def embed():
    def work():
        req, opts = pool_tei.parse_embed(body_json(), _hidden())
        _embed_only()
        vecs, _ = pooled(req)
        return pool_tei.encode_embed(vecs, opts)
    return _answer(tei_error, work)


@bp.post("/predict")
def predict():
    def work():
        req, is_list, opts = pool_tei.parse_predict(body_json())
        out, _ = pooled(req)
        names = current_state().client.id2label
        answers = [labels(x, names, opts["raw_scores"]) for x in out]
        return answers if is_list else answers[0]
    return _answer(tei_error, work)


@bp.post("/rerank")
def rerank_either():
    """TEI's {query, texts} or Cohere's / Jina's {query, documents}: the body says which."""
    body = body_json()
    if isinstance(body, dict) and "texts" in body and "documents" not in body:
        def work():
            query, docs, opts, req = pool_tei.parse_rerank(body)
            values, _ = scores(query, docs, req, opts["raw_scores"])
            return pool_tei.encode_rerank(values, docs, opts)
        return _answer(tei_error, work)
    return _cohere(body)


@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
def rerank():
    return _cohere(body_json())


def _cohere(body):
    def work():
        query, docs, opts, req = pool_rerank.parse(body)
        values, n = scores(query, docs, req)
        return pool_rerank.encode(values, docs, opts, model_name(current_state().cfg), n)
    return _answer(openai_error, work)


# ---- LMI /invocations (routes/sagemaker.py hands a pooling server's requests here)
def invocations():
    def work():
        body = body_json()
        if isinstance(body, dict) and "input" in body and "inputs" not in body:     # an OpenAI body
            req, opts = pool_openai.parse_embeddings(body, _hidden())
            _embed_only()
            vecs, n = pooled(req)
            return pool_openai.encode_embeddings(vecs, opts, model_name(current_state().cfg), n)
        _, client = _client()
        if client.task in ("classify", "rerank"):
            req, is_list, opts = pool_tei.parse_predict(body)
            out, _ = pooled(req)
            answers = [labels(x, client.id2label, opts["raw_scores"]) for x in out]
            return answers if is_list else answers[0]
        req, is_list = pool_lmi.parse(body)
        vecs, _ = pooled(req)
        return vecs if is_list else vecs[0]
    return _answer(error_response, work)
