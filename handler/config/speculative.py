"""Speculative decoding's properties (option.speculative_config, option.speculative_draft_model,
option.speculative_length, option.speculative_disable_by_batch_size) -> SpecConfig. Plain data, no
torch; the engine's proposers are in handler/engine/spec.py, the verification in
handler/model/spec_verify.py."""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
SPEC_JSON_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                  "disable_by_batch_size")
DEFAULT_K = 5                  # LMI's option.speculative_length default
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2            # a 1-gram match proposes noise more often than not
MAX_K = 32


class SpecConfigError(ValueError):
    """A one-line message naming the property key and what it allows."""


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"
    k: int = DEFAULT_K                     # tokens proposed per step
    lookup_min: int = DEFAULT_LOOKUP_MIN   # ngram: shortest suffix matched
    lookup_max: int = DEFAULT_LOOKUP_MAX   # ngram: longest suffix matched
    disable_by_batch_size: int | None = None   # no speculation when this many sequences run
    draft_model: str | None = None


def parse_spec_json(raw: str) -> dict:
    """option.speculative_config's value (vLLM's JSON): a dict of known keys with valid values;
    raises SpecConfigError with what is wrong (the caller adds key and source)."""
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise SpecConfigError(f"is not JSON ({e.msg}); e.g. {{\"method\": \"ngram\", "
                              "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}") from None
    if not isinstance(d, dict):
        raise SpecConfigError("is not a JSON object")
    unknown = sorted(set(d) - set(SPEC_JSON_KEYS))
    if unknown:
        raise SpecConfigError(f"has unknown field(s) {', '.join(unknown)}; allowed: {', '.join(SPEC_JSON_KEYS)}")
    method = d.get("method", "draft_model" if d.get("model") else "ngram")
    if method not in METHODS:
        raise SpecConfigError(f"has method {method!r}; allowed: {', '.join(METHODS)}")
    out = {"method": method}
    for name, lo, hi in (("num_speculative_tokens", 1, MAX_K), ("prompt_lookup_min", 1, 64),
                         ("prompt_lookup_max", 1, 64), ("disable_by_batch_size", 1, None)):
        v = d.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise SpecConfigError(f"has {name}={json.dumps(v)}; allowed: an integer "
                                  + (f"from {lo} to {hi}" if hi is not None else f">= {lo}"))
        out[name] = v
    if d.get("model") is not None:
        if not isinstance(d["model"], str) or not d["model"]:
            raise SpecConfigError("has a model that is not a non-empty string (a model dir, s3:// URL or .gguf)")
        out["model"] = d["model"]
    if method == "draft_model" and not out.get("model"):
        raise SpecConfigError("has method draft_model without a model")
    lo, hi = out.get("prompt_lookup_min", DEFAULT_LOOKUP_MIN), out.get("prompt_lookup_max", DEFAULT_LOOKUP_MAX)
    if "prompt_lookup_min" in out and "prompt_lookup_max" not in out:
        hi = max(hi, lo)
        out["prompt_lookup_max"] = hi
    if "prompt_lookup_max" in out and "prompt_lookup_min" not in out:
        lo = min(lo, hi)
        out["prompt_lookup_min"] = lo
    if lo > hi:
        raise SpecConfigError(f"has prompt_lookup_min={lo} > prompt_lookup_max={hi}")
    return out


def resolve(spec_json: dict | None, draft_model: str | None, length: int | None,
            disable_by_batch_size: int | None) -> SpecConfig | None:
    """The four properties -> a SpecConfig, or None (no speculation). speculative_length is LMI's
    k; the JSON's num_speculative_tokens wins when both are given (they must then agree)."""
    if spec_json is None and draft_model is None:
        return None
    d = dict(spec_json or {})
    if draft_model is not None:
        if d.get("model") not in (None, draft_model):
            raise SpecConfigError("option.speculative_draft_model and option.speculative_config's model differ; "
                                  "give the draft model once")
        d.setdefault("method", "draft_model")
        d["model"] = draft_model
        if d["method"] != "draft_model":
            raise SpecConfigError("option.speculative_draft_model needs option.speculative_config's method to be "
                                  f"draft_model, not {d['method']}")
    k = d.get("num_speculative_tokens")
    if length is not None:
        if k is not None and k != length:
            raise SpecConfigError(f"option.speculative_length={length} and option.speculative_config's "
                                  f"num_speculative_tokens={k} differ; give k once")
        if length > MAX_K:
            raise SpecConfigError(f"option.speculative_length={length} is too large; allowed: 1 to {MAX_K}")
        k = length
    return SpecConfig(method=d.get("method", "ngram"), k=k or DEFAULT_K,
                      lookup_min=d.get("prompt_lookup_min", DEFAULT_LOOKUP_MIN),
                      lookup_max=d.get("prompt_lookup_max", DEFAULT_LOOKUP_MAX),
                      disable_by_batch_size=disable_by_batch_size or d.get("disable_by_batch_size"),
                      draft_model=d.get("model"))


