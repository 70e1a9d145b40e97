"""GGUF model files -> a Hugging Face model directory (safetensors, config, tokenizer, chat template).

transformers reads GGUF through the `gguf` package and dequantizes the weights; the loaded model
refuses `save_pretrained` ("quantized with gguf"), so its state dict is copied into a model built
from its config (every key matches) and that one is saved.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

from handler.config.properties import gguf_files   # shared with the configuration checks

log = logging.getLogger("lmi.gguf")

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# A GGUF file names one EOS token; llama.cpp stops generating at any of these special tokens of the
# vocabulary too (its end-of-generation set), as the models' own generation_config.json lists them
# (Qwen2.5: <|im_end|> and <|endoftext|>).
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                     "<end_of_turn>")


class GGUFError(ValueError):
    pass


def find_gguf(path: str) -> str | None:
    """The one GGUF file `path` names or holds (handler.config.properties.gguf_files), else None."""
    found = gguf_files(path)
    if len(found) > 1:
        raise GGUFError(f"{path} holds {len(found)} .gguf files "
                        f"({', '.join(os.path.basename(f) for f in found)}): name one")
    return found[0] if found else None


def hf_dir_for(model_dir: str, dtype: str = "auto", device: str = "auto") -> str:
    """The Hugging Face directory to load for `model_dir`: itself, or, when it is a .gguf file (or a
    directory holding one and no config.json), that file converted once into the model cache
    (LMI_MODEL_CACHE/gguf/<name>-<fingerprint>-<dtype>) in the dtype it will be served in."""
    path = find_gguf(model_dir)
    if path is None:
        return model_dir
    from handler.config import hardware
    from handler.config.switches import switch

    dtype = hardware.pick_dtype(dtype, hardware.pick_device(device))
    name, fingerprint = conversion_key(path)
    cache = os.path.join(switch("LMI_MODEL_CACHE"), "gguf")
    out = os.path.join(cache, f"{name}-{fingerprint}-{dtype}")
    if device_of(device) == "cpu" and not os.path.isfile(os.path.join(out, "converted_from.json")):
        why = moe_refusal(path, {"fp32": 4}.get(dtype, 2), hardware.cpu_available_memory())
        if why:     # before transformers dequantizes it all (an OOM kill otherwise)
            raise GGUFError(why)
    log.info("model %s is a GGUF file: dequantizing it to %s in %s (once)", path, dtype, out)
    out = convert_gguf(path, out, dtype)
    drop_stale_conversions(cache, path, name, fingerprint)
    return out


def device_of(device: str) -> str:
    from handler.config import hardware
    return hardware.pick_device(device)


def moe_refusal(path: str, dtype_bytes: int, available: int) -> str | None:
    """Why the mixture-of-experts GGUF file at `path` cannot be dequantized into `available` bytes: its
    weights at `dtype_bytes` (every expert) and what a decode token reads (the top `expert_used_count`
    of `expert_count` experts of every *_exps tensor, the rest whole; the embedding rows not counted).
    None where it fits or the file has no experts."""
    try:
        from gguf import GGUFReader
        reader = GGUFReader(path)
    except Exception:   # no gguf package or not a GGUF file: the conversion says so in its own line
        return None

    def field(name):
        f = reader.fields.get(name)
        return int(f.parts[f.data[0]][0]) if f is not None and f.data else None

    from handler.model.quant_formats import gguf_arch
    arch = gguf_arch(reader)
    experts, used = field(f"{arch}.expert_count"), field(f"{arch}.expert_used_count")
    if not experts or not used:
        return None
    total = active = 0
    for t in reader.tensors:
        n = int(t.n_elements)
        total += n
        if t.name.endswith("_exps.weight"):
            active += n * used // experts
        elif t.name != "token_embd.weight":
            active += n
    gib = 1 << 30
    total, active = total * dtype_bytes, active * dtype_bytes
    if total <= available:
        return None
    return (f"{os.path.basename(path)}: the {experts}-expert model dequantized needs {total:,} bytes "
            f"({total / gib:.2f} GiB, every expert) and a decode step reads {active:,} bytes a token "
            f"({active / gib:.2f} GiB: top-{used} experts); {available:,} bytes ({available / gib:.2f} GiB) are "
            "available: use a machine with more memory or option.dtype=bf16")


def conversion_key(path: str) -> tuple[str, str]:
    """(name, fingerprint) of a GGUF file's conversions, <name>-<fingerprint>-<dtype>: the fingerprint
    changes with the file's path, size and mtime."""
    st = os.stat(path)
    fingerprint = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return os.path.basename(path).removesuffix(".gguf"), fingerprint


def drop_stale_conversions(cache: str, gguf_path: str, name: str, fingerprint: str) -> list[str]:
    """Remove the conversions in `cache` of the file at `gguf_path` made before it changed (another
    size or mtime: another fingerprint). Each is a whole dequantized model (0.5 GB for 135 M
    parameters, 6 GB for 1.5 B in fp32) that nothing can load again, so without this the cache grows
    by one model every time the file is replaced. Returns the removed directories."""
    import shutil

    src = os.path.abspath(gguf_path)
    prefix, current = f"{name}-", f"{name}-{fingerprint}-"
    removed = []
    try:
        entries = sorted(os.listdir(cache))
    except OSError:
        return removed
    for entry in entries:
        if not entry.startswith(prefix) or entry.startswith(current):
            continue
        d = os.path.join(cache, entry)
        try:
            with open(os.path.join(d, "converted_from.json")) as f:
                if json.load(f).get("gguf") != src:
                    continue
        except (OSError, ValueError, AttributeError):
            continue      # not a finished conversion of ours (or another file's): left alone
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        log.info("removed %d stale conversion(s) of %s from the model cache: %s", len(removed), src,
                 ", ".join(os.path.basename(d) for d in removed))
    return removed


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
    # built on the meta device and given the loaded tensors themselves (assign): the dequantized weights
    # are held once, not twice (a MoE file's conversion peaks at its dequantized size, which
    # handler/model/gguf.py moe_refusal checks before it starts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    if missing or unexpected:
        raise GGUFError(f"{name}: the dequantized weights do not match the {type(model).__name__} built from "
                        f"its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    eog = write_end_of_generation(out_dir, tok)
    with open(marker, "w") as f:
        json.dump(stamp, f)
    if len(eog) > 1:
        log.info("%s: generation stops at any of %s (the file names one EOS; llama.cpp's end-of-generation "
                 "tokens)", name, eog)
    log.info("converted %s (%s, %d layers) into %s as %s", name, type(model).__name__,
             config.num_hidden_layers, out_dir, dtype)
    return out_dir


def write_end_of_generation(out_dir: str, tok=None) -> list[int]:
    """generation_config.json's eos_token_id in `out_dir` -> the file's EOS first, then every special
    token of END_OF_GENERATION the vocabulary has; returns the list written (or found)."""
    path = os.path.join(out_dir, "generation_config.json")
    if tok is None:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(out_dir)
    try:
        with open(path) as f:
            gen = json.load(f)
    except (OSError, ValueError):
        gen = {}
    first = gen.get("eos_token_id", tok.eos_token_id)
    ids = [first] if isinstance(first, int) else list(first or [])
    special = {t.content: i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special}
    ids += [special[t] for t in END_OF_GENERATION if t in special and special[t] not in ids]
    if ids and ids != ([first] if isinstance(first, int) else first):
        gen["eos_token_id"] = ids
        with open(path, "w") as f:
            json.dump(gen, f, indent=2)
    return ids
