"""OpenAI's POST /v1/embeddings (and vLLM's extensions) and vLLM's POST /score: body -> Pooling ->
body.

/v1/embeddings: `input` a string, a list of strings, a list of token ids or a list of such lists;
`encoding_format` float | base64 (little-endian float32, what the openai SDK asks for by default);
`dimensions` (first N components, renormalised); vLLM's `truncate_prompt_tokens` (keep the last N
tokens; -1: the model's maximum). Answer: {object: list, data: [{object: embedding, index,
embedding}], model, usage: {prompt_tokens, total_tokens}}.
/score: `text_1` and `text_2` (each a string or a list: one against many, or pairwise) -> {data:
[{index, object: score, score}]}: a cross-encoder's relevance, else the cosine of the embeddings.
"""
from __future__ import annotations

import time
import uuid

from handler.engine.request import RequestError, show
from handler.http.protocols.pooling import EMBED, Pooling, b64, check_body, matryoshka, positive_int, texts


def parse_embeddings(body, hidden: int) -> tuple[Pooling, dict]:
    body = check_body(body)
    if "input" not in body:
        raise RequestError("input", "is required (a string, a list of strings, or token ids)")
    items, _, fields = texts(body["input"], "input", allow_ids=True)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise RequestError("encoding_format", f"must be float or base64, got {show(fmt)}")
    dims = positive_int(body, "dimensions", hidden)
    req = Pooling(EMBED, fields=fields, truncate_field="truncate_prompt_tokens")
    if items and isinstance(items[0], list):
        req.token_ids = items
    else:
        req.texts = items
    cut = body.get("truncate_prompt_tokens")
    if cut is not None:
        if not isinstance(cut, int) or isinstance(cut, bool) or (cut < 1 and cut != -1):
            raise RequestError("truncate_prompt_tokens", f"must be a positive integer or -1, got {show(cut)}")
        req.truncate, req.truncate_to = "left", None if cut == -1 else cut
    return req, {"format": fmt, "dimensions": dims, "model": body.get("model")}


def encode_embeddings(vectors: list[list[float]], opts: dict, model: str, prompt_tokens: int) -> dict:
    data = []
    for i, v in enumerate(vectors):
        v = matryoshka(v, opts["dimensions"])
        data.append({"object": "embedding", "index": i, "embedding": b64(v) if opts["format"] == "base64" else v})
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def parse_score(body) -> tuple[list[str], list[str]]:
    """(queries, documents) of equal length: text_1 one string against many, or pairwise lists."""
    body = check_body(body)
    for name in ("text_1", "text_2"):
        if name not in body:
            raise RequestError(name, "is required (a string or a list of strings)")
    a, _, _ = texts(body["text_1"], "text_1")
    b, _, _ = texts(body["text_2"], "text_2")
    if len(a) == 1:
        a = a * len(b)
    elif len(a) != len(b):
        raise RequestError("text_2", f"has {len(b)} items; text_1 has {len(a)}: send one text_1, or as many as "
                                     "text_2")
    return a, b


def encode_score(scores: list[float], model: str, prompt_tokens: int) -> dict:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

