"""Request schema (LMI/TGI style): HTTP body -> validated, plain-Python generation requests. No torch."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass


class RequestError(ValueError):
    """A bad request: `field` names the offending part of the body (HTTP 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 30
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0              # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_sequences: tuple[str, ...] = ()
    return_full_text: bool = False
    details: bool = False
    ignore_eos: bool = False
    # Benchmark knob: finish as if EOS were sampled after this many tokens (unknown to the scheduler).
    eos_after: int | None = None
    # Several samples per prompt: `best_of` sequences are generated (default n) and the API layer
    # returns the `n` best by cumulative log-prob (LMI/TGI best_of, OpenAI n).
    n: int = 1
    best_of: int | None = None
    top_n_tokens: int = 0               # alternatives per generated token (TGI/LMI top_tokens)
    decoder_input_details: bool = False  # log-probs of every prompt token (details.prefill)
    presence_penalty: float = 0.0        # OpenAI/vLLM semantics
    frequency_penalty: float = 0.0
    typical_p: float = 1.0               # TGI typical decoding; 1.0 = off
    min_p: float = 0.0                   # vLLM min_p; 0.0 = off

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates for one prompt."""
        return max(self.n, self.best_of or 1)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


@dataclass(frozen=True)
class Invocation:
    inputs: list[str]
    is_list: bool
    params: SamplingParams
    stream: bool


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(name, lo=None, hi=None):
    def check(v):
        if not _is_int(v):
            raise RequestError(f"parameters.{name}", f"must be an integer, got {json.dumps(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise RequestError(f"parameters.{name}", f"must be {rng}, got {v}")
        return v
    return check


def _float(name, lo, hi, lo_open=False, hi_open=False):
    def check(v):
        if not _is_num(v):
            raise RequestError(f"parameters.{name}", f"must be a number, got {json.dumps(v)}")
        if (v < lo or (lo_open and v == lo)) or (hi is not None and (v > hi or (hi_open and v == hi))):
            left = "(" if lo_open else "["
            right = ")" if hi_open or hi is None else "]"
            raise RequestError(f"parameters.{name}",
                               f"must be in {left}{lo}, {'inf' if hi is None else hi}{right}, got {v}")
        return float(v)
    return check


def _bool(name):
    def check(v):
        if not isinstance(v, bool):
            raise RequestError(f"parameters.{name}", f"must be true or false, got {json.dumps(v)}")
        return v
    return check


def _stops(v):
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise RequestError("parameters.stop_sequences", "must be a list of non-empty strings")
    if len(v) > 16:
        raise RequestError("parameters.stop_sequences", f"at most 16 stop sequences, got {len(v)}")
    return tuple(v)


_CHECKS = {
    "max_new_tokens": _int("max_new_tokens", 1),
    "do_sample": _bool("do_sample"),
    "temperature": _float("temperature", 0.0, None),
    "top_k": _int("top_k", 0),
    "top_p": _float("top_p", 0.0, 1.0, lo_open=True),
    "repetition_penalty": _float("repetition_penalty", 0.0, None, lo_open=True),
    "seed": _int("seed", 0, 2**63 - 1),
    "stop_sequences": _stops,
    "return_full_text": _bool("return_full_text"),
    "details": _bool("details"),
    "ignore_eos": _bool("ignore_eos"),
    "eos_after": _int("eos_after", 1),
}
ALLOWED_PARAMETERS = tuple(_CHECKS)
ALLOWED_TOP_LEVEL = ("inputs", "parameters", "stream")


def parse_params(raw, defaults: SamplingParams = SamplingParams()) -> SamplingParams:
    if raw is None:
        return defaults
    if not isinstance(raw, dict):
        raise RequestError("parameters", "must be a JSON object")
    unknown = sorted(set(raw) - set(_CHECKS))
    if unknown:
        raise RequestError(f"parameters.{unknown[0]}",
                           f"unknown parameter; allowed: {', '.join(ALLOWED_PARAMETERS)}")
    values = {k: _CHECKS[k](v) for k, v in raw.items() if v is not None}
    p = SamplingParams(**{**defaults.__dict__, **values})
    return p


def parse_invocation(body: bytes, content_type: str | None = None, default_stream: bool = False,
                     max_batch_inputs: int = 1000) -> Invocation:
    """Decode an /invocations body. `text/plain` bodies are a single prompt."""
    ctype = (content_type or "application/json").split(";")[0].strip().lower()
    if ctype == "text/plain":
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("body", "text/plain body is not valid UTF-8") from None
        payload = {"inputs": text}
    else:
        try:
            payload = json.loads(body or b"")
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError("body", f"invalid JSON ({e})") from None
    if not isinstance(payload, dict):
        raise RequestError("body", 'must be a JSON object like {"inputs": "...", "parameters": {...}}')
    unknown = sorted(set(payload) - set(ALLOWED_TOP_LEVEL))
    if unknown:
        raise RequestError(unknown[0], f"unknown field; allowed: {', '.join(ALLOWED_TOP_LEVEL)}")
    if "inputs" not in payload:
        raise RequestError("inputs", "is required")
    inputs = payload["inputs"]
    is_list = isinstance(inputs, list)
    items = inputs if is_list else [inputs]
    if is_list and not items:
        raise RequestError("inputs", "must not be an empty list")
    if len(items) > max_batch_inputs:
        raise RequestError("inputs", f"at most {max_batch_inputs} prompts per request, got {len(items)}")
    for i, s in enumerate(items):
        where = f"inputs[{i}]" if is_list else "inputs"
        if not isinstance(s, str):
            raise RequestError(where, "must be a string or a list of strings")
        if not s:
            raise RequestError(where, "must not be empty")
    stream = payload.get("stream", default_stream)
    if not isinstance(stream, bool):
        raise RequestError("stream", f"must be true or false, got {json.dumps(stream)}")
    if stream and is_list:
        raise RequestError("stream", "streaming needs a single string in inputs, not a list")
    return Invocation(list(items), is_list, parse_params(payload.get("parameters")), stream)
