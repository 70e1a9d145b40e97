"""GGUF model files -> a Hugging Face model directory (safetensors, config, tokenizer, chat template).

transformers reads GGUF through the `gguf` package and dequantizes the weights; the loaded model
refuses `save_pretrained` ("quantized with gguf"), so its state dict is copied into a model built
from its config (every key matches) and that one is saved.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("lmi.gguf")

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class GGUFError(ValueError):
    pass


def find_gguf(path: str) -> str | None:
    """`path` itself when it names a .gguf file; the one .gguf file in a directory; else None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if len(found) > 1:
            raise GGUFError(f"{path} holds {len(found)} .gguf files ({', '.join(found)}): name one")
        if found:
            return os.path.join(path, found[0])
    return None


def convert_gguf(gguf_path: str, out_dir: str, dtype: str = "fp32") -> str:
    """Write `gguf_path` as a Hugging Face directory in `dtype` (fp32|bf16|fp16) into out_dir;
    returns out_dir. Reuses out_dir when an earlier conversion of the same file finished there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in TORCH_DTYPES:
        raise GGUFError(f"dtype {dtype!r}: allowed {', '.join(TORCH_DTYPES)}")
    src_path = os.path.abspath(gguf_path)
    stamp = {"gguf": src_path, "size": os.path.getsize(src_path), "dtype": dtype}
    marker = os.path.join(out_dir, "converted_from.json")
    try:
        with open(marker) as f:
            if json.load(f) == stamp:
                return out_dir
    except (OSError, ValueError):
        pass
    folder, name = os.path.split(src_path)
    dt = getattr(torch, TORCH_DTYPES[dtype])
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dt)
    except ImportError as e:
        raise GGUFError(f"reading {name} needs the `gguf` package ({e})") from None
    except Exception as e:
        raise GGUFError(f"transformers cannot read {name}: {type(e).__name__}: {e}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dt)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if missing or unexpected:
        raise GGUFError(f"{name}: the dequantized weights do not match the {type(model).__name__} built from "
                        f"its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    with open(marker, "w") as f:
        json.dump(stamp, f)
    log.info("converted %s (%s, %d layers) into %s as %s", name, type(model).__name__,
             config.num_hidden_layers, out_dir, dtype)
    return out_dir
