"""serving.properties + environment -> one frozen ServingConfig (LMI conventions).

Precedence for every key: a value in the properties file wins over the environment;
among environment variables an explicit OPTION_<KEY>/SERVING_<KEY> wins over the
LMI/TGI aliases (HF_MODEL_ID, MAX_BATCH_SIZE, ...). Errors are ConfigError with one
line naming where the value came from, the key, the value and what is allowed.
No torch at import time and no transformers at all: `python -m handler config` is cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import glob
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Iterator, Mapping

from handler.config import compat, hardware, sizing
from handler.config.numerics import Numerics, legacy_env_warnings
from handler.config.schema import (ALIASES, DEFAULT_ENTRY_POINT, DEFAULT_MODEL_DIR, ENV_ALIASES, EXTRA_ENV,
                                   IGNORED_KEYS, KNOWN_KEYS, LMI_ENTRY_POINTS, PORT, SCHEMA, TYPED_KEYS, _Bad,
                                   default_of)
from handler.config.sizing import read_heads as model_heads
from handler.config.task import resolve_task


class ConfigError(Exception):
    """A configuration problem; str(e) is the single line shown to the user."""


class PropertiesSyntaxError(ValueError):
    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


# --------------------------------------------------------------------------------------
# java.util.Properties.load syntax
# --------------------------------------------------------------------------------------
_WS = " \t\f"  # Java's whitespace here: not \v, not unicode spaces
_NEWLINE = re.compile(r"\r\n|\r|\n")  # not str.splitlines: that also splits on \x85, \u2028...
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, logical line): comments and blank lines skipped, continuations
    joined with the continuation line's leading whitespace dropped. As in Java, while a
    logical line is still empty (e.g. after a lone `\\`) the next line starts afresh."""
    buf, start, pending = "", 0, False
    natural = _NEWLINE.split(text)
    if natural[-1] == "":
        natural.pop()  # the text ended with a terminator: no further line
    for i, raw in enumerate(natural):
        line = raw.lstrip(_WS)
        if not buf:
            start = i + 1
            if not line or line[0] in "#!":  # a comment line never continues
                pending = False
                continue
        pending = (len(line) - len(line.rstrip("\\"))) % 2 == 1
        if pending:
            buf += line[:-1]
            continue
        yield start, buf + line
        buf = ""
    if pending:  # a backslash at the end of the input is dropped
        yield start, buf


def _unescape(s: str, lineno: int) -> str:
    out = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        i += 1
        if c != "\\":
            out.append(c)
        elif i < n:
            c = s[i]
            i += 1
            if c == "u":
                if not _HEX4.fullmatch(s, i, i + 4):
                    raise PropertiesSyntaxError(lineno, f"malformed \\uXXXX escape: {s[i - 2:i + 4]!r}")
                out.append(chr(int(s[i:i + 4], 16)))
                i += 4
            else:
                out.append(_ESCAPES.get(c, c))
    r = "".join(out)
    if any("\ud800" <= ch <= "\udfff" for ch in r):  # join \uD83D\uDE00 pairs into one char
        r = r.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")
    return r


def _split_key_value(line: str) -> tuple[str, str]:
    """Raw (still escaped) key and value of one logical line, as Properties.load does."""
    n = len(line)
    key_end = value_start = n
    has_sep = backslash = False
    for i, c in enumerate(line):
        if not backslash and c in "=:":
            key_end, value_start, has_sep = i, i + 1, True
            break
        if not backslash and c in _WS:
            key_end, value_start = i, i + 1
            break
        backslash = (c == "\\") and not backslash
    while value_start < n:
        c = line[value_start]
        if c not in _WS:
            if has_sep or c not in "=:":
                break
            has_sep = True
        value_start += 1
    return line[:key_end], line[value_start:]


def parse_properties_lines(text: str) -> list[tuple[int, str, str]]:
    """[(line number, key, value)] in file order (duplicates kept)."""
    out = []
    for lineno, line in _logical_lines(text):
        k, v = _split_key_value(line)
        out.append((lineno, _unescape(k, lineno), _unescape(v, lineno)))
    return out


def parse_properties(text: str) -> dict[str, str]:
    """java.util.Properties.load semantics; a later duplicate key wins.
    Raises PropertiesSyntaxError (a ValueError) on a malformed \\uXXXX escape."""
    return {k: v for _, k, v in parse_properties_lines(text)}


# --------------------------------------------------------------------------------------
# Keys: declared in handler/config/schema.py (parsers, defaults, aliases, docs)
# --------------------------------------------------------------------------------------
_BY_LOWER = {k.lower(): k for k in KNOWN_KEYS}  # file keys: case-insensitive


