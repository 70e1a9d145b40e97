"""The internal request model's parameters: `SamplingParams`, and `Parameters`, the declared
(pydantic) model of the `parameters` every protocol (handler/http/protocols/) parses through. No torch.

Parameters follow LMI: unknown names are dropped with a warning (logged once per name), `null` means
absent, LMI's/vLLM's/TGI's aliases are accepted, and a known name with a bad value is a 400 naming it
in one line (`validated` renders pydantic's errors: the field's path, what is allowed, the value).
Every numeric value is bounded so that nothing unbounded reaches the engine.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo

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
    # vLLM's sampling extras. stop_token_ids end the sequence (finish "stop"); before min_tokens
    # generated tokens neither EOS nor a stop token id can be sampled (nor a stop string end it);
    # bad_words are never produced (bad_words_ids: their token sequences, filled in when the
    # request is tokenized, handler/http/protocols/__init__.py); special tokens' text is kept
    # unless skip_special_tokens, spaced from its neighbours when spaces_between_special_tokens.
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Prompt log-probs with this many alternatives per prompt token (vLLM's prompt_logprobs, OpenAI's
    # echo + logprobs); None = no alternatives. Either way decoder_input_details computes the log-probs.
    prompt_top_n: int | None = None
    # Scheduling class under option.scheduling_policy=priority: lower runs first (vLLM's semantics).
    # Not a sampling setting, but every protocol's parameters reach the engine through here.
    priority: int = 0
    # A thinking budget (Anthropic's thinking.budget_tokens under a reasoning parser): (tokens, close,
    # open). Once the thinking holds `tokens` tokens without the close token (`</think>`), the close
    # token is the only one the sampler may pick. open: the token that must begin the output for there
    # to be thinking (qwen3's `<think>`), or None when the thinking starts with the output (deepseek_r1).
    thinking_budget: tuple[int, int, int | None] | None = None

    @property
    def num_samples(self) -> int:
        """Sequences the engine generates for one prompt."""
        return max(self.n, self.best_of or 1)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0


# Bounds (also the 400 messages): a request can ask for at most this much work.
MAX_NEW_TOKENS = 1 << 20            # the model's length bounds it further (Admission.check_fits)
MAX_SAMPLES = 16                    # n / best_of
MAX_TOP_N_TOKENS = 20               # as OpenAI's top_logprobs
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 512               # characters per stop sequence
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = (1 << 31) - 1
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64
MAX_PRIORITY = 2**31 - 1            # |priority|
MAX_LOGIT_BIAS = 300                # entries (OpenAI's limit)


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


def check_token_ids(field: str, v) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v):
        raise RequestError(field, f"must be a list of token ids (non-negative integers), got {show(v)}")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise RequestError(field, f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(v)}")
    return tuple(v)


def check_bad_words(field: str, v) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(w, str) and w.strip() for w in v):
        raise RequestError(field, f"must be a list of non-empty strings, got {show(v)}")
    if len(v) > MAX_BAD_WORDS:
        raise RequestError(field, f"at most {MAX_BAD_WORDS} bad words, got {len(v)}")
    if any(len(w) > MAX_STOP_LENGTH for w in v):
        raise RequestError(field, f"a bad word has at most {MAX_STOP_LENGTH} characters")
    return tuple(v)


def check_top_k(field, v):
    # -1 is vLLM's "off"; a k beyond any vocabulary keeps every token, i.e. is off too (and must
    # never reach the sampler as an int64-overflowing tensor).
    if _is_int(v) and v >= 1 << 31:
        return 0
    v = check_int(field, v, -1, (1 << 31) - 1)
    return 0 if v == -1 else v


# ---- the parameters, declared: types and bounds (pydantic, strict: no coercion of "1" or true)
def bounded_int(lo: int, hi: int):
    return Annotated[int, Field(ge=lo, le=hi)]


def bounded_float(lo: float, hi: float, lo_open: bool = False):
    return Annotated[float, Field(gt=lo, le=hi, allow_inf_nan=False) if lo_open
                     else Field(ge=lo, le=hi, allow_inf_nan=False)]


class Refused(Exception):
    """A field's own check refused its value: `error` (its field relative to the model's root).
    Not a ValueError, so pydantic lets it through as it is (its messages may echo a client's
    value, lone surrogates included, which pydantic's error records cannot carry)."""

    def __init__(self, error: RequestError):
        super().__init__(str(error))
        self.error = error


def lax_int(v):
    """An integer as vLLM's (lax) pydantic models take it: "50" and 50.0 are 50, true is 1 (as for the
    fields pydantic checks itself); anything else as it is."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _checked(check, schema_type=Any):
    """A field checked by `check(field, value)`: its RequestError is the field's error. In a lax
    validation (validated(..., lax=True)) an integer field takes "50" and 50.0 first."""
    integer = schema_type is int or (get_origin(schema_type) is Annotated and get_args(schema_type)[0] is int)

    def validate(v, info: ValidationInfo):
        if integer and (info.context or {}).get("lax"):
            v = lax_int(v)
        try:
            return check(info.field_name, v)
        except RequestError as e:
            raise Refused(e) from None
    return PlainValidator(validate, json_schema_input_type=schema_type)


Flag = bool
# What each checked field takes, as its JSON schema states it (/openapi.json): the checks' bounds
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
_Word = Annotated[str, Field(pattern=r"\S", max_length=MAX_STOP_LENGTH)]
_TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TOKEN_KEY = r"^\s*(0|[1-9][0-9]{0,9})\s*$"     # a logit_bias key (/openapi.json narrows it to the vocabulary)
_TokenKey = Annotated[str, Field(pattern=TOKEN_KEY)]
_Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Stops = Annotated[tuple[str, ...], _checked(lambda f, v: check_stops(f, v),
                                            _Stop | Annotated[list[_Stop], Field(max_length=MAX_STOP_SEQUENCES)])]
TopK = Annotated[int, _checked(lambda f, v: check_top_k(f, v), Annotated[int, Field(ge=-1)])]
LogitBias = Annotated[tuple, _checked(lambda f, v: check_logit_bias(f, v),
                                      Annotated[dict[_TokenKey, _Bias], Field(max_length=MAX_LOGIT_BIAS)])]
TokenIds = Annotated[tuple, _checked(lambda f, v: check_token_ids(f, v),
                                     Annotated[list[_TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)])]
BadWords = Annotated[tuple, _checked(lambda f, v: check_bad_words(f, v),
                                     _Word | Annotated[list[_Word], Field(max_length=MAX_BAD_WORDS)])]


class Parameters(BaseModel):
    """LMI's and TGI's `parameters` (canonical names; aliases in ALIASES): what SamplingParams
    takes from a request. Absent fields (a null is absent) keep the defaults."""
    model_config = ConfigDict(strict=True, extra="forbid")

    max_new_tokens: bounded_int(1, MAX_NEW_TOKENS) = None
    do_sample: Flag = None
    temperature: bounded_float(0.0, 100.0) = None
    top_k: TopK = None
    top_p: bounded_float(0.0, 1.0, lo_open=True) = None
    min_p: bounded_float(0.0, 1.0) = None
    typical_p: bounded_float(0.0, 1.0, lo_open=True) = None
    repetition_penalty: bounded_float(0.0, 100.0, lo_open=True) = None
    presence_penalty: bounded_float(-2.0, 2.0) = None
    frequency_penalty: bounded_float(-2.0, 2.0) = None
    seed: bounded_int(0, MAX_SEED) = None
    stop_sequences: Stops = None
    return_full_text: Flag = None
    details: Flag = None
    decoder_input_details: Flag = None
    top_n_tokens: bounded_int(0, MAX_TOP_N_TOKENS) = None
    n: bounded_int(1, MAX_SAMPLES) = None
    best_of: bounded_int(1, MAX_SAMPLES) = None
    ignore_eos: Flag = None
    include_stop_str_in_output: Flag = None
    logit_bias: LogitBias = None
    stop_token_ids: TokenIds = None
    min_tokens: bounded_int(0, MAX_NEW_TOKENS) = None
    bad_words: BadWords = None
    skip_special_tokens: Flag = None
    spaces_between_special_tokens: Flag = None
    prompt_logprobs: bounded_int(0, MAX_TOP_N_TOKENS) = None
    priority: bounded_int(-MAX_PRIORITY, MAX_PRIORITY) = None


class BenchParameters(Parameters):
    """Parameters plus the benchmark knobs, taken only when LMI_BENCH_EOS_AFTER is on (the
    `bench` and `tune` tools start our servers with it); otherwise they are unknown names."""
    eos_after: bounded_int(1, MAX_NEW_TOKENS) = None


class RequestOptions(BaseModel):
    """Parsed with the parameters but applied by the protocol layer, not the engine."""
    model_config = ConfigDict(strict=True, extra="forbid")

    truncate: bounded_int(1, MAX_NEW_TOKENS) = None     # keep the last N prompt tokens
    stream: Flag = None             # LMI copies `stream` into the parameters
    adapter_id: Annotated[str, Field(min_length=1)] = None   # TGI's LoRA adapter


def _allowed(info) -> str:
    """What a declared field allows, as today's messages say it."""
    lo = next((m.ge for m in info.metadata if hasattr(m, "ge")), None)
    gt = next((m.gt for m in info.metadata if hasattr(m, "gt")), None)
    hi = next((m.le for m in info.metadata if hasattr(m, "le")), None)
    if isinstance(lo, int) and not isinstance(lo, float) and isinstance(hi, int):
        return f"between {lo} and {hi}"
    if gt is not None:
        return f"in ({gt:g}, {hi:g}]"
    if lo is not None and hi is not None:
        return f"in [{lo:g}, {hi:g}]"
    if lo is not None:
        return f">= {lo}"
    return ""


_KIND = {"model_type": "an object", "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
         "float_type": "a number", "float_parsing": "a number", "finite_number": "a number",
         "bool_type": "true or false", "bool_parsing": "true or false",
         "string_type": "a string", "dict_type": "a JSON object", "list_type": "a list",
         "string_too_short": "a non-empty string"}
_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _at(values, loc):
    """The client's value at a pydantic error's location (taken from the body itself)."""
    for key in loc:
        try:
            values = values[key]
        except (KeyError, IndexError, TypeError):
            return None
    return values


def render(model: type[BaseModel], err: dict, where: str, values) -> RequestError:
    """One pydantic error -> today's one-line 400: the field's path, what is allowed, the value."""
    loc = [str(x) if isinstance(x, str) else f"[{x}]" for x in err["loc"]]
    path = where
    for p in loc:
        path = path + p if p.startswith("[") else (f"{path}.{p}" if path else p)
    value = _at(values, err["loc"])
    if err["type"] in _RANGE:
        info = model.model_fields.get(err["loc"][0]) if err["loc"] else None
        allowed = _allowed(info) if info is not None else ""
        return RequestError(path, f"must be {allowed or err['msg']}, got {show(value)}")
    if err["type"] in _KIND:
        return RequestError(path, f"must be {_KIND[err['type']]}, got {show(value)}")
    if err["type"] == "missing":
        return RequestError(path, "is required")
    if err["type"] == "extra_forbidden":
        return RequestError(path, "is not a known field")
    return RequestError(path, f"{err['msg'][:100]}, got {show(value)}")


def validated(model: type[BaseModel], values: dict, where: str, names: dict | None = None,
              context: dict | None = None, lax: bool = False) -> BaseModel:
    """model(**values), or the RequestError of its first bad field. names: field -> the name
    the body used for it (an alias), in the body's order: errors name it, the first one first.
    lax: pydantic's lax mode over the model's strict one ("50" and 50.0 are 50, "0.5" is 0.5,
    "true" is true), as vLLM's request models read LMI's parameters (option.lmi_compat=current)."""
    names = names or {}
    try:
        if lax:
            return model.model_validate(values, context={**(context or {}), "lax": True}, strict=False)
        return model.model_validate(values, context=context)
    except Refused as r:
        err, field = r.error, r.error.field.split(".")[0].split("[")[0]
        err = RequestError(f"{where}.{err.field}" if where else err.field, err.message, err.status)
    except ValidationError as e:
        rank = {k: i for i, k in enumerate(names)}
        errors = e.errors(include_url=False, include_input=False)
        first = min(errors, key=lambda x: rank.get(x["loc"][0], -1) if x["loc"] else -1)
        err = render(model, first, where, values)
        field = first["loc"][0] if first["loc"] else None
    if field in names and names[field] != field:     # the client's own name for it
        prefix = f"{where}.{field}" if where else field
        err = RequestError(err.field.replace(prefix, f"{where}.{names[field]}" if where else names[field], 1),
                           err.message, err.status)
    raise err from None


def _declared(model: type[BaseModel], given: dict[str, list], where: str, lax: bool = False) -> dict:
    """field -> [(name in the body, value), ...] -> {field: checked value}; two names of one
    field (an alias and its canonical name) must agree."""
    names = {k: pairs[0][0] for k, pairs in given.items()}
    checked = validated(model, {k: pairs[0][1] for k, pairs in given.items()}, where, names, lax=lax)
    out = {k: getattr(checked, k) for k in given}
    for k, pairs in given.items():
        for name, v in pairs[1:]:
            if getattr(validated(model, {k: v}, where, {k: name}, lax=lax), k) != out[k]:
                raise RequestError(f"{where}.{name}", f"conflicts with {where}.{pairs[0][0]} (the same parameter)")
    return out


# Other names for the same parameter (LMI, vLLM, TGI, OpenAI).
ALIASES = {
    "stop": "stop_sequences",              # vLLM / TGI
    "ignore_eos_token": "ignore_eos",      # LMI's name for vLLM's ignore_eos
    "max_tokens": "max_new_tokens",        # vLLM / OpenAI
    "truncate_prompt_tokens": "truncate",  # vLLM
}


# Accepted for compatibility; they change nothing here (TGI clients always send some of them).
NO_EFFECT = {
    "watermark": "watermarking is not implemented",
    **{k: "there is one guided-decoding backend (xgrammar)" for k in guide.QUIET_PARAMETERS},
}
ALLOWED_PARAMETERS = (tuple(Parameters.model_fields) + tuple(ALIASES) + tuple(RequestOptions.model_fields)
                      + tuple(guide.PARAMETERS))


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


# Parameters that ask for sampling, and their values that do not (option.lmi_compat=current infers
# do_sample from them, as LMI 0.32+: lmi_input_output_schema.md "GenerationParameters").
SAMPLING_ASKED = {"temperature": lambda v: v > 0.0, "top_p": lambda v: v < 1.0, "top_k": lambda v: v > 1,
                  "min_p": lambda v: v > 0.0, "typical_p": lambda v: v < 1.0}


def parse_params(raw, defaults: SamplingParams = SamplingParams(), where: str = "parameters",
                 options: dict | None = None, lax: bool = False, infer_sampling: bool = False) -> SamplingParams:
    """A `parameters` object -> SamplingParams. Request options (`truncate`) go into `options`.
    lax: numbers and flags as strings coerced (validated()); infer_sampling: without `do_sample`,
    a sampling parameter at a value that samples turns sampling on."""
    if raw is None:
        return defaults
    if not isinstance(raw, dict):
        raise RequestError(where, f"must be a JSON object, got {show(raw)}")
    model = BenchParameters if "eos_after" in raw and switch("LMI_BENCH_EOS_AFTER") else Parameters
    params: dict[str, list] = {}          # canonical name -> [(name in the body, value), ...]
    opts: dict[str, list] = {}
    values: dict = {}
    guide_from = None
    for name, v in raw.items():
        if v is None:                       # null = absent (TGI clients send every name)
            continue
        canon = ALIASES.get(name, name)
        if canon in model.model_fields:
            params.setdefault(canon, []).append((name, v))
        elif name in guide.PARAMETERS:       # guided decoding: one constraint per request
            value = guide.PARAMETERS[name](f"{where}.{name}", v)
            if guide_from is not None:
                raise RequestError(f"{where}.{name}", f"conflicts with {where}.{guide_from} (one output "
                                                      f"constraint per request)")
            values["guide"], guide_from = value, name
        elif canon in RequestOptions.model_fields:
            opts.setdefault(canon, []).append((name, v))
        elif canon in NO_EFFECT:
            if v not in (False, "", [], {}):
                warn_once(f"param:{canon}", f"request parameter {canon!r} is ignored: {NO_EFFECT[canon]}")
        else:
            warn_once(f"param:{name[:MAX_SHOWN]}",
                      f"unknown request parameter {show(name)} dropped (as LMI does); known: "
                      + ", ".join(ALLOWED_PARAMETERS))
    values.update(_declared(model, params, where, lax))
    taken = _declared(RequestOptions, opts, where, lax)
    if infer_sampling and values.get("do_sample") is None \
            and any(values.get(k) is not None and asks(values[k]) for k, asks in SAMPLING_ASKED.items()):
        values["do_sample"] = True
    if options is not None:
        options.update(taken)
    top = values.pop("prompt_logprobs", None)
    if top is not None:                     # vLLM's prompt_logprobs: N alternatives per prompt token
        values.update(decoder_input_details=True, prompt_top_n=top)
    p = SamplingParams(**{**defaults.__dict__, **values})
    if p.min_tokens > p.max_new_tokens:
        raise RequestError(f"{where}.min_tokens",
                           f"must be <= max_new_tokens ({p.max_new_tokens}), got {p.min_tokens}")
    if p.best_of is not None and p.best_of < p.n:
        raise RequestError(f"{where}.best_of", f"must be >= n ({p.n}), got {p.best_of}")
    return p
