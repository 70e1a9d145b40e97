"""The sizing rules, once, for the runner (handler.model.runner), `config --explain`, `serve`, the
HTTP layer and `tune`: model geometry from a Hugging Face config, the dtype and device an `auto`
setting resolves to, KV bytes per token, the default KV pool, and how many sequences a strategy
runs at once.

Pure arithmetic on plain values: no torch (the HTTP layer imports this and must stay free of it).
What the machine has (a visible GPU, bf16 support, free memory) is asked by
handler.config.hardware and passed in.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
HF_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# On a CPU the default KV pool takes this share of the memory left after the weights, less
# CPU_HEADROOM (activations, the tokenizer, the HTTP side): the rest of the process grows under
# load, and a container over its cgroup limit is OOM-killed rather than refused.
CPU_KV_SHARE = 0.7
CPU_HEADROOM = 512 << 20
GPU_HEADROOM = 1 << 30           # on a GPU the default KV pool leaves this for activations
DEFAULT_MAX_POSITIONS = 2048     # a config naming no maximum length


# ------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int
    stored_dtype: str | None     # config.json's torch_dtype / dtype, as fp32/fp16/bf16


def _getter(config) -> Callable[[str], object]:
    """name -> value (None when absent) for a config.json dict or a transformers config object."""
    if isinstance(config, dict):
        return config.get
    return lambda name: getattr(config, name, None)


def _text_config(config):
    """The decoder's config: multimodal configs nest it (text_config)."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _first(get, *names):
    for n in names:
        v = get(n)
        if v is not None:
            return v
    return None


def _heads(get) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of any decoder family's config: num_key_value_heads where
    given; Falcon's num_kv_heads (new decoder architecture) or one shared head (multi_query);
    else one KV head per attention head."""
    heads = _first(get, "num_attention_heads", "n_head")
    kv = get("num_key_value_heads")
    if kv is None and heads is not None:
        if get("multi_query") and not get("new_decoder_architecture"):
            kv = 1
        else:
            kv = get("num_kv_heads") or heads
    return heads, kv


def geometry(config, where: str = "config") -> Geometry:
    """Layers, KV heads, head dim and max positions from a Hugging Face config (a transformers
    config object or config.json as a dict) of any decoder family. ValueError naming `where`
    when the fields are missing."""
    get = _getter(_text_config(config))
    top = _getter(config)
    layers = _first(get, "num_hidden_layers", "n_layer", "num_layers")
    heads, kv = _heads(get)
    hidden = _first(get, "hidden_size", "n_embd", "d_model")
    head_dim = get("head_dim")
    if not (layers and heads and (hidden or head_dim)):
        raise ValueError(f"{where}: no num_hidden_layers/num_attention_heads/hidden_size "
                         "(or their GPT-2 names); is this a causal LM config?")
    max_pos = _first(get, "max_position_embeddings", "n_positions") or DEFAULT_MAX_POSITIONS
    # (transformers' config objects warn on torch_dtype: they carry it as dtype)
    stored = (top("torch_dtype") or top("dtype") or get("torch_dtype")) if isinstance(config, dict) else top("dtype")
    stored = str(stored).removeprefix("torch.") if stored is not None else None
    return Geometry(str(top("model_type") or "?"), int(layers), int(kv), int(head_dim or hidden // heads),
                    int(max_pos), HF_DTYPES.get(stored))


def read_config(model_dir: str) -> dict:
    """config.json as a dict; ValueError with one line when it is unreadable."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None


def read_geometry(model_dir: str) -> Geometry:
    """geometry() of MODEL_DIR/config.json, read as JSON (no transformers)."""
    return geometry(read_config(model_dir), os.path.join(model_dir, "config.json"))


def read_heads(model_dir: str) -> tuple[str, int, int] | None:
    """(architecture, attention heads, KV heads) from config.json; None if the file or the
    fields are missing (the checks that need them are then skipped)."""
    try:
        c = read_config(model_dir)
    except ValueError:
        return None
    heads, kv = _heads(_getter(c.get("text_config") or c))
    if not isinstance(heads, int):
        return None
    arch = (c.get("architectures") or [c.get("model_type", "?")])[0]
    return arch, heads, kv