def _norm(key: str) -> str:
    return key.lower().replace("_", "")


_BY_NORM = {_norm(k): k for k in KNOWN_KEYS}  # env keys: case- and underscore-insensitive
assert len(_BY_NORM) == len(KNOWN_KEYS), "two known keys collide once normalised"


# --------------------------------------------------------------------------------------
# The resolved configuration
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServingConfig:
    """The resolved configuration. Each key's field, default and documentation are declared in
    handler/config/schema.py (Key.field_name); the rest is derived here."""
    strategy: str                 # "none" | "dynamic" | "rolling" | "paged"
    engine: str                   # "Python" | "MPI"
    model_id: str                 # as given (local path or s3:// URI)
    model_dir: str                # absolute local dir to load; "" for s3:// (cache chosen later)
    properties_file: str | None
    batch_size: int
    max_batch_delay_ms: int
    job_queue_size: int
    max_idle_time_s: int
    request_timeout_s: float
    graceful_timeout_s: float     # SIGTERM -> in-flight work may finish for this long
    rolling_batch: str            # "disable" | "auto" | "scheduler" | "lmi-dist" | "vllm"
    lmi_compat: str               # the LMI behaviour line: "current" | "0.31" | "0.26" (handler/config/compat.py)
    paged_attention: bool
    max_rolling_batch_size: int
    max_rolling_batch_prefill_tokens: int
    block_size: int
    enable_prefix_caching: bool
    kv_cache_tokens: int | None   # None = derive at start-up
    gpu_memory_utilization: float
    max_model_len: int | None     # None = the model's own
    dtype: str                    # "fp32" | "fp16" | "bf16" | "auto"
    device: str                   # "auto" | "cpu" | "cuda"
    tensor_parallel_degree: int
    trust_remote_code: bool
    model_impl: str               # "auto" | "lmi" | "transformers" (handler/model/llama.py or transformers')
    cpu_kernels: str              # "auto" | "avx512" | "avx2" | "neon" | "torch" (kernels/isa.py)
    quantize: str | None          # None | "int8" (handler/model/quant.py) | awq | gptq | gguf | none (quant_int4.py)
    entry_point: str
    revision: str | None          # a hub model id's branch, tag or commit (handler/model/hf_hub.py)
    output_formatter: str         # "json" | "jsonlines" | "sse" | "json_chat" | "jsonlines_chat" | "sse_chat"
    max_payload_mb: float         # request bodies above this are refused (413)
    batch_invariant: bool         # numerics independent of what shares the batch
    log_format: str               # "text" | "json" (server logs, one request line each)
    port: int
    warnings: tuple[str, ...]
    properties: dict = dataclasses.field(hash=False)  # merged raw properties, key -> value
    tgi_compat: bool = default_of("option.tgi_compat")     # TGI's shapes on /invocations
    enable_lora: bool = default_of("option.enable_lora")   # multi-LoRA (handler/model/lora.py)
    quantize_head: str = default_of("option.quantize_head")     # handler/config/numerics.py
    cpu_grouped_activations: str = default_of("option.cpu_grouped_activations")
    grouped_code_layout: str = default_of("option.grouped_code_layout")
    kv_cache_dtype: str = default_of("option.kv_cache_dtype")   # "auto" | "int8" (CPU) | fp8* (refused: no GPU build)
    max_loras: int = default_of("option.max_loras")        # distinct adapters running at once
    max_lora_rank: int = default_of("option.max_lora_rank")
    max_cpu_loras: int = default_of("option.max_loras")    # adapters kept read in memory
    enable_lora_management: bool = default_of("option.enable_lora_management")   # the /adapters routes
    adapter_roots: tuple = default_of("option.adapter_roots")   # where /adapters may read from
    http_header_timeout_s: float = default_of("option.http_header_timeout")   # slowloris bounds
    http_body_timeout_s: float = default_of("option.http_body_timeout")
    http_max_connections: int = default_of("option.http_max_connections")
    enforce_eager: bool = default_of("option.enforce_eager")   # no CUDA graphs (handler/model/cuda_graphs.py)
    engine_step_timeout_s: float = default_of("option.engine_step_timeout")   # the engine watchdog
    tool_call_parser: str = default_of("option.tool_call_parser")    # handler/http/protocols/tool_parsers.py
    enable_auto_tool_choice: bool = default_of("option.enable_auto_tool_choice")
    reasoning_parser: str = default_of("option.reasoning_parser")    # handler/http/protocols/reasoning.py
    responses_store_max_items: int = default_of("option.responses_store_max_items")   # handler/http/protocols/store.py
    responses_store_max_mb: float = default_of("option.responses_store_max_mb")
    allow_remote_images: bool = default_of("option.allow_remote_images")     # handler/http/protocols/media.py
    image_fetch_timeout_s: float = default_of("option.image_fetch_timeout")
    max_image_mb: float = default_of("option.max_image_mb")
    max_image_pixels: int = default_of("option.max_image_pixels")
    max_images_per_request: int = default_of("option.max_images_per_request")
    encoder_cache_mb: float = default_of("option.encoder_cache_mb")     # handler/model/vision.py
    chat_template: str | None = None      # option.chat_template's text (a file's, read at start-up)
    chat_template_content_format: str = default_of("option.chat_template_content_format")
    target_tpot_ms: float | None = None     # the scheduler's per-step time target (None: off)
    scheduling_policy: str = default_of("option.scheduling_policy")     # "fcfs" | "priority"
    scheduling_aging_ms: float = default_of("option.scheduling_aging_ms")
    speculative_config: dict | None = None          # option.speculative_config, parsed (vLLM's JSON)
    speculative_draft_model: str | None = None
    speculative_length: int | None = None
    speculative_disable_by_batch_size: int | None = None
    speculative: object = None    # handler.config.speculative.SpecConfig (None: no speculative decoding)
    normalize: bool | None = None   # option.normalize: a pooling model's unit-length embeddings (None: the checkpoint's)
    task: str = "generate"        # option.task resolved (handler/config/task.py): generate | text_embedding | classify | rerank

    @property
    def numerics(self) -> Numerics:
        """The keys that change a CPU endpoint's numbers, as the runner takes them."""
        return Numerics.of(self)


