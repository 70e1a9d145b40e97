"""Every serving.properties key, declared once: its parser (the validator whose message a bad value
gets), its default, the values it takes, LMI's other names for it (keys and environment variables),
the ServingConfig field it resolves to, and one line of documentation.

handler.config.properties derives TYPED_KEYS, ENV_ALIASES, IGNORED_KEYS and KNOWN_KEYS from here
and takes its defaults from here; handler.config.docs renders the reference tables of
docs/PROPERTIES.md (and README.md's compact one) from here (`python -m handler.config.docs --write`).
Plain data: no torch, no transformers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from handler.config.numerics import CODE_LAYOUTS, GROUPED_ACTIVATIONS, QUANTIZE_HEAD

DEFAULT_MODEL_DIR = "/opt/ml/model"
DEFAULT_ENTRY_POINT = "djl_python.huggingface"
# LMI's own handler modules: each is what the built-in engine does here (no warning).
LMI_ENTRY_POINTS = (DEFAULT_ENTRY_POINT, "djl_python.lmi_vllm.vllm_async_service", "djl_python.lmi_dist",
                    "djl_python.vllm", "djl_python.lmi_trtllm.trtllm_async_service", "djl_python.tensorrt_llm")


# --------------------------------------------------------------------------------------
# Value parsers. Each raises _Bad("what is wrong"); the caller completes the message with
# where the value came from, the key and the value. `allowed` / `doc` feed the docs.
# --------------------------------------------------------------------------------------
class _Bad(ValueError):
    """What is wrong with a value, completed by the caller with source/key/value."""


def _int(minimum: int) -> Callable[[str], int]:
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(v: str) -> int:
        if not re.fullmatch(r"[+]?[0-9]+", v) or int(v) < minimum:
            raise _Bad(f"is not {what}")
        return int(v)

    parse.doc = f"≥ {minimum}"
    return parse


def _float(lo: float, hi: float | None, lo_open: bool, what: str) -> Callable[[str], float]:
    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise _Bad(f"is not {what}") from None
        if "_" in v or x != x or x in (float("inf"), float("-inf")) \
                or (x <= lo if lo_open else x < lo) or (hi is not None and x > hi):
            raise _Bad(f"is not {what}")
        return x

    parse.doc = (f"{'>' if lo_open else '≥'} {lo:g}" if hi is None else
                 f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return parse


def _bool(v: str) -> bool:
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise _Bad("is not a boolean; allowed: true, false")


_bool.allowed = ("true", "false")


def _enum(allowed: list[str], aliases: Mapping[str, str] | None = None) -> Callable[[str], str]:
    table = {a.lower(): a for a in allowed}
    table.update({k.lower(): v for k, v in (aliases or {}).items()})

    def parse(v: str) -> str:
        if v.lower() not in table:
            raise _Bad(f"is not supported; allowed: {', '.join(allowed)}")
        return table[v.lower()]

    parse.allowed = tuple(allowed)
    parse.aliases = tuple(aliases or ())
    return parse


def _block_size(v: str) -> int:
    n = int(v) if re.fullmatch(r"[+]?[0-9]+", v) else 0
    if not 1 <= n <= 256 or n & (n - 1):
        raise _Bad("is not a power of two from 1 to 256")
    return n


_block_size.doc = "power of two 1-256"


def _tp_degree(v: str) -> int | str:
    if v.lower() == "max":
        return "max"
    try:
        return _int(1)(v)
    except _Bad:
        raise _Bad("is not a positive integer or max") from None


def _adapter_roots(v: str) -> tuple[str, ...]:
    roots = tuple(r.strip() for r in v.split(",") if r.strip())
    for r in roots:
        if r[:5].lower() == "s3://":
            if not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^\s]*)?", r, re.IGNORECASE):
                raise _Bad(f"has {r!r}, not a valid s3://bucket/prefix")
        elif not r.startswith("/") or any(part == ".." for part in r.split("/")):
            raise _Bad(f"has {r!r}: each root is an absolute directory (no '..') or s3://bucket/prefix")
    return roots


_adapter_roots.doc = "comma-separated absolute directories and `s3://bucket/prefix`es"


def _lmi_line(v: str) -> str:
    from handler.config.compat import line_of
    try:
        return line_of(v)
    except ValueError as e:
        raise _Bad(str(e)) from None


_lmi_line.allowed = ("current", "0.31", "0.26")


def _non_empty(v: str) -> str:
    if not v:
        raise _Bad("is empty")
    return v


def _spec_json(v: str) -> dict:
    from handler.config.speculative import SpecConfigError, parse_spec_json
    try:
        return parse_spec_json(v)
    except SpecConfigError as e:
        raise _Bad(str(e)) from None


_spec_json.doc = "JSON object: `method` (`ngram` | `draft_model`), `num_speculative_tokens`, " \
    "`prompt_lookup_min`, `prompt_lookup_max`, `model`, `disable_by_batch_size`"


# --------------------------------------------------------------------------------------
# The declarations
# --------------------------------------------------------------------------------------
_FIELD = object()   # Key.field's default: the key's name without "option."


@dataclass(frozen=True)
class Key:
    """One serving.properties key.

    default: the resolved value when the key (and its `alias_of` names) are absent; None when
      there is none or it is derived (then `default_doc` says what happens).
    env: LMI / TGI / SageMaker environment aliases, in precedence order; used only when the
      explicit `OPTION_<KEY>` / `SERVING_<KEY>` variable is unset (ENV_ALIASES).
    extra_env: explicit variables besides `OPTION_<KEY>` / `SERVING_<KEY>` (as strong as those).
    alias_of: this key is LMI's / vLLM's other name for that key, read when that one is absent.
    field: the ServingConfig field the key resolves to (None: checked only, or an alias).
    unit / values: the docs' "unit / values" column (values: else from the parser).
    default_doc / summary_default: how the docs / README's compact table show the default,
      when not `default` itself."""
    name: str
    parse: Callable[[str], object]
    doc: str
    default: object = None
    unit: str = ""
    values: str | None = None
    env: tuple[str, ...] = ()
    extra_env: tuple[str, ...] = ()
    env_doc: str = ""
    alias_of: str | None = None
    field: object = _FIELD
    default_doc: str | None = None
    summary_default: str | None = None

    @property
    def field_name(self) -> str | None:
        if self.field is _FIELD:
            return None if self.alias_of else self.name.removeprefix("option.")
        return self.field

    @property
    def allowed(self) -> tuple[str, ...]:
        """The values an enumerated key takes (empty for the others)."""
        return getattr(self.parse, "allowed", ())

    @property
    def explicit_env(self) -> tuple[str, ...]:
        """The variables that set the key as strongly as the file's absence allows."""
        own = ("OPTION_" + self.name[len("option."):] if self.name.startswith("option.")
               else "SERVING_" + self.name).upper()
        return (own, *self.extra_env)


