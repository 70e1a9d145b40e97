"""Text Embeddings Inference's routes: POST /embed, /rerank ({query, texts}) and /predict.

/embed: `inputs` a string or a list; `normalize` (default true: unit length whatever the model's
pooling), `truncate` (default false: a long input is a 400), `truncation_direction` Right | Left,
`dimensions` -> a list of vectors.
/rerank: `query`, `texts`, `truncate`, `raw_scores` (a cross-encoder's logit instead of its sigmoid),
`return_text` -> [{index, score[, text]}], highest score first.
/predict: `inputs` a string, a pair [a, b], or a list of those; `raw_scores`, `truncate` -> per input
[{label, score}], highest first (a list of them for a list input).
"""
from __future__ import annotations

from handler.engine.request import RequestError, show
from handler.http.protocols.pooling import (CLASSIFY, EMBED, Pooling, check_body, flag, matryoshka, normalized,
                                            positive_int, text, texts)


def _truncation(body: dict, req: Pooling) -> None:
    if flag(body, "truncate", False):
        d = body.get("truncation_direction") or "Right"
        if d not in ("Right", "Left", "right", "left"):
            raise RequestError("truncation_direction", f"must be Right or Left, got {show(d)}")
        req.truncate = d.lower()


def parse_embed(body, hidden: int) -> tuple[Pooling, dict]:
    body = check_body(body)
    if "inputs" not in body:
        raise RequestError("inputs", "is required (a string or a list of strings)")
    items, is_list, fields = texts(body["inputs"], "inputs")
    req = Pooling(EMBED, texts=items, fields=fields)
    _truncation(body, req)
    return req, {"normalize": flag(body, "normalize", True), "dimensions": positive_int(body, "dimensions", hidden)}


def encode_embed(vectors: list[list[float]], opts: dict) -> list:
    out = []
    for v in vectors:
        v = matryoshka(v, opts["dimensions"])
        out.append(normalized(v) if opts["normalize"] else v)
    return out


def parse_rerank(body) -> tuple[str, list[str], dict, Pooling]:
    body = check_body(body)
    query = text(body.get("query"), "query")
    if "texts" not in body:
        raise RequestError("texts", "is required (a list of strings)")
    docs, _, fields = texts(body["texts"], "texts", allow_str=False)
    req = Pooling(CLASSIFY, fields=fields)
    _truncation(body, req)
    return query, docs, {"raw_scores": flag(body, "raw_scores", False),
                         "return_text": flag(body, "return_text", False)}, req


def encode_rerank(scores: list[float], docs: list[str], opts: dict) -> list[dict]:
    out = [{"index": i, "score": s, **({"text": docs[i]} if opts["return_text"] else {})}
           for i, s in enumerate(scores)]
    return sorted(out, key=lambda d: -d["score"])


def parse_predict(body) -> tuple[Pooling, bool, dict]:
    """(request, is_list, options): a string, a pair [a, b], or a list of strings / pairs."""
    body = check_body(body)
    if "inputs" not in body:
        raise RequestError("inputs", "is required (a string, a pair [text, text_pair], or a list of them)")
    v = body["inputs"]

    def one(x, name):
        if isinstance(x, str):
            return text(x, name)
        if isinstance(x, list) and len(x) == 2 and all(isinstance(s, str) for s in x):
            return (text(x[0], f"{name}[0]"), text(x[1], f"{name}[1]"))
        raise RequestError(name, f"must be a string or a pair of strings, got {show(x)}")

    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        items, is_list = [one(x, f"inputs[{i}]") for i, x in enumerate(v)], True
    elif isinstance(v, list) and len(v) == 2 and all(isinstance(s, str) for s in v):
        items, is_list = [one(v, "inputs")], False       # TEI: a two-string list is one pair
    elif isinstance(v, list):
        if not v:
            raise RequestError("inputs", "is an empty list; send at least one input")
        items, is_list = [one(x, f"inputs[{i}]") for i, x in enumerate(v)], True
    else:
        items, is_list = [one(v, "inputs")], False
    fields = [f"inputs[{i}]" for i in range(len(items))] if is_list else ["inputs"]
    req = Pooling(CLASSIFY, texts=items, fields=fields)
    _truncation(body, req)
    return req, is_list, {"raw_scores": flag(body, "raw_scores", False)}