@dataclass
class _Value:
    raw: str
    source: str  # "path:line" or "environment VAR"


def _show(v: str) -> str:
    """A value as it can be shown on one line."""
    return v if v.isprintable() and v == v.strip() and v else json.dumps(v)


def _env_properties(env: Mapping[str, str]) -> dict[str, _Value]:
    out: dict[str, _Value] = {}
    for var in sorted(env):
        val = env[var]
        if val == "":
            continue  # `-e OPTION_X=` means unset
        if var in EXTRA_ENV:
            key = EXTRA_ENV[var]    # OPTION_ENGINE, as LMI: the SageMaker SDK's DJLModel sets it
        elif var.startswith("OPTION_") and len(var) > 7:
            key = "option." + var[7:].lower()
        elif var.startswith("SERVING_") and len(var) > 8:
            key = var[8:].lower()
        else:
            continue
        out[_BY_NORM.get(_norm(key), key)] = _Value(val, f"environment {var}")
    for var, key in ENV_ALIASES:
        if env.get(var) and key not in out:
            out[key] = _Value(env[var], f"environment {var}")
    return out


def _read_properties(path: str) -> dict[str, _Value]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    try:
        lines = parse_properties_lines(text)
    except PropertiesSyntaxError as e:
        raise ConfigError(f"{path}:{e.line}: {e.message}") from None
    return {_BY_LOWER.get(k.lower(), k): _Value(v, f"{path}:{n}") for n, k, v in lines}


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def check_tp_heads(model_dir: str, degree: int, origin: str) -> None:
    """Each rank takes heads/degree query heads and kv_heads/degree KV heads: both must divide."""
    found = model_heads(model_dir) if degree > 1 else None
    if found is None:
        return
    arch, heads, kv = found
    if heads % degree or kv % degree:
        raise ConfigError(f"{origin}: option.tensor_parallel_degree={degree} does not divide the heads of "
                          f"{arch} in {model_dir} (num_attention_heads={heads}, num_key_value_heads={kv}); "
                          "use a degree that divides both")


# huggingface_hub's validate_repo_id: [org/]name of letters, digits, '-', '_', '.', not '--' or '..'.
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")


def is_hub_id(model_id: str) -> bool:
    """A model id as the hub spells them (`org/name` or `name`), not a path (handler/model/hf_hub.py)."""
    return bool(_REPO_ID.fullmatch(model_id)) and "--" not in model_id and ".." not in model_id \
        and not model_id.endswith((".", ".git"))


_S3_URI = re.compile(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?", re.IGNORECASE)


def _is_gguf_file(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def gguf_files(path: str) -> list[str]:
    """The model's GGUF files: [path] for a .gguf file; in a directory without config.json (a
    Hugging Face directory wins), its *.gguf files, sorted; else []."""
    if _is_gguf_file(path):
        return [path]
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return []
    return sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))


