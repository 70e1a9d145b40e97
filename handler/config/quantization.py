"""option.quantize against the checkpoint: which quantization a model is served with (torch-free).

Pre-quantized checkpoints say so in config.json, as vLLM reads them: `quantization_config` with
`quant_method` awq | gptq, `bits`, `group_size` (GPTQ also `desc_act`, `sym`, `checkpoint_format`;
AWQ `zero_point`, `version`). Such a checkpoint is served quantized without option.quantize; an
option.quantize that names another method is one error line, as is a field we cannot serve.
A `.gguf` model file serves its quantized tensors (`gguf`) unless option.quantize says otherwise.

    resolve(quantize, model_dir, on_gpu) -> the method the runner gets (None: the model's dtype)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

CHECKPOINT_METHODS = ("awq", "gptq")        # read from the checkpoint (handler/model/quant_int4.py)
ALL = ("int8", "int8_weight_only", "awq", "gptq", "gguf", "fp8", "none")


class QuantConfigError(ValueError):
    """One line naming the property or config.json field, its value and what is allowed."""


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization_config, checked: what our int4 loader needs."""
    method: str             # awq | gptq
    bits: int
    group_size: int         # along the input dimension; -1 (GPTQ: one group per row) is K
    sym: bool               # GPTQ: symmetric (zero 8); AWQ: not zero_point
    zeros_plus_one: bool    # GPTQ v1 ("gptq" format): qzeros hold zero - 1


def read_quantization_config(model_dir: str) -> dict | None:
    """config.json's `quantization_config` (a dict), or None (no config.json, or not quantized)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc if isinstance(qc, dict) else None


def checkpoint_quant(qc: dict | None) -> CheckpointQuant | None:
    """The checked quantization_config, None when absent, QuantConfigError for one we cannot serve."""
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise QuantConfigError(f"config.json quantization_config.quant_method={method!r} is not supported; "
                               f"allowed: {', '.join(CHECKPOINT_METHODS)}")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantConfigError(f"config.json quantization_config.bits={bits!r} ({method}) is not supported; "
                               "allowed: 4")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or group >= 1):
        raise QuantConfigError(f"config.json quantization_config.group_size={group!r} is not supported; "
                               "allowed: a positive integer or -1")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantConfigError(f"config.json quantization_config.version={version!r} (awq) is not supported; "
                                   "allowed: gemm")
        return CheckpointQuant("awq", 4, group, sym=not qc.get("zero_point", True), zeros_plus_one=False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"config.json quantization_config.checkpoint_format={fmt!r} (gptq) is not "
                               "supported; allowed: gptq, gptq_v2")
    if qc.get("desc_act", False) and group != -1:
        raise QuantConfigError("config.json quantization_config.desc_act=true (gptq act-order with groups) is "
                               "not supported; allowed: false (re-quantize without act-order)")
    return CheckpointQuant("gptq", 4, group, sym=bool(qc.get("sym", True)), zeros_plus_one=fmt == "gptq")


def gguf_source(model_dir: str | None) -> str | None:
    """The .gguf file a directory was converted from (handler/model/gguf.py's converted_from.json):
    the path it records, else a file of that name and size in `../downloads/` (where
    handler/tools/real_model.py keeps it: a model cache moved or shared between checkouts); None
    when neither exists."""
    try:
        with open(os.path.join(model_dir or "", "converted_from.json")) as f:
            stamp = json.load(f)
        src = stamp.get("gguf")
    except (OSError, ValueError, AttributeError):
        return None
    if not src:
        return None
    beside = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "downloads", os.path.basename(src))
    for path in (src, beside):
        if os.path.isfile(path) and os.path.getsize(path) == stamp.get("size", os.path.getsize(path)):
            return path
    return None


def converted_from_gguf(model_dir: str | None) -> bool:
    """A directory handler/model/gguf.py converted from a .gguf file that can still be found."""
    return gguf_source(model_dir) is not None


def resolve(quantize: str | None, model_dir: str | None, on_gpu: bool, is_gguf: bool = False) -> str | None:
    """The method served: option.quantize checked against the checkpoint (see the module doc)."""
    if quantize == "fp8":
        if not on_gpu:
            raise QuantConfigError("option.quantize=fp8 needs a GPU with fp8 arithmetic (CUDA compute capability "
                                   "8.9+); this server runs on CPU: use awq, gptq, gguf, int8 or int8_weight_only")
        raise QuantConfigError("option.quantize=fp8 is not implemented yet; allowed: int8, int8_weight_only, awq, gptq, gguf")
    found = None
    if model_dir and os.path.isdir(model_dir):
        found = checkpoint_quant(read_quantization_config(model_dir))
    if found is not None:
        if quantize in (None, found.method, "none"):
            return quantize or found.method
        raise QuantConfigError(f"option.quantize={quantize} but the checkpoint is {found.method.upper()}-quantized "
                               f"(config.json quantization_config.quant_method={found.method}); set "
                               f"option.quantize={found.method}, none, or leave it unset")
    if quantize in CHECKPOINT_METHODS:
        raise QuantConfigError(f"option.quantize={quantize} needs a checkpoint quantized by {quantize.upper()} "
                               f"(config.json quantization_config.quant_method={quantize}); {model_dir} has none "
                               f"(make one: python -m handler quantize-checkpoint --method {quantize} SRC DST)")
    if quantize == "gguf" and not (is_gguf or converted_from_gguf(model_dir)):
        raise QuantConfigError("option.quantize=gguf needs a .gguf model (option.model_id naming a .gguf file, "
                               "or a directory converted from one)")
    if quantize is None and is_gguf:
        return "gguf"
    return quantize
