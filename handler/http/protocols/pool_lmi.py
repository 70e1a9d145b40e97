"""LMI's /invocations for a pooling model (djl-serving's embedding guide): `{"inputs": "text"}` -> one
vector, `{"inputs": [...]}` -> a list of vectors; a classifier or cross-encoder answers TEI's /predict
shape ([{label, score}] per input; `inputs` may hold [text, text_pair] pairs). An OpenAI embeddings body
(`input`) gets OpenAI's answer (handler/http/protocols/pool_openai.py)."""
from __future__ import annotations

from handler.engine.request import RequestError
from handler.http.protocols.pooling import EMBED, Pooling, check_body, flag, texts


def parse(body) -> tuple[Pooling, bool]:
    body = check_body(body)
    if "inputs" not in body:
        raise RequestError("inputs", "is required (a string or a list of strings)")
    items, is_list, fields = texts(body["inputs"], "inputs")
    req = Pooling(EMBED, texts=items, fields=fields, truncate_field="parameters.truncate")
    params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
    if flag(params, "truncate", False) or flag(body, "truncate", False):
        req.truncate = "right"
    return req, is_list