def _check_model_dir(path: str) -> None:
    if _is_gguf_file(path):
        return      # a GGUF file: read (dequantized) by handler.model.gguf at load
    ggufs = gguf_files(path)
    if ggufs:
        if len(ggufs) > 1:
            raise ConfigError(f"model directory {path} holds {len(ggufs)} .gguf files "
                              f"({', '.join(os.path.basename(g) for g in ggufs)}); name one in option.model_id")
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"model directory {path} has no config.json; "
                          "it must hold a Hugging Face model (config.json + *.safetensors)")
    if glob.glob(os.path.join(glob.escape(path), "*.safetensors")):
        return
    bins = glob.glob(os.path.join(glob.escape(path), "*.bin"))
    if bins:
        raise ConfigError(f"model directory {path} has {os.path.basename(sorted(bins)[0])} but no "
                          "*.safetensors; safetensors weights are required (re-save with "
                          "model.save_pretrained(dir, safe_serialization=True))")
    raise ConfigError(f"model directory {path} has no *.safetensors weights")


class _Sources:
    """The merged raw properties with their typed values; `where` names a value's origin."""

    def __init__(self, merged: dict[str, _Value], properties_path: str | None, warnings: list[str]):
        self.merged = merged
        self.properties_path = properties_path
        self.warnings = warnings
        self.values: dict[str, object] = {}

    def get(self, key, default=SCHEMA):
        """The key's typed value; when absent `default`, or the schema's default if none given."""
        v = self.values.get(key)
        if v is not None:
            return v
        return SCHEMA[key].default if default is SCHEMA else default

    def resolved(self, key):
        """The key's value, else its first present alias's (LMI's / vLLM's names), else the default."""
        for k in (key, *ALIASES.get(key, ())):
            if self.values.get(k) is not None:
                return self.values[k]
        return SCHEMA[key].default

    def where(self, key: str) -> str:
        return f"{self.merged[key].source}: {key}={_show(self.merged[key].raw)}"


def _merge_sources(properties_path: str | None, model_dir: str, env: Mapping[str, str]) -> _Sources:
    """Environment, then the properties file over it (an override is a warning)."""
    if properties_path is None:
        default = os.path.join(model_dir, "serving.properties")
        properties_path = default if os.path.isfile(default) else None
    elif not os.path.isfile(properties_path):
        raise ConfigError(f"properties file {properties_path} does not exist")
    warnings: list[str] = []
    merged = _env_properties(env)
    if properties_path is not None:
        for key, val in _read_properties(properties_path).items():
            old = merged.get(key)
            if old is not None and old.raw.strip() != val.raw.strip():
                warnings.append(f"{old.source}={_show(old.raw)} is overridden by "
                                f"{val.source}: {key}={_show(val.raw)}")
            merged[key] = val
    return _Sources(merged, properties_path, warnings)


def _parse_values(src: _Sources) -> None:
    """Every present typed key validated up front; unknown keys warned about (with a hint)."""
    for key in TYPED_KEYS:
        val = src.merged.get(key)
        if val is None:
            src.values[key] = None
            continue
        try:
            src.values[key] = TYPED_KEYS[key](val.raw.strip())
        except _Bad as e:
            raise ConfigError(f"{val.source}: {key}={_show(val.raw)} {e}") from None
    unknown = sorted(k for k in src.merged if k not in KNOWN_KEYS)
    if unknown:
        named = []
        for k in unknown:
            origin = src.merged[k].source
            hint = difflib.get_close_matches(k, sorted(KNOWN_KEYS), n=1)
            named.append(k + (f" ({origin.split()[1]})" if origin.startswith("environment") else "")
                         + (f" (did you mean {hint[0]}?)" if hint else ""))
        src.warnings.append("unknown keys ignored: " + ", ".join(named))
    no_effect = sorted(k for k in src.merged if k in IGNORED_KEYS)
    if no_effect:
        src.warnings.append("accepted, has no effect here: " + ", ".join(no_effect))


