"""The internal request model's parameters: `SamplingParams` and the parameter table every protocol
(handler/http/protocols/) parses through. No torch.

Parameters follow LMI: unknown names are dropped with a warning (logged once per name), `null` means
absent, LMI's/vLLM's/TGI's aliases are accepted, and a known name with a bad value is a 400 naming it.
Every numeric value is bounded so that nothing unbounded reaches the engine.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

from handler.config.switches import switch
from handler.engine import guide
# RequestError and show live in errors.py (guide.py uses them too); imported from here by most.
from handler.engine.errors import MAX_SHOWN, RequestError, show

log = logging.getLogger("lmi.request")


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
    # Benchmarks only: finish as if EOS were sampled after this many tokens (unknown to the
    # scheduler). Parsed from a request only when the server runs with LMI_BENCH_EOS_AFTER=1.
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
    # A LoRA adapter (handler.model.lora.Adapter: .name, .uid, weights) chosen by the protocol layer;
    # None = the base model. Opaque here: the scheduler reads only `.uid`.
    adapter: object = None
    # Guided decoding: the output is constrained to this (handler.engine.guide.GuideSpec).
    guide: guide.GuideSpec | None = None
    # Added to the logits before sampling: ((token id, bias), ...) (OpenAI logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A stop sequence that ends the text is part of it (LMI, TGI); OpenAI's routes cut it off
    # (vLLM's include_stop_str_in_output, default false there).
    include_stop_str_in_output: bool = True

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates for one prompt."""
        return max(self.n, self.best_of or 1)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


# Bounds (also the 400 messages): a request can ask for at most this much work.
MAX_NEW_TOKENS = 1 << 20            # the model's length bounds it further (scheduler.check_fits)
MAX_SAMPLES = 16                    # n / best_of
MAX_TOP_N_TOKENS = 20               # as OpenAI's top_logprobs
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 512               # characters per stop sequence
MAX_SEED = 2**63 - 1


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Log `message` the first time `key` is seen in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("%s (logged once)", message)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_int(field: str, v, lo: int, hi: int) -> int:
    if not _is_int(v):
        raise RequestError(field, f"must be an integer, got {show(v)}")
    if not lo <= v <= hi:
        raise RequestError(field, f"must be between {lo} and {hi}, got {show(v)}")
    return v


