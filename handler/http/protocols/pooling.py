"""What the pooling protocols share (OpenAI embeddings and vLLM's /score in pool_openai.py, TEI's routes in
pool_tei.py, Cohere / Jina rerank in pool_rerank.py, LMI's /invocations in pool_lmi.py): the internal
request every body becomes (`Pooling`), its checks, tokenizing with or without truncation, and the
arithmetic on results (normalising, Matryoshka truncation, base64, sigmoid / softmax, cosine).

Plain Python on lists (no torch, no numpy): a vector is at most a few thousand floats.
"""
from __future__ import annotations

import base64
import math
import struct
from dataclasses import dataclass, field

from handler.engine.pooling import PoolInput
from handler.engine.request import RequestError, show

EMBED, CLASSIFY = "embed", "classify"


@dataclass
class Pooling:
    """One request for the pooling engine: texts (or pairs, or token ids) and what to compute."""
    kind: str                                   # EMBED | CLASSIFY
    texts: list = field(default_factory=list)   # str, or (str, str) for a pair
    fields: list[str] = field(default_factory=list)     # per input: where the body had it (errors)
    token_ids: list[list[int]] | None = None    # inputs sent as token ids (texts then unused)
    truncate: str | None = None                 # None: refuse long inputs; "right" / "left": cut them
    truncate_to: int | None = None              # cut to this many tokens (None: the model's maximum)
    truncate_field: str = "truncate"            # the body's field that asks for truncation (errors)


def texts(value, name: str, allow_str: bool = True, allow_ids: bool = False):
    """A body's input(s) -> (list of str | list of token-id lists, is_list, per-item field names). A
    string, a list of strings, and with allow_ids a list of ints or a list of int lists."""
    if isinstance(value, str) and allow_str:
        _nonempty(value, name)
        return [value], False, [name]
    if not isinstance(value, list):
        raise RequestError(name, f"must be a string or a list of strings, got {show(value)}")
    if not value:
        raise RequestError(name, "is an empty list; send at least one input")
    if allow_ids and all(_is_int(x) for x in value):
        return [list(value)], False, [name]
    if allow_ids and all(isinstance(x, list) for x in value):
        for i, ids in enumerate(value):
            if not ids or not all(_is_int(t) for t in ids):
                raise RequestError(f"{name}[{i}]", f"must be a non-empty list of token ids, got {show(ids)}")
        return [list(x) for x in value], True, [f"{name}[{i}]" for i in range(len(value))]
    out = []
    for i, x in enumerate(value):
        if not isinstance(x, str):
            raise RequestError(f"{name}[{i}]", f"must be a string, got {show(x)}")
        _nonempty(x, f"{name}[{i}]")
        out.append(x)
    return out, True, [f"{name}[{i}]" for i in range(len(value))]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nonempty(s: str, name: str) -> None:
    if not s:
        raise RequestError(name, "is an empty string")


def text(value, name: str) -> str:
    if not isinstance(value, str):
        raise RequestError(name, f"must be a string, got {show(value)}")
    _nonempty(value, name)
    return value


def flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(name, f"must be true or false, got {show(v)}")
    return v


def positive_int(body: dict, name: str, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or v < 1 or (hi is not None and v > hi):
        raise RequestError(name, f"must be an integer in 1..{hi}" if hi else "must be a positive integer"
                           + f", got {show(v)}")
    return v


def check_body(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body", f"must be a JSON object, got {show(body)}")
    return body


# ---- tokenizing
def _cut(ids: list[int], n: int, side: str) -> list[int]:
    return ids[:n] if side == "right" else ids[len(ids) - n:]


def _encode(tokenizer, item, limit: int | None, side: str | None) -> tuple[list[int], list[int] | None]:
    """One text or pair -> (ids, segment ids or None); cut to `limit` tokens (special tokens kept) when
    side is given."""
    pair = isinstance(item, tuple)
    enc = tokenizer(*item) if pair else tokenizer(item)
    ids = enc["input_ids"]
    types = enc.get("token_type_ids") if pair else None
    if side is None or limit is None or len(ids) <= limit:
        return ids, types
    kw = dict(truncation="only_second" if pair else True, max_length=limit)
    if side == "right" or pair:     # a pair: the text's end goes (the query stays whole)
        enc = tokenizer(*item, **kw) if pair else tokenizer(item, **kw)
        return enc["input_ids"], enc.get("token_type_ids") if pair else None
    # left: the content's last tokens between the special tokens the tokenizer puts around it
    content = tokenizer(item, add_special_tokens=False)["input_ids"]
    extra = len(ids) - len(content)
    start = next((i for i in range(extra + 1) if ids[i:i + len(content)] == content), 0)
    keep = max(0, limit - extra)
    return ids[:start] + content[len(content) - keep:] + ids[start + len(content):], None


def tokenize(tokenizer, req: Pooling, max_len: int) -> list[PoolInput]:
    """req's inputs as token sequences; one longer than max_len (after any truncation asked for) is a 400
    naming its field and the limit."""
    limit = min(req.truncate_to or max_len, max_len)
    out = []
    if req.token_ids is not None:
        vocab = len(tokenizer)
        for i, ids in enumerate(req.token_ids):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(req.fields[i], f"holds the token id {bad}, outside the vocabulary (0..{vocab - 1})")
            if req.truncate is not None and len(ids) > limit:
                ids = _cut(ids, limit, req.truncate)
            out.append(PoolInput(list(ids)))
    else:
        for item in req.texts:
            ids, types = _encode(tokenizer, item, limit, req.truncate)
            out.append(PoolInput(ids, types))
    for i, x in enumerate(out):
        if len(x.ids) > max_len:
            where = req.fields[i] if i < len(req.fields) else "input"
            raise RequestError(where, f"is {len(x.ids)} tokens; this model takes at most {max_len} "
                                      f"(set {req.truncate_field} to cut longer inputs)")
    return out


# ---- results
def normalized(v: list[float]) -> list[float]:
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v] if n > 0 else list(v)


def matryoshka(v: list[float], dims: int | None) -> list[float]:
    """The first `dims` components, renormalised (a Matryoshka model's shorter embedding)."""
    return v if dims is None or dims >= len(v) else normalized(v[:dims])


def b64(v: list[float]) -> str:
    """OpenAI's encoding_format=base64: little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0


def relevance(logits: list[float], raw: bool = False) -> float:
    """A cross-encoder's score for one pair: its one logit through a sigmoid (sentence-transformers'
    CrossEncoder default), or the logit itself when raw; a two-label head's positive class."""
    if len(logits) == 1:
        return logits[0] if raw else sigmoid(logits[0])
    return logits[-1] if raw else softmax(logits)[-1]


def labels(logits: list[float], id2label: dict, raw: bool = False) -> list[dict]:
    """A classifier's answer as TEI's /predict: every label with its score, highest first."""
    scores = logits if raw else ([sigmoid(logits[0])] if len(logits) == 1 else softmax(logits))
    out = [{"label": id2label.get(i, f"LABEL_{i}"), "score": s} for i, s in enumerate(scores)]
    return sorted(out, key=lambda d: -d["score"])