def _resolve_strategy(src: _Sources) -> dict:
    """LMI semantics: batch_size / rolling_batch / paged_attention -> strategy, and the
    settings that only make sense with some strategies. Returns ServingConfig fields."""
    get, where, warnings = src.get, src.where, src.warnings
    line = compat.LINES[get("option.lmi_compat")]
    batch_size = get("batch_size")
    # Absent: the line's default; batch_size > 1 means dynamic batching (as LMI's recommender).
    rolling_batch = get("option.rolling_batch", line.rolling_batch if batch_size == 1 else "disable")
    paged = get("option.paged_attention")
    max_rolling = get("option.max_rolling_batch_size", line.max_rolling_batch_size)
    if rolling_batch == "disable":
        strategy = "dynamic" if batch_size > 1 else "none"
        if paged:
            warnings.append(f"{where('option.paged_attention')} has no effect without "
                            "option.rolling_batch (set option.rolling_batch=auto for paged attention)")
        paged = False
        unused = [k for k in ("option.max_rolling_batch_size", "option.max_rolling_batch_prefill_tokens",
                              "option.max_num_batched_tokens", "option.target_tpot_ms",
                              "option.scheduling_policy", "option.scheduling_aging_ms")
                  if k in src.merged]
    else:
        if rolling_batch == "scheduler" and paged:
            raise ConfigError(f"{where('option.paged_attention')} is not supported with "
                              "option.rolling_batch=scheduler; use option.rolling_batch=auto for paged attention")
        if paged is None:
            paged = rolling_batch != "scheduler"
        strategy = "paged" if paged else "rolling"
        if batch_size > 1:
            warnings.append(f"{where('batch_size')} is ignored with option.rolling_batch="
                            f"{rolling_batch} (option.max_rolling_batch_size={max_rolling} governs)")
        unused = []
    if strategy != "dynamic" and "max_batch_delay" in src.merged:
        unused.append("max_batch_delay")
    if unused:
        warnings.append(f"ignored with strategy {strategy}: {', '.join(unused)}")

    output_formatter = get("option.output_formatter")
    if strategy == "dynamic":
        for key, streams in (("option.output_formatter", output_formatter in ("jsonlines", "sse", "jsonlines_chat",
                                                                             "sse_chat")),
                             ("option.enable_streaming", get("option.enable_streaming"))):
            if streams:
                raise ConfigError(f"{where(key)} streams tokens, which dynamic batching "
                                  f"(batch_size={batch_size}) cannot do; use option.rolling_batch=auto "
                                  "to stream, or drop the streaming setting")

    block_size = get("option.block_size")
    kv_tokens = get("option.kv_cache_tokens")
    max_model_len = get("option.max_model_len")
    if kv_tokens is not None and kv_tokens < block_size:
        raise ConfigError(f"{where('option.kv_cache_tokens')} is smaller than "
                          f"option.block_size={block_size}; it must be >= the block size")
    if kv_tokens is not None and max_model_len is not None and kv_tokens < max_model_len:
        raise ConfigError(f"{where('option.kv_cache_tokens')} cannot hold one sequence of "
                          f"option.max_model_len={max_model_len}; raise it or lower max_model_len")

    entry_point = get("option.entryPoint")
    if entry_point not in LMI_ENTRY_POINTS and not entry_point.endswith(".py"):    # a .py: handler/http/custom.py
        warnings.append(f"{where('option.entryPoint')} is not run: this server uses its built-in engine "
                        f"({DEFAULT_ENTRY_POINT}) and the model directory's model.py formatters, if any")
    if get("engine") not in ("Python", "MPI"):
        warnings.append(f"{where('engine')}: this server runs its built-in engine for every LMI "
                        f"engine name (Python and MPI are the same here)")
    latency = {} if strategy in ("rolling", "paged") else \
        dict(target_tpot_ms=None, scheduling_policy="fcfs")     # request level: nobody is passed over
    return dict(**latency, strategy=strategy, batch_size=batch_size, rolling_batch=rolling_batch,
                paged_attention=paged, max_rolling_batch_size=max_rolling,
                output_formatter=output_formatter, block_size=block_size,
                kv_cache_tokens=kv_tokens, max_model_len=max_model_len, entry_point=entry_point,
                lmi_compat=line.name)