# ------------------------------------------------------------------ device and dtype
def resolve_device(device: str, cuda_visible: bool) -> str:
    """option.device -> "cpu" | "cuda": auto is cuda when a CUDA device is visible."""
    if device != "auto":
        return device
    return "cuda" if cuda_visible else "cpu"


def resolve_dtype(dtype: str, device: str, bf16_supported: bool = True) -> str:
    """option.dtype -> "fp32" | "fp16" | "bf16": auto is fp32 on a CPU, bf16 on a GPU (fp16 on
    one without bf16)."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bf16" if bf16_supported else "fp16"
    return "fp32"


# ------------------------------------------------------------------ the KV pool
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")   # option.kv_cache_dtype
KV_SCALE_BYTES = 4      # int8 KV: one fp32 scale per (token, head) row of K and of V


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every layer: in the model's dtype (`auto`), or int8 (`int8`: one
    byte an element and a fp32 scale per head)."""
    if kv_cache_dtype == "int8":
        return 2 * layers * kv_heads * (head_dim + KV_SCALE_BYTES)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_bytes_per_token(g: Geometry, dtype: str, tp: int = 1, kv_cache_dtype: str = "auto") -> int:
    """Per rank: with tensor parallelism each rank holds kv_heads / tp heads."""
    return bytes_per_token(g.layers, g.kv_heads // tp, g.head_dim, DTYPE_BYTES[dtype], kv_cache_dtype)


def kv_cache_dtype_refusal(kv_cache_dtype: str, device: str) -> str | None:
    """Why option.kv_cache_dtype cannot run on `device` ("cpu" / "cuda"), as the rest of a line
    that starts `option.kv_cache_dtype=<value>`; None where it runs."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}"
    if device == "cpu" and kv_cache_dtype.startswith("fp8"):
        return "needs a CUDA GPU (fp8 KV is a GPU format); on a CPU use int8 or auto"
    if device != "cpu":
        return ("is not built for CUDA (the Triton kernels read fp32/fp16/bf16 pools only); "
                "use auto on a GPU, int8 on a CPU")
    return None


def cpu_kv_budget(available: int, weights: int = 0) -> int:
    """On a CPU: CPU_KV_SHARE of the `available` memory (the cgroup's room, else MemAvailable:
    handler.config.hardware.cpu_available_memory) left after `weights` bytes still to be
    loaded (0 once they are), less CPU_HEADROOM; never negative."""
    return max(0, int((available - weights) * CPU_KV_SHARE) - CPU_HEADROOM)


def kv_budget_bytes(device: str, utilization: float = 0.9, total: int = 0, used: int = 0,
                    available: int = 0, weights: int = 0) -> int:
    """The bytes the default KV pool may take: on a CPU cpu_kv_budget(available, weights); on a
    GPU `utilization` of its `total` memory, less what is `used` already (the weights, other
    processes) and 1 GiB for activations."""
    if device == "cuda":
        return int(total * utilization) - used - GPU_HEADROOM
    return cpu_kv_budget(available, weights)


def default_kv_tokens(per_token: int, wanted: int, block_size: int, device: str,
                      utilization: float = 0.9, total: int = 0, used: int = 0,
                      available: int = 0, weights: int = 0) -> int:
    """The pool when option.kv_cache_tokens is not set: room for `wanted` tokens (every running
    sequence at full length) within kv_budget_bytes(), and at least one block."""
    budget = kv_budget_bytes(device, utilization, total, used, available, weights)
    return max(block_size, min(wanted, budget // per_token))


# ------------------------------------------------------------------ batching
def running_width(cfg) -> int:
    """Sequences the strategy runs at once: none 1, dynamic batch_size, rolling/paged
    max_rolling_batch_size."""
    return {"none": 1, "dynamic": cfg.batch_size}.get(cfg.strategy, cfg.max_rolling_batch_size)


def expected_ideal_speedup(values: list[int], batch_size: int, weights: list[float] | None = None) -> float:
    """E[max of batch_size i.i.d. draws] / E[draw], exactly, for a discrete length mix
    (uniform unless weights are given): E[max] = sum_k v_k (F(v_k)^B - F(v_k-1)^B).
    What dynamic batching (a batch runs until its longest member ends) costs in decode steps
    over iteration-level batching."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    w = [Fraction(1)] * len(values) if weights is None else [Fraction(x) for x in weights]
    total = sum(w)
    pairs = sorted(zip(values, (x / total for x in w)))
    mean = sum(v * p for v, p in pairs)
    e_max, cdf_prev = Fraction(0), Fraction(0)
    for v, p in pairs:
        cdf = cdf_prev + p
        e_max += v * (cdf ** batch_size - cdf_prev ** batch_size)
        cdf_prev = cdf
    return float(e_max / mean)


# ------------------------------------------------------------------ mixture of experts
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def moe_weights(config, dtype_bytes: int) -> dict | None:
    """For a mixture-of-experts config (MOE_TYPES; config.json as a dict or a transformers config):
    the weights' bytes in memory (`total_bytes`, all experts: what must fit) and what one token's
    decode step reads (`active_bytes_per_token`: attention, the routers, the top-k experts and the
    shared expert of every layer, the dense layers' MLPs, the output head; not the embedding rows),
    at `dtype_bytes` a weight. None for a dense model."""
    get = _getter(_text_config(config))
    mt = get("model_type")
    if mt not in MOE_TYPES:
        return None
    h, n, vocab = int(get("hidden_size")), int(get("num_hidden_layers")), int(get("vocab_size"))
    heads, kv = _heads(get)
    d = int(get("head_dim") or h // heads)
    experts = int(_first(get, "num_local_experts", "num_experts") or 0)
    k = int(get("num_experts_per_tok") or 0)
    width = int(get("intermediate_size") if mt in ("mixtral", "olmoe") else get("moe_intermediate_size"))
    dense = int(get("intermediate_size"))
    shared = int(get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
    step = int(get("decoder_sparse_step") or 1) if mt in ("qwen3_moe", "qwen2_moe") else 1
    only = set(get("mlp_only_layers") or ()) if mt in ("qwen3_moe", "qwen2_moe") else set()
    attn = h * heads * d * 2 + 2 * h * kv * d
    total = active = 0
    for i in range(n):
        if i not in only and experts > 0 and (i + 1) % step == 0:
            common = h * experts + (3 * h * shared + h if shared else 0)
            total += attn + experts * 3 * h * width + common
            active += attn + k * 3 * h * width + common
        else:
            total += attn + 3 * h * dense
            active += attn + 3 * h * dense
    head = vocab * h
    total += head + (0 if get("tie_word_embeddings") else head)
    active += head
    return {"experts": experts, "top_k": k, "expert_width": width, "total_params": total, "active_params": active,
            "total_bytes": total * dtype_bytes, "active_bytes_per_token": active * dtype_bytes}


def moe_refusal(config, dtype_bytes: int, available: int) -> str | None:
    """Why a mixture-of-experts model cannot be loaded into `available` bytes (None: it fits, or dense)."""
    w = moe_weights(config, dtype_bytes)
    if w is None or w["total_bytes"] <= available:
        return None
    gib = 1 << 30
    return (f"the {w['experts']}-expert model's weights need {w['total_bytes']:,} bytes ({w['total_bytes'] / gib:.2f} "
            f"GiB, every expert) and a decode step reads {w['active_bytes_per_token']:,} bytes a token "
            f"({w['active_bytes_per_token'] / gib:.2f} GiB: top-{w['top_k']} experts); {available:,} bytes "
            f"({available / gib:.2f} GiB) are available: use a machine with more memory or a smaller dtype")