# option.task's values (LMI's names first) and its other spellings (LMI's, vLLM's, HF pipelines').
TASKS = ("text_embedding", "classify", "rerank", "generate")
TASK_ALIASES = {"text-embedding": "text_embedding", "feature-extraction": "text_embedding",
                "feature_extraction": "text_embedding", "embed": "text_embedding", "embedding": "text_embedding",
                "sentence-similarity": "text_embedding", "text-classification": "classify",
                "classification": "classify", "score": "rerank", "cross-encoder": "rerank",
                "text-generation": "generate", "text_generation": "generate", "conversational": "generate",
                "text2text-generation": "generate"}

ROLLING_BATCH_VALUES = ["auto", "scheduler", "lmi-dist", "vllm", "disable"]
_SECONDS = _float(0.0, None, True, "a positive number of seconds")
_QUANTIZE = _enum(["int8", "int8_weight_only", "awq", "gptq", "gguf", "fp8", "none"],   # option.quantize, vLLM's name
                  {"w8a8": "int8", "int8_dynamic": "int8", "awq_marlin": "awq", "gptq_marlin": "gptq",
                   "w8a16": "int8_weight_only", "int8_wo": "int8_weight_only"})

KEYS: tuple[Key, ...] = (
    # LMI's other engine names are accepted (with a warning) so that older files load as written.
    Key("engine", _enum(["Python", "MPI", "DeepSpeed", "FasterTransformer"]),
        "LMI engine name; every one runs the same built-in engine here", default="Python",
        values="`Python`, `MPI`; also `DeepSpeed`, `FasterTransformer` (warning) (any case)",
        extra_env=("OPTION_ENGINE",), env_doc="(as LMI; the SageMaker SDK sets it)"),
    Key("batch_size", _int(1), "dynamic batching: largest batch; > 1 without rolling batch selects `dynamic`",
        default=1, unit="requests"),
    Key("max_batch_delay", _int(0), "dynamic batching: longest wait after the first request of a batch",
        default=100, unit="ms", field="max_batch_delay_ms"),
    Key("job_queue_size", _int(1), "requests waiting beyond this are refused with 503",
        default=1000, unit="requests", env=("MAX_CONCURRENT_REQUESTS",)),
    Key("max_idle_time", _int(1), "LMI worker idle time (accepted for compatibility)",
        default=60, unit="s", field="max_idle_time_s"),
    Key("request_timeout", _SECONDS, "longest time one request may take (504 after)",
        default=600.0, unit="s", env=("SAGEMAKER_MODEL_SERVER_TIMEOUT",), field="request_timeout_s"),
    Key("graceful_timeout", _SECONDS,
        "after SIGTERM: new connections are refused at once and in-flight requests may finish for this "
        "long (SageMaker sends SIGKILL 30 s after SIGTERM)",
        default=30.0, unit="s", field="graceful_timeout_s"),
    Key("option.model_id", _non_empty,
        "where the model is; a relative path resolves against the properties file's directory, then the "
        "working directory. A `.gguf` file (or a directory holding one) is converted once into "
        "`LMI_MODEL_CACHE` (config, tokenizer, dequantized tensors); a Llama-family model then serves its "
        "Q4_0/Q4_1/Q8_0 linear weights as they are (`option.quantize=gguf`, the default; `none` keeps the "
        "dequantized ones). A hub id (`org/name`, as LMI and the SageMaker SDK's `HF_MODEL_ID`) is fetched at "
        "start-up with huggingface_hub (safetensors, config, tokenizer, chat template only) into "
        "`LMI_MODEL_CACHE`/hub; `HF_TOKEN`, `HF_ENDPOINT` (a mirror) and `HF_HUB_OFFLINE` apply; an unknown "
        "id or an unreachable hub without a cached copy stops the start-up in one line",
        values="local dir, `.gguf` file, `s3://bucket/prefix` or hub id `org/name`", env=("HF_MODEL_ID",),
        default_doc="the model dir"),
    Key("option.revision", _non_empty, "a hub model id's branch, tag or commit", values="git revision",
        default_doc="`main`", env=("HF_REVISION",)),
    Key("option.s3url", _non_empty,
        "LMI's older name for an S3 `option.model_id` (used when `option.model_id` is absent)",
        values="`s3://bucket/prefix`", alias_of="option.model_id"),
    Key("option.lmi_compat", _lmi_line,
        "the LMI release line this endpoint behaves as: the defaults of absent keys and how `/invocations` "
        "reads a body (the table \"LMI version lines\" below lists every difference); the start-up log "
        "names the line in force", default="current",
        values="`current`, `0.31`, `0.26` (or an LMI version: ≤ 0.26, 0.27-0.31, ≥ 0.32 is `current`)"),
    Key("option.rolling_batch", _enum(ROLLING_BATCH_VALUES),
        "iteration-level (continuous) batching on/off; see the strategy table",
        default_doc="`auto` (`disable` with `option.lmi_compat=0.26`, or with `batch_size` > 1)",
        summary_default="`auto` (0.26: `disable`)"),
    Key("option.paged_attention", _bool,
        "paged KV cache (strategy `paged`) vs contiguous (strategy `rolling`)",
        default_doc="`true` for `auto`/`lmi-dist`/`vllm`, `false` for `scheduler`",
        summary_default="`true` (`false` for `scheduler`)"),
    Key("option.max_rolling_batch_size", _int(1),
        "rolling/paged: most sequences decoded together (the KV pool bounds how many run at full length: "
        "`config --explain`)", unit="sequences", env=("MAX_BATCH_SIZE",),
        default_doc="256 (32 with `option.lmi_compat=0.26`)", summary_default="256 (0.26: 32)"),
    Key("option.max_rolling_batch_prefill_tokens", _int(1), "rolling/paged: prompt tokens admitted per step",
        default=4096, unit="tokens", env=("MAX_BATCH_PREFILL_TOKENS",)),
    Key("option.block_size", _block_size, "paged: tokens per KV block", default=16, unit="tokens"),
    Key("option.enable_prefix_caching", _bool, "reuse KV blocks of identical prompt prefixes", default=False),
    Key("option.target_tpot_ms", _float(0.0, None, True, "a positive number of milliseconds"),
        "rolling/paged: steady decode under load. Each step runs its decode rows first and then only as many "
        "prompt tokens as the measured step cost (a running fit of step time against decode rows and prompt "
        "tokens) says fit in this time per output token; `option.max_rolling_batch_prefill_tokens` stays the "
        "hard cap. A step whose decode rows alone take longer admits no new prompt, so fewer sequences decode "
        "at once and the others wait in arrival order (TTFT for TPOT; under `priority` scheduling within "
        "`option.scheduling_aging_ms`)",
        unit="ms", default_doc="unset: every step takes the full prefill budget"),
    Key("option.scheduling_policy", _enum(["fcfs", "priority"]),
        "rolling/paged: `fcfs` admits in arrival order; `priority` admits the lowest request `priority` first "
        "(vLLM's semantics) and lets a request preempt (recompute) running ones of a strictly higher number; "
        "while a better class's prompt prefills, the worse classes' decode rows sit out every other step. "
        "Under `fcfs` a request with a non-zero `priority` is refused (400 naming the field), as vLLM does",
        default="fcfs"),
    Key("option.scheduling_aging_ms", _float(0.0, None, True, "a positive number of milliseconds"),
        "with `option.scheduling_policy=priority`: a request that has waited this long for admission or its "
        "first token goes ahead of every priority class and gets the full prefill budget, and is not preempted "
        "for priority before its next token, so nothing is passed over forever (under `fcfs` nothing is "
        "passed over: admission is in arrival order)",
        default=2000.0, unit="ms"),
    Key("option.kv_cache_tokens", _int(1),
        "KV cache capacity (same meaning for rolling and paged). Unset: every running sequence at full length, "
        "within (GPU) `option.gpu_memory_utilization`, or (CPU) 70 % of the memory left after the weights "
        "(the cgroup's `memory.max` less `memory.current` when a limit is set, else `MemAvailable`) less 512 MiB; "
        "a request that cannot fit is refused (400), never an OOM kill",
        values="tokens, ≥ `option.block_size` and ≥ `option.max_model_len`", default_doc="derived at start-up"),
    Key("option.kv_cache_dtype", _enum(["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]),
        "the KV cache's element type: `auto` the model's dtype; `int8` (CPU) one byte an element and a fp32 "
        "scale per token and head (symmetric, written by the KV-write kernel, read in place by the attention "
        "kernels): about half the bytes of bf16, a quarter of fp32, so the same memory holds about twice "
        "(four times) the tokens; every attention, a prompt's over its own rows too, reads the rows as stored. `fp8`/`fp8_e4m3`/`fp8_e5m2` "
        "(vLLM's GPU names) are refused in one line: on a CPU, and on CUDA where the Triton kernels do not "
        "read them yet; `int8` on CUDA likewise", default="auto"),
    Key("option.gpu_memory_utilization", _float(0.0, 1.0, True, "a number in (0, 1]"),
        "share of GPU memory the server may use (sizes the KV cache when `option.kv_cache_tokens` is not set, "
        "to no more than every running sequence at full length needs)",
        default=0.9, values="fraction in (0, 1]"),
    Key("option.max_model_len", _int(1), "cap on prompt + generated tokens per sequence",
        unit="tokens", default_doc="the model's own"),
    Key("option.dtype", _enum(["fp32", "fp16", "bf16", "auto"],
                              {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}),
        "weight and activation dtype", default="auto"),
    Key("option.device", _enum(["auto", "cpu", "cuda"]),
        "where the model runs (`auto`: CUDA if visible); `cuda` without a GPU is an error", default="auto"),
    Key("option.tensor_parallel_degree", _tp_degree,
        "N model ranks under torch.distributed, the heads split N ways: one rank per GPU (NCCL) on a GPU "
        "host, N gloo processes sharing the cores on a CPU host (a correctness run; a degree above the core "
        "count warns). Refused in one line: more ranks than GPUs, a degree that does not divide "
        "`num_attention_heads` and `num_key_value_heads`, an architecture without a transformers "
        "tensor-parallel plan (e.g. GPT-2)",
        default_doc="`max` (1 with `option.lmi_compat=0.26`)", summary_default="`max` (0.26: 1)",
        values="ranks, ≥ 1, or `max` (= visible GPUs; 1 on a CPU host)",
        env=("TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS")),
    Key("option.trust_remote_code", _bool, "allow model code shipped in the model directory", default=False,
        env=("HF_MODEL_TRUST_REMOTE_CODE",)),
    Key("option.model_impl", _enum(["auto", "lmi", "transformers"], {"vllm": "lmi"}),
        "the model's implementation: `auto` ours (handler/model/llama.py) for the Llama family (Llama, "
        "SmolLM, Mistral, Qwen2, Qwen3, Granite, Phi-3, OLMo-2, Gemma 2, Gemma 3), transformers' for every "
        "other architecture; "
        "`lmi` ours or a start-up error naming why not (`vllm`, vLLM's name, is taken for it); `transformers` "
        "transformers' own model through the paged attention interface", default="auto",
        env=("VLLM_MODEL_IMPL",)),
    Key("option.cpu_kernels", _enum(["auto", "avx512", "avx2", "neon", "torch"]),
        "CPU: the instruction set the C kernels are built for (kernels/isa.py): `avx512` (AVX-512 F/BW/VL; VNNI "
        "int8 and AVX512-BF16 where the CPU has them), `avx2` (AVX2 + FMA: AMD Zen 1-3, Intel client CPUs), "
        "`neon` (aarch64: Graviton, Apple Silicon), `torch` (no C kernels: PyTorch's operators). `auto`: the "
        "first of avx512, avx2, neon this CPU runs. One the CPU cannot run stops the start-up in one line; the "
        "start-up log and `config --explain` name the choice and why. Ignored on a GPU", default="auto",
        env=("LMI_CPU_KERNELS",)),
    Key("option.entryPoint", _non_empty,
        "LMI handler: a `.py` file (relative to the model directory) whose `handle(inputs)` answers "
        "`/invocations` (LMI's custom handler; the model directory's `model.py` is used without this key); "
        "a module name runs the built-in engine (another than the default warns), with `model.py`'s "
        "`@input_formatter`/`@output_formatter` if any (docs/API.md \"Custom code\")",
        default=DEFAULT_ENTRY_POINT, values="`.py` file or module name", field="entry_point"),
    Key("option.output_formatter", _enum(["json", "jsonlines", "sse", "json_chat", "jsonlines_chat", "sse_chat"]),
        "default response format of `/invocations` (`jsonlines`/`sse` stream tokens; `*_chat` answer in "
        "Chat Completions objects)", default="json"),
    Key("option.tgi_compat", _bool,
        "TGI's shapes on `/invocations`: a one-element list, tokens with `logprob`/`special`, `details` on by "
        "default, SSE streaming", default=False),
    # LMI's / vLLM's names for ours: used when ours are absent.
    Key("option.predict_timeout", _SECONDS,
        "LMI's name for `request_timeout` (used when `request_timeout` is absent)", unit="s",
        env=("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS",),   # as LMI's SageMakerCompatibility
        alias_of="request_timeout", summary_default="(`request_timeout`)"),
    Key("option.max_num_batched_tokens", _int(1),
        "vLLM's name for `option.max_rolling_batch_prefill_tokens` (used when that is absent)", unit="tokens",
        alias_of="option.max_rolling_batch_prefill_tokens"),
    Key("option.quantize", _QUANTIZE,
        "quantized linear layers (the output head and embeddings stay in `option.dtype`). `int8`: dynamic W8A8, "
        "weights rounded per output channel at load, activations per token each step (kernels/cpu_gemm_i8.c "
        "on every CPU kernel build: VNNI, AVX2, NEON; `w8a8` and `int8_dynamic` are its other names). "
        "`int8_weight_only` (torchao's name; `w8a16`, `int8_wo`): W8A16 as OpenVINO's int8, weights rounded per "
        "output channel (symmetric), activations stay float; kernels/cpu_gemm_q4.c's 8-bit path on every CPU build, "
        "bit for bit its dequantized weights' fp32 results; closer to fp32's answers than `int8`. `awq`, `gptq`: a pre-quantized "
        "4-bit checkpoint (AutoAWQ GEMM / GPTQ packing, group scales and zeros), served without dequantizing "
        "(kernels/cpu_gemm_q4.c, bit for bit its dequantized fp32 model's results); detected from config.json's "
        "`quantization_config` when the key is absent, and must agree with it; linear layers at 0.16x their "
        "fp32 bytes (group 64), a served batch of 50 at fp32's speed (the same fp32 FMAs), single rows faster. "
        "`gguf`: a `.gguf` model's Q4_0/Q4_1/Q8_0 tensors served as they are (the default for a `.gguf` "
        "model_id; other tensor types stay dequantized; SmolLM2's Q4_1: the same perplexity and answers as its "
        "dequantized weights). `none`: a quantized checkpoint or `.gguf` file dequantized to `option.dtype`. "
        "`fp8`: refused (needs an fp8 GPU; not implemented yet). docs/QUANTIZATION.md has memory, speed and "
        "quality of each. Absent: the model's dtype, or the checkpoint's own quantization",
        values="`int8`, `int8_weight_only`, `awq`, `gptq`, `gguf`, `fp8`, `none`", env=("HF_MODEL_QUANTIZE",),
        summary_default="(none; a quantized checkpoint's own)"),
    Key("option.quantize_head", _enum(list(QUANTIZE_HEAD)),
        "`option.quantize=int8` / `int8_weight_only`: the output head quantized too (`true`; under int8 also "
        "smoothed by the final norm) or kept in `option.dtype` (`false`); `auto`: quantized under "
        "int8_weight_only (perplexity unchanged, a third of a one-row step's bytes on a 150k vocabulary), kept "
        "under int8 (W8A8's head: +2.5% perplexity on Qwen2.5-Coder-0.5B). Changes the answers: carried in "
        "the packed weights", default="auto"),
    Key("option.cpu_grouped_activations", _enum(list(GROUPED_ACTIVATIONS)),
        "CPU, grouped weights (GGUF blocks, AWQ/GPTQ, int8_weight_only) with groups of at most 256 inputs, a "
        "multiple of 4 (every GGUF type; not int8_weight_only's one group a row), codes of any width (4, 5, 6 "
        "or 8 bits, either `option.grouped_code_layout`): `exact` multiplies them by the fp32 activations (bit "
        "for bit the dequantized model); "
        "`int8` by int8 activations, each row quantized per group as llama.cpp's Q8 blocks, with integer dot "
        "products (faster; not bit for bit the dequantized model; the avx512 build with VNNI and VBMI and the "
        "avx2 build give the same values; neon ignores it, said in the load log). Kept in each layer's pack "
        "and passed to the kernel per call (kernels/cpu_gemm_q4.c). Ignored on a GPU", default="exact"),
    Key("option.grouped_code_layout", _enum(list(CODE_LAYOUTS)),
        "CPU, grouped weights whose codes need 5 or 6 bits (GGUF Q5_0/Q5_1/Q5_K/Q6_K): `bytes` streams them "
        "one a byte, `packed` as nibbles plus bit planes (Q6_K 6.75 bits a weight against 8.75). Packed "
        "reads fewer bytes but costs more instructions a weight: on a 2-core AMD EPYC Zen 4 a Qwen 1.5B "
        "q4_k_m decode step took 61.7 ms packed, 52.9 ms as bytes (benchmarks/results/gguf-bytes/); for "
        "hosts whose weight stream is the bound. With `option.cpu_grouped_activations=int8` both take the "
        "int8 path, and packed was the faster at one row on avx512 (a 151,936 x 2,048 Q6_K head: 7.5 against "
        "10.6 ms), not on avx2 (11.3 against 10.3; benchmarks/results/gguf-act8/). The same values either way "
        "(the kernel's operations are the same); a key, not the environment, so the pack says what it "
        "streams", default="bytes"),
    Key("option.quantization", _QUANTIZE,
        "vLLM's name for `option.quantize` (used when that is absent)", values="as `option.quantize`",
        alias_of="option.quantize"),
    Key("option.log_format", _enum(["text", "json"]),
        "server log lines; `json`: one JSON object per line, the request line's fields at the top level",
        default="text"),
    Key("option.enable_streaming", _bool,
        "LMI's streaming switch; only checked (streaming is per request here)", default=False, field=None),
    Key("option.http_header_timeout", _SECONDS,
        "a connection must deliver a request's headers within this long of their first byte, else it is "
        "closed (slowloris); an idle keep-alive connection waits 75 s for its next request", default=10.0,
        unit="s", field="http_header_timeout_s"),
    Key("option.http_body_timeout", _SECONDS,
        "a request's body must arrive within this long of its headers, else the connection is closed",
        default=60.0, unit="s", field="http_body_timeout_s"),
    Key("option.http_max_connections", _int(1),
        "open client connections at most; at the limit a new connection closes the oldest idle or "
        "still-sending (headers or body) one first, so slow clients cannot lock a normal request out",
        default=1000, unit="connections"),
    Key("option.engine_step_timeout", _SECONDS,
        "watchdog: a model step running longer than this (a wedged kernel, a deadlock), or an engine thread "
        "that died, turns `/ping` to 503 with the reason, so SageMaker replaces the instance",
        default=300.0, unit="s", field="engine_step_timeout_s"),
    Key("option.max_payload_mb", _float(0.0, None, True, "a positive number of megabytes"),
        "request bodies above this are refused with 413 (from `Content-Length` before reading; a chunked "
        "body as soon as it passes); `/execution-parameters` advertises it", default=6.0, unit="MB (10^6 bytes)"),
    Key("option.enforce_eager", _bool,
        "run every step eagerly; `false` (the default) replays CUDA graphs of the decode step on CUDA, captured "
        "at start-up for each batch size up to the running limit (handler/model/cuda_graphs.py); no effect on CPU",
        default=False),
    Key("option.batch_invariant", _bool,
        "a seeded request gives the same tokens whatever shares its batch (each sequence's tokens run one "
        "per forward; prompts prefill at decode speed)", default=False),
    # OpenAI chat output parsing (LMI's / vLLM's names): handler/http/protocols/tool_parsers.py, reasoning.py.
    Key("option.tool_call_parser", _enum(["auto", "hermes", "llama3_json", "mistral", "pythonic", "granite", "qwen3_coder"],
                                         {"llama4_pythonic": "pythonic", "llama3": "llama3_json",
                                          # vLLM's other names for the same formats (one parser class each there)
                                          "llama4_json": "llama3_json", "qwen3_xml": "qwen3_coder"}),
        "the format `tool_choice: \"auto\"` parses calls from: `hermes` (Qwen2.5/Qwen3 `<tool_call>{json}"
        "</tool_call>`, or the bare JSON object small Qwen models write), `llama3_json` (Llama 3.1-3.3 "
        "`<|python_tag|>{\"name\", \"parameters\"}`), `mistral` (`[TOOL_CALLS][...]`), `pythonic` "
        "(`[f(a=1)]`, Llama 3.2/4), `granite` (`<|tool_call|>[...]`), `qwen3_coder` (`<tool_call><function=f>"
        "<parameter=a>...`); `auto`: the one the chat template "
        "documents (a 400 for `auto` requests when none or several match)", default="auto"),
    Key("option.enable_auto_tool_choice", _bool,
        "accept `tool_choice: \"auto\"` (the default when a request has tools); `false` refuses it with a 400 "
        "(`required` and a named function still work)", default=True),
    Key("option.chat_template", _non_empty,
        "the chat template chat requests render with, replacing the tokenizer's (vLLM's `--chat-template`): "
        "a Jinja file (absolute, or relative to the properties file's directory, the model directory or the "
        "working directory) or the template text itself; checked at start-up (a syntax error names its line); "
        "tool-format detection (`option.tool_call_parser=auto`) reads it too",
        values="file path or Jinja text", default_doc="(the tokenizer's)", field=None),
    Key("option.chat_template_content_format", _enum(["auto", "string", "openai"]),
        "how a message's `content` reaches the template: `string` the text (parts joined with newlines), "
        "`openai` a list of `{\"type\": \"text\", \"text\"}` parts (templates that loop over parts); "
        "`auto` `openai` when the template loops over `content`, else `string`", default="auto"),
    Key("option.reasoning_parser", _enum(["none", "deepseek_r1", "qwen3"]),
        "split `<think>...</think>` from chat answers into `message.reasoning_content` (and "
        "`delta.reasoning_content` when streamed): `deepseek_r1` (the thinking may start without `<think>`), "
        "`qwen3` (only a `<think>` at the start opens it); `none`: the thinking stays in `content`",
        default="none"),
    # Images in chat requests (handler/http/protocols/media.py; vision-language models: handler/model/vision.py).
    Key("option.allow_remote_images", _bool,
        "fetch `http(s)://` image URLs in chat requests; `false` (the default) takes images only inline "
        "(base64 `data:` URLs) and answers a remote URL with a 400 naming this key", default=False),
    Key("option.image_fetch_timeout", _SECONDS,
        "with `option.allow_remote_images`: a remote image must arrive within this long, else a 400",
        default=10.0, unit="s", field="image_fetch_timeout_s"),
    Key("option.max_image_mb", _float(0.0, None, True, "a positive number of megabytes"),
        "an image's encoded size at most (a 400 naming the part beyond it)", default=5.0, unit="MB (10^6 bytes)"),
    Key("option.max_image_pixels", _int(1),
        "an image's width x height at most, read from its header before it is decoded (a 400 naming the part)",
        default=16_777_216, unit="pixels"),
    Key("option.max_images_per_request", _int(0),
        "images in one request at most (a 400 naming the first part beyond it); `0` refuses images",
        default=8, unit="images"),
    Key("option.encoder_cache_mb", _float(0.0, None, False, "a number of megabytes >= 0"),
        "a vision-language model's encoder cache: image embeddings kept by the image's content hash, so a "
        "repeated image is encoded once (least recently used dropped past this size); `0` keeps none",
        default=256.0, unit="MB (10^6 bytes)"),
    # The Responses API's store (handler/http/protocols/store.py): previous_response_id, GET /v1/responses/<id>.
    Key("option.responses_store_max_items", _int(0),
        "responses kept for `previous_response_id` and `GET /v1/responses/<id>` (in this process's memory, least "
        "recently used evicted first); `0` keeps none (every `previous_response_id` is then a 404)",
        default=1000, unit="responses"),
    Key("option.responses_store_max_mb", _float(0.0, None, False, "a number of megabytes >= 0"),
        "the stored responses' size at most (their JSON, conversation included); past it the least recently used "
        "are evicted, and a response larger than this alone is not stored", default=64.0, unit="MB (10^6 bytes)"),
    Key("option.enable_reasoning", _bool,
        "LMI's switch for `option.reasoning_parser` (vLLM's older `--enable-reasoning`): `true` needs a parser, "
        "`false` keeps the thinking in `content` whatever the parser", default_doc="(the parser decides)",
        field=None),
    # Multi-LoRA (LMI's / vLLM's names): adapters from MODEL_DIR/adapters/<name>/ and the routes.
    Key("option.enable_lora", _bool, "serve LoRA adapters (README \"LoRA adapters\")", default=False),
    Key("option.max_loras", _int(1),
        "most distinct adapters running at once (device slots); requests for another adapter wait",
        default=4, unit="adapters"),
    Key("option.max_lora_rank", _int(1), "largest adapter rank accepted (slots are this wide)", default=16),
    Key("option.max_cpu_loras", _int(1),
        "adapters kept read in memory; beyond it the least recently used is dropped (and re-read from its "
        "directory when asked for)", values="≥ `option.max_loras`", default_doc="`option.max_loras`"),
    Key("option.enable_lora_management", _bool,
        "the LoRA management routes (`/adapters`, `/models/<m>/adapters`): `false` answers them 404; on "
        "SageMaker anyone allowed to invoke the endpoint can call them", default=True),
    # Speculative decoding (handler/engine/spec.py, handler/model/spec_verify.py): LMI's and vLLM's names.
    Key("option.speculative_config", _spec_json,
        "speculative decoding (vLLM's JSON): `{\"method\": \"ngram\"}` is prompt lookup, the sequence's last "
        "`prompt_lookup_max`..`prompt_lookup_min` tokens found earlier in its prompt or output propose the "
        "`num_speculative_tokens` that followed them (no second model); the target verifies them in one step "
        "(greedy: exact match; sampled: rejection sampling, the output distribution unchanged). Guided "
        "requests decode without it. `draft_model`: a second, small model (`model`, same tokenizer) proposes its greedy "
        "tokens from its own KV pool (as many tokens as the model's). "
        "Not with `option.tensor_parallel_degree` > 1 or `option.batch_invariant`",
        values="JSON object: `method` (`ngram`, `draft_model`), `num_speculative_tokens` (1-32), "
        "`prompt_lookup_min`/`prompt_lookup_max` (1-64; default 2/4), `model`, `disable_by_batch_size`",
        default_doc="(off)"),
    Key("option.speculative_draft_model", _non_empty,
        "LMI's draft model for speculative decoding: loaded at start-up like the model, in its dtype and "
        "device, unquantized; its tokenizer must be the model's (same vocabulary and special ids: refused at "
        "start-up otherwise)",
        values="local model dir or `.gguf` (not `s3://`)", default_doc="(none)"),
    Key("option.speculative_length", _int(1),
        "LMI's k: tokens proposed per step (`num_speculative_tokens`); with `option.speculative_config` or a "
        "draft model", unit="tokens", values="1-32", default_doc="5"),
    Key("option.speculative_disable_by_batch_size", _int(1),
        "no speculation in a step where this many sequences or more run (at high load the step is "
        "compute-bound and rejected tokens cost throughput)", unit="sequences", default_doc="(never off)"),
    Key("option.task", _enum(list(TASKS), TASK_ALIASES),
        "what the model serves: `text_embedding` (LMI's; also `feature-extraction`, `embed`) pooled vectors on "
        "/v1/embeddings, /invocations, /embed; `classify` a sequence classifier's scores (/predict, "
        "/invocations); `rerank` a cross-encoder's relevance (/rerank, /v1/rerank, /score); `generate` text. "
        "Unset: detected from the checkpoint (an encoder or sentence-transformers' modules.json: "
        "`text_embedding`; `*ForSequenceClassification`: `rerank` with one label, else `classify`; else "
        "`generate`). A decoder (Qwen, Llama) is an embedder only when asked (last-token pooling)",
        env=("HF_TASK",), default_doc="(detected)"),
    Key("option.normalize", _bool,
        "a pooling model's embeddings scaled to unit length (`true`) or left as pooled (`false`), as LMI's vLLM "
        "option", default_doc="the checkpoint's (sentence-transformers' Normalize module; without modules.json: "
        "`true`)"),
    Key("option.adapter_roots", _adapter_roots,
        "where the management routes may register adapters from, besides `<model dir>/adapters/`: a `src` "
        "outside them (`..`, other absolute paths, symlinks out) is refused before anything is read; an "
        "`s3://` `src` under one of them is downloaded into `LMI_MODEL_CACHE`", default=(),
        default_doc="(only `<model dir>/adapters/`)"),
)

SCHEMA: dict[str, Key] = {k.name: k for k in KEYS}
assert len(SCHEMA) == len(KEYS), "a key is declared twice"


@dataclass(frozen=True)
class EnvSetting:
    """A setting read from the environment only (not a serving.properties key)."""
    var: str
    default: object
    values: str
    doc: str


PORT = EnvSetting("SAGEMAKER_BIND_TO_PORT", 8080, "1-65535", "HTTP port")

# Real LMI keys that change nothing here: accepted (LMI files load as written) and reported once
# as "accepted, has no effect here".
IGNORED: tuple[str, ...] = (
    "minWorkers", "maxWorkers", "gpu.minWorkers", "gpu.maxWorkers", "cpu.minWorkers",
    "cpu.maxWorkers", "load_on_devices", "required_memory_mb", "reserved_memory_mb",
    "log_model_metric", "metrics_aggregation", "translatorFactory",
    "option.max_input_len", "option.max_output_len",
    "option.model_loading_timeout", "option.low_cpu_mem_usage",
    "option.device_map", "option.load_in_8bit", "option.load_in_4bit", "option.mpi_mode",
    "option.parallel_loading", "option.disable_flash_attn",
    "option.pipeline_parallel_degree", "option.rolling_batch_strategy",
    "option.lora_dtype", "option.fully_sharded_loras", "option.lora_extra_vocab_size",
)

# What handler.config.properties works from (also importable from handler.config).
TYPED_KEYS: dict[str, Callable[[str], object]] = {k.name: k.parse for k in KEYS}
IGNORED_KEYS: set[str] = set(IGNORED)
KNOWN_KEYS: set[str] = set(TYPED_KEYS) | IGNORED_KEYS
# Environment aliases; among several for one key the first one set wins.
ENV_ALIASES: list[tuple[str, str]] = [(var, k.name) for k in KEYS for var in k.env]
# Explicit variables other than OPTION_<KEY> / SERVING_<KEY> (OPTION_ENGINE, as LMI).
EXTRA_ENV: dict[str, str] = {var: k.name for k in KEYS for var in k.extra_env}
# key -> LMI's / vLLM's other names for it, read in this order when the key is absent.
ALIASES: dict[str, tuple[str, ...]] = {}
for _k in KEYS:
    if _k.alias_of:
        assert _k.alias_of in SCHEMA, _k.name
        ALIASES[_k.alias_of] = ALIASES.get(_k.alias_of, ()) + (_k.name,)
assert not IGNORED_KEYS & set(TYPED_KEYS), "a key is both typed and ignored"


def default_of(key: str):
    return SCHEMA[key].default