def _resolve_devices(src: _Sources, env: Mapping[str, str], gpu_count: int | None) -> dict:
    """Device, tensor-parallel degree and port; torch is asked only when the answer matters."""
    get, where = src.get, src.where
    device = get("option.device")
    tp = get("option.tensor_parallel_degree", compat.LINES[get("option.lmi_compat")].tensor_parallel_degree)
    if tp == "max" or tp > 1 or device == "cuda":
        if gpu_count is None:
            gpu_count = hardware.visible_gpus()
    if device == "cuda" and gpu_count == 0:
        raise ConfigError(f"{where('option.device')} but no CUDA GPU is visible; use option.device=auto or cpu")
    on_gpu = device == "cuda" or (device == "auto" and bool(gpu_count))
    if tp == "max":
        # All GPUs; on a CPU one rank: ranks on one host share its cores and its memory, so a
        # degree > 1 on CPU buys nothing but gloo all-reduces (it is for correctness runs).
        tp = gpu_count if on_gpu else 1
    if tp > 1 and "option.tensor_parallel_degree" not in src.merged:
        # The line's default (every GPU) yields to what cannot be sharded; an explicit degree is refused.
        single = [k for k in ("option.enable_lora", "option.speculative_config", "option.speculative_draft_model",
                              "option.batch_invariant") if get(k)]
        if single:
            src.warnings.append(f"option.tensor_parallel_degree defaults to 1 here, not {tp} (every GPU): "
                                f"{', '.join(single)} runs on one rank; set the degree to silence this")
            tp = 1
    if tp > 1:
        if on_gpu and tp > gpu_count:
            raise ConfigError(f"{where('option.tensor_parallel_degree')} needs {tp} GPUs (one rank per GPU), "
                              f"{gpu_count} visible; set option.tensor_parallel_degree to at most {gpu_count} "
                              "or max")
        if device == "cpu" and gpu_count:
            raise ConfigError(f"{where('option.tensor_parallel_degree')} with option.device=cpu on a machine "
                              f"with {gpu_count} GPUs is not supported; use option.device=auto (one rank per GPU)")
        cores = cpu_cores()
        if not on_gpu and tp > cores:
            src.warnings.append(f"{where('option.tensor_parallel_degree')} runs {tp} CPU ranks on {cores} "
                                "cores: ranks share cores (slow; fine for correctness runs)")

    kernels = get("option.cpu_kernels")
    if kernels != "auto" and not on_gpu:
        try:
            hardware.cpu_kernels(kernels)
        except ValueError as e:
            raise ConfigError(f"{where('option.cpu_kernels')}: {str(e).split(': ', 1)[1]}") from None

    why = sizing.kv_cache_dtype_refusal(get("option.kv_cache_dtype"), "cuda" if on_gpu else "cpu")
    if why:
        raise ConfigError(f"{where('option.kv_cache_dtype')} {why}")

    port_raw = env.get(PORT.var, "").strip()
    port = PORT.default
    if port_raw:
        if not re.fullmatch(r"[0-9]+", port_raw) or not 1 <= int(port_raw) <= 65535:
            raise ConfigError(f"environment {PORT.var}={_show(port_raw)} "
                              "is not a port number (1-65535)")
        port = int(port_raw)
    return dict(device=device, tensor_parallel_degree=tp, port=port)


def _resolve_model(src: _Sources, model_dir: str, check_model: bool) -> dict:
    """option.model_id (or option.s3url, or the model directory) -> model_id and local dir."""
    get, where, properties_path = src.get, src.where, src.properties_path
    mkey = "option.model_id" if "option.model_id" in src.merged else \
        "option.s3url" if "option.s3url" in src.merged else None
    if mkey is not None:
        model_id = get(mkey)
        if model_id[:5].lower() == "s3://":
            if not _S3_URI.fullmatch(model_id):
                raise ConfigError(f"{where(mkey)} is not a valid s3://bucket/prefix URI")
            local = ""
        else:
            path = os.path.expanduser(model_id)
            bases = [os.path.dirname(os.path.abspath(properties_path))] if properties_path else []
            candidates = [path] if os.path.isabs(path) else \
                [os.path.join(b, path) for b in bases + [os.getcwd()]]
            local = next((os.path.abspath(c) for c in candidates if os.path.isdir(c) or _is_gguf_file(c)), None)
            if local is None and mkey == "option.model_id" and is_hub_id(model_id):
                local = ""      # a hub id: fetched at start-up (handler/model/hf_hub.py), as LMI
            elif local is None:
                raise ConfigError(
                    f"{where(mkey)} is neither a local directory, an s3:// URI nor a hub model id "
                    "(org/name): put the model (config.json + *.safetensors) in the "
                    f"model directory (--model-dir, default {DEFAULT_MODEL_DIR}) or set "
                    "option.model_id to a local directory, s3://bucket/prefix or org/name")
    else:
        model_id = local = model_dir
        if check_model and not (os.path.isdir(model_dir) or _is_gguf_file(model_dir)):
            raise ConfigError(f"model directory {model_dir} does not exist; pass --model-dir DIR "
                              "or set option.model_id to a local directory or s3://bucket/prefix")
    if check_model and local:
        _check_model_dir(local)
    return dict(model_id=model_id, model_dir=local)


def _resolve_quantize(quantize: str | None, model_dir: str, device: str, gpu_count: int | None) -> dict:
    """option.quantize checked against the checkpoint (handler/config/quantization.py): a checkpoint's
    own quantization_config or a .gguf file decides when the key is absent."""
    from handler.config import quantization
    on_gpu = device == "cuda" or (device == "auto" and quantize == "fp8" and
                                  bool(gpu_count if gpu_count is not None else hardware.visible_gpus()))
    try:
        return dict(quantize=quantization.resolve(quantize, model_dir, on_gpu, is_gguf=bool(gguf_files(model_dir))
                                                  if model_dir else False))
    except quantization.QuantConfigError as e:
        raise ConfigError(str(e)) from None


