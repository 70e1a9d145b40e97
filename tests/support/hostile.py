"""Hypothesis strategies for hostile request bodies (the schema's fields, raw JSON, lone surrogates)."""
from __future__ import annotations

from hypothesis import strategies as st

from handler.engine.request import ALLOWED_PARAMETERS


# ---- the fuzz: the request schema and raw bytes ---------------------------------------------
_chars = st.characters(blacklist_categories=())          # lone surrogates included


_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(_chars, max_size=40))


_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)


_params = st.dictionaries(st.sampled_from(ALLOWED_PARAMETERS) | st.text(max_size=12), _json, max_size=6)


_inputs = st.text(_chars, max_size=60) | st.lists(st.text(_chars, max_size=20), max_size=4) | _json


_body = st.fixed_dictionaries({}, optional={"inputs": _inputs, "parameters": _params | _json,
                                            "stream": st.booleans() | _json,
                                            "extra": _json})


def _bounded(body):
    """Generation stays short (max_model_len is 64 anyway); everything else is as drawn."""
    p = body.get("parameters")
    if isinstance(p, dict) and isinstance(p.get("max_new_tokens"), int) and p["max_new_tokens"] > 8:
        p["max_new_tokens"] = 8
    return body
