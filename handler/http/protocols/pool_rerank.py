"""Cohere's and Jina's POST /v1/rerank (also /rerank with `documents`; vLLM serves the same shape).

Body: `query`, `documents` (strings, or objects with `text`), `top_n`, `return_documents` (default
true, as Jina and vLLM), `truncate` / vLLM's `truncate_prompt_tokens`. Answer: {id, model, results:
[{index, relevance_score[, document: {text}]}] highest first, at most top_n, usage: {total_tokens}}.
"""
from __future__ import annotations

import uuid

from handler.engine.request import RequestError, show
from handler.http.protocols.pooling import CLASSIFY, Pooling, check_body, flag, positive_int, text


def parse(body) -> tuple[str, list[str], dict, Pooling]:
    body = check_body(body)
    query = text(body.get("query"), "query")
    docs = body.get("documents")
    if not isinstance(docs, list):
        raise RequestError("documents", f"must be a list of strings or of {{\"text\": ...}} objects, got {show(docs)}")
    if not docs:
        raise RequestError("documents", "is an empty list; send at least one document")
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, dict):
            d = d.get("text")
        out.append(text(d, f"documents[{i}]"))
    top_n = positive_int(body, "top_n")
    req = Pooling(CLASSIFY, fields=[f"documents[{i}]" for i in range(len(out))], truncate_field="truncate")
    if body.get("truncate") in ("END", "START") or flag(body, "truncation", False) \
            or body.get("truncate_prompt_tokens") is not None:
        req.truncate = "left" if body.get("truncate") == "START" else "right"
    elif body.get("truncate") not in (None, "NONE"):
        raise RequestError("truncate", f"must be NONE, START or END, got {show(body.get('truncate'))}")
    return query, out, {"top_n": top_n, "return_documents": flag(body, "return_documents", True),
                        "model": body.get("model")}, req


def encode(scores: list[float], docs: list[str], opts: dict, model: str, prompt_tokens: int) -> dict:
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: opts["top_n"] or len(scores)]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if opts["return_documents"] else {})} for i in ranked]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
            "usage": {"total_tokens": prompt_tokens}, "meta": {"billed_units": {"search_units": 1}}}