LORA_KEYS = ("option.max_loras", "option.max_lora_rank", "option.max_cpu_loras")


def _resolve_lora(src: _Sources, tp_degree: int) -> dict:
    """option.enable_lora and its limits (defaults as LMI: 4 adapters, rank 16)."""
    get, where = src.get, src.where
    enable = get("option.enable_lora")
    max_loras = get("option.max_loras")
    max_cpu = get("option.max_cpu_loras", max_loras)
    if not enable:
        unused = [k for k in LORA_KEYS if k in src.merged]
        if unused:
            src.warnings.append(f"ignored without option.enable_lora=true: {', '.join(unused)}")
    else:
        if max_cpu < max_loras:
            raise ConfigError(f"{where('option.max_cpu_loras')} must be >= option.max_loras={max_loras} "
                              "(every adapter in a batch is also kept in memory)")
        if tp_degree > 1:
            raise ConfigError(f"{where('option.enable_lora')} is not supported with option."
                              f"tensor_parallel_degree={tp_degree} (adapters are not sharded across "
                              "ranks); use tensor_parallel_degree=1 or drop option.enable_lora")
    return dict(enable_lora=enable, max_loras=max_loras, max_lora_rank=get("option.max_lora_rank"),
                max_cpu_loras=max_cpu)


SPEC_KEYS = ("option.speculative_config", "option.speculative_draft_model", "option.speculative_length",
             "option.speculative_disable_by_batch_size")


def _resolve_spec(src: _Sources, tp_degree: int) -> dict:
    """Speculative decoding's keys -> SpecConfig (handler/config/speculative.py), or one-line refusals."""
    from handler.config.speculative import SpecConfigError, resolve
    get, where = src.get, src.where
    try:
        spec = resolve(get("option.speculative_config"), get("option.speculative_draft_model"),
                       get("option.speculative_length"), get("option.speculative_disable_by_batch_size"))
    except SpecConfigError as e:
        raise ConfigError(str(e)) from None
    if spec is None:
        unused = [k for k in SPEC_KEYS[2:] if k in src.merged]
        if unused:
            src.warnings.append(f"ignored without option.speculative_config or option.speculative_draft_model: "
                                f"{', '.join(unused)}")
        return dict(speculative=None)
    key = "option.speculative_config" if "option.speculative_config" in src.merged else \
        "option.speculative_draft_model"
    if spec.method == "draft_model":
        draft = spec.draft_model
        if draft[:5].lower() == "s3://":
            raise ConfigError(f"{where(key)}: a draft model from s3:// is not supported; give the draft model "
                              "as a local model directory or .gguf file")
        if not os.path.exists(draft):
            raise ConfigError(f"{where(key)}: draft model {draft} does not exist; allowed: a local model "
                              "directory or .gguf file with the model's tokenizer")
    if tp_degree > 1:
        raise ConfigError(f"{where(key)} is not supported with option.tensor_parallel_degree={tp_degree}; "
                          "use tensor_parallel_degree=1 or drop speculative decoding")
    if get("option.batch_invariant"):
        raise ConfigError(f"{where(key)} is not supported with option.batch_invariant=true (it feeds one "
                          "token per forward); drop one of them")
    return dict(speculative=spec)