def check_float(field: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    if not _is_num(v):
        raise RequestError(field, f"must be a number, got {show(v)}")
    if v < lo or (lo_open and v == lo) or v > hi:
        raise RequestError(field, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {show(v)}")
    return float(v)


def check_bool(field: str, v) -> bool:
    if not isinstance(v, bool):
        raise RequestError(field, f"must be true or false, got {show(v)}")
    return v


def check_stops(field: str, v) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise RequestError(field, f"must be a string or a list of non-empty strings, got {show(v)}")
    if len(v) > MAX_STOP_SEQUENCES:
        raise RequestError(field, f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(v)}")
    long = [s for s in v if len(s) > MAX_STOP_LENGTH]
    if long:
        raise RequestError(field, f"a stop sequence has at most {MAX_STOP_LENGTH} characters, "
                                  f"got {len(long[0])}: {show(long[0])}")
    return tuple(v)


def check_top_k(field, v):
    # -1 is vLLM's "off"; a k beyond any vocabulary keeps every token, i.e. is off too (and must
    # never reach the sampler as an int64-overflowing tensor).
    if _is_int(v) and v >= 1 << 31:
        return 0
    v = check_int(field, v, -1, (1 << 31) - 1)
    return 0 if v == -1 else v


# name -> check(field, value) -> value for SamplingParams.
_CHECKS = {
    "max_new_tokens": lambda f, v: check_int(f, v, 1, MAX_NEW_TOKENS),
    "do_sample": check_bool,
    "temperature": lambda f, v: check_float(f, v, 0.0, 100.0),
    "top_k": check_top_k,
    "top_p": lambda f, v: check_float(f, v, 0.0, 1.0, lo_open=True),
    "min_p": lambda f, v: check_float(f, v, 0.0, 1.0),
    "typical_p": lambda f, v: check_float(f, v, 0.0, 1.0, lo_open=True),
    "repetition_penalty": lambda f, v: check_float(f, v, 0.0, 100.0, lo_open=True),
    "presence_penalty": lambda f, v: check_float(f, v, -2.0, 2.0),
    "frequency_penalty": lambda f, v: check_float(f, v, -2.0, 2.0),
    "seed": lambda f, v: check_int(f, v, 0, MAX_SEED),
    "stop_sequences": check_stops,
    "return_full_text": check_bool,
    "details": check_bool,
    "decoder_input_details": check_bool,
    "top_n_tokens": lambda f, v: check_int(f, v, 0, MAX_TOP_N_TOKENS),
    "n": lambda f, v: check_int(f, v, 1, MAX_SAMPLES),
    "best_of": lambda f, v: check_int(f, v, 1, MAX_SAMPLES),
    "ignore_eos": check_bool,
    "include_stop_str_in_output": check_bool,
    "logit_bias": lambda f, v: check_logit_bias(f, v),
}
# Benchmark knobs: parsed like the rest when LMI_BENCH_EOS_AFTER is on (the `bench` and `tune`
# tools start our servers with it), otherwise unknown parameters like any other.
BENCH_CHECKS = {
    "eos_after": lambda f, v: check_int(f, v, 1, MAX_NEW_TOKENS),
}
# Other names for the same parameter (LMI, vLLM, TGI, OpenAI).
ALIASES = {
    "stop": "stop_sequences",              # vLLM / TGI
    "ignore_eos_token": "ignore_eos",      # LMI's name for vLLM's ignore_eos
    "max_tokens": "max_new_tokens",        # vLLM / OpenAI
}


def _adapter_id(field: str, v) -> str:
    if not isinstance(v, str) or not v:
        raise RequestError(field, f"must be an adapter name, got {show(v)}")
    return v


# Parsed here but applied by the protocol layer, not the engine.
REQUEST_OPTIONS = {
    "truncate": lambda f, v: check_int(f, v, 1, MAX_NEW_TOKENS),   # keep the last N prompt tokens
    "stream": check_bool,                  # LMI copies `stream` into the parameters
    "adapter_id": _adapter_id,             # TGI's LoRA adapter (LMI: top-level `adapters`)
}

# Accepted for compatibility; they change nothing here (TGI clients always send some of them).
NO_EFFECT = {
    "watermark": "watermarking is not implemented",
    **{k: "there is one guided-decoding backend (xgrammar)" for k in guide.QUIET_PARAMETERS},
}
ALLOWED_PARAMETERS = tuple(_CHECKS) + tuple(ALIASES) + tuple(REQUEST_OPTIONS) + tuple(guide.PARAMETERS)
MAX_LOGIT_BIAS = 300                # entries (OpenAI's limit)


def check_logit_bias(field: str, v) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...) sorted by id."""
    if not isinstance(v, dict):
        raise RequestError(field, f'must be an object {{"token id": bias}}, got {show(v)}')
    if len(v) > MAX_LOGIT_BIAS:
        raise RequestError(field, f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            tid = -1
        if tid < 0 or str(k).strip() != str(tid):
            raise RequestError(field, f"keys must be token ids (non-negative integers), got {show(k)}")
        out[tid] = check_float(f"{field}.{k}", b, -100.0, 100.0)
    return tuple(sorted(out.items()))


def parse_params(raw, defaults: SamplingParams = SamplingParams(), where: str = "parameters",
                 options: dict | None = None) -> SamplingParams:
    """A `parameters` object -> SamplingParams. Request options (`truncate`) go into `options`."""
    if raw is None:
        return defaults
    if not isinstance(raw, dict):
        raise RequestError(where, f"must be a JSON object, got {show(raw)}")
    values: dict = {}
    given: dict = {}
    for name, v in raw.items():
        if v is None:                       # null = absent (TGI clients send every name)
            continue
        canon = ALIASES.get(name, name)
        field = f"{where}.{name}"
        check = _CHECKS.get(canon) or (BENCH_CHECKS.get(canon) if canon in BENCH_CHECKS
                                        and switch("LMI_BENCH_EOS_AFTER") else None)
        if check is not None:
            value = check(field, v)
            if canon in values and values[canon] != value:
                raise RequestError(field, f"conflicts with {where}.{given[canon]} (the same parameter)")
            values[canon], given[canon] = value, name
        elif name in guide.PARAMETERS:       # guided decoding: one constraint per request
            value = guide.PARAMETERS[name](field, v)
            if "guide" in values:
                raise RequestError(field, f"conflicts with {where}.{given['guide']} (one output constraint "
                                          f"per request)")
            values["guide"], given["guide"] = value, name
        elif canon in REQUEST_OPTIONS:
            value = REQUEST_OPTIONS[canon](field, v)
            if options is not None:
                options[canon] = value
        elif canon in NO_EFFECT:
            if v not in (False, "", [], {}):
                warn_once(f"param:{canon}", f"request parameter {canon!r} is ignored: {NO_EFFECT[canon]}")
        else:
            warn_once(f"param:{name[:MAX_SHOWN]}",
                      f"unknown request parameter {show(name)} dropped (as LMI does); known: "
                      + ", ".join(ALLOWED_PARAMETERS))
    p = SamplingParams(**{**defaults.__dict__, **values})
    if p.best_of is not None and p.best_of < p.n:
        raise RequestError(f"{where}.best_of", f"must be >= n ({p.n}), got {p.best_of}")
    return p