def _resolve_chat_template(src: _Sources, model_dir: str) -> dict:
    """option.chat_template: a file (read now) or the template's text; compiled to catch syntax errors."""
    value = src.get("option.chat_template")
    if value is None:
        return {}
    key = "option.chat_template"
    bases = [os.path.dirname(os.path.abspath(src.properties_path))] if src.properties_path else []
    path = os.path.expanduser(value.strip())
    candidates = [path] if os.path.isabs(path) else [os.path.join(b, path) for b in bases + [model_dir, os.getcwd()]]
    found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is not None:
        try:
            with open(found, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{src.where(key)}: cannot read {found}: {e}") from None
        origin = found
    elif "{{" in value or "{%" in value:
        text, origin = value, src.merged[key].source
    else:
        raise ConfigError(f"{src.where(key)} is neither a file (looked in {', '.join(candidates)}) nor a Jinja "
                          "template; give a template file or the template text")
    import jinja2
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{src.where(key)}: {origin}, template line {e.lineno}: {e.message}") from None
    return dict(chat_template=text)


def _dividing_degree(src: _Sources, model_dir: str, gpus: int) -> int:
    """The largest degree <= gpus dividing the model's attention and KV heads (a warning when < gpus)."""
    found = model_heads(model_dir)
    if found is None:
        return gpus
    arch, heads, kv = found
    degree = next(d for d in range(gpus, 0, -1) if heads % d == 0 and kv % d == 0)
    if degree < gpus:
        src.warnings.append(f"option.tensor_parallel_degree defaults to {degree}, not {gpus} (every GPU): "
                            f"{degree} is the most ranks that divide the heads of {arch} "
                            f"(num_attention_heads={heads}, num_key_value_heads={kv})")
    return degree


def load_config(properties_path: str | None = None, model_dir: str | None = None,
                env: Mapping[str, str] | None = None, check_model: bool = True,
                gpu_count: int | None = None) -> ServingConfig:
    """Stages: merge sources -> parse typed values -> strategy -> devices -> LoRA -> model."""
    env = os.environ if env is None else env
    model_dir = os.path.abspath(model_dir or DEFAULT_MODEL_DIR)
    src = _merge_sources(properties_path, model_dir, env)
    src.warnings.extend(legacy_env_warnings(env))
    _parse_values(src)
    strategy = _resolve_strategy(src)
    devices = _resolve_devices(src, env, gpu_count)
    lora = _resolve_lora(src, devices["tensor_parallel_degree"])
    spec = _resolve_spec(src, devices["tensor_parallel_degree"])
    model = _resolve_model(src, model_dir, check_model)
    if model["model_dir"] and devices["tensor_parallel_degree"] > 1:
        key = "option.tensor_parallel_degree"
        if key not in src.merged:      # the line's default (every GPU): the most GPUs that divide the heads
            devices["tensor_parallel_degree"] = _dividing_degree(src, model["model_dir"],
                                                                 devices["tensor_parallel_degree"])
        check_tp_heads(model["model_dir"], devices["tensor_parallel_degree"],
                       src.merged[key].source if key in src.merged else "option.tensor_parallel_degree=max")
    # Every key with a field: its value, an alias's, or the default; the stages' results over them.
    direct = {k.field_name: src.resolved(k.name) for k in SCHEMA.values() if k.field_name}
    quant = _resolve_quantize(direct["quantize"], model["model_dir"], devices["device"], gpu_count)
    template = _resolve_chat_template(src, model["model_dir"] or model_dir)
    direct["task"] = resolve_task(direct["task"], model["model_dir"])
    if src.get("option.enable_reasoning") is not None:      # LMI's switch over option.reasoning_parser
        if src.get("option.enable_reasoning") and direct["reasoning_parser"] == "none":
            raise ConfigError(f"{src.where('option.enable_reasoning')} needs option.reasoning_parser; allowed: "
                              + ", ".join(a for a in SCHEMA["option.reasoning_parser"].allowed if a != "none"))
        if not src.get("option.enable_reasoning"):
            direct["reasoning_parser"] = "none"
    return ServingConfig(**{
        **direct, **strategy, **devices, **model, **lora, **quant, **spec, **template,
        "properties_file": os.path.abspath(src.properties_path) if src.properties_path else None,
        "warnings": tuple(src.warnings),
        "properties": {k: v.raw for k, v in sorted(src.merged.items())},
    })


def config_to_dict(cfg: ServingConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["warnings"] = list(cfg.warnings)
    return {"strategy": d.pop("strategy"), **d}


def main(argv: list[str]) -> int:
    """`python -m handler config [--properties FILE] [--model-dir DIR]`: print the resolved config."""
    if argv[:1] == ["config"]:
        argv = argv[1:]
    if "--explain" in argv:  # the KV arithmetic of the file (handler/config/explain.py)
        from handler.config.explain import main as explain_main
        return explain_main(argv)
    p = argparse.ArgumentParser(prog="python -m handler config",
                                description="Resolve serving.properties + environment and print it as JSON.")
    p.add_argument("--properties", metavar="FILE",
                   help="properties file (default: MODEL_DIR/serving.properties if it exists)")
    p.add_argument("--model-dir", metavar="DIR", help=f"model directory (default {DEFAULT_MODEL_DIR})")
    p.add_argument("--no-check-model", action="store_true",
                   help="don't require config.json and *.safetensors in the model directory")
    p.add_argument("--explain", action="store_true",
                   help="print the KV-cache arithmetic instead (see --explain --help)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.properties, args.model_dir, check_model=not args.no_check_model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for w in cfg.warnings:
        print(f"warning: {w}", file=sys.stderr)
    try:
        print(json.dumps(config_to_dict(cfg), indent=2), flush=True)
    except BrokenPipeError:  # `... | head`: not an error; keep the exit-time flush quiet too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
