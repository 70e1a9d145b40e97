"""Tiny demo models built locally (no hub): a small causal LM + a byte-level BPE tokenizer.

The tokenizer is trained on the Python standard library's source, which every machine has,
so the same command gives a working model in a container, in CI and on a laptop.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig

FAMILIES = ("llama", "qwen2", "gpt2", "qwen3")
VOCAB_SIZE = 8192
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
# A small ChatML-like template so that chat requests work on the demo model (`make serve`).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _corpus(max_bytes: int = 3_000_000):
    # Sorted so that the tokenizer is the same on every machine with the same Python.
    stdlib = sysconfig.get_paths()["stdlib"]
    total = 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(family: str, tokenizer, vocab_size: int = VOCAB_SIZE):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    if family == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=1024, initializer_range=0.1, **ids)
    if family == "qwen2":
        return Qwen2Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=1024, initializer_range=0.1,
                           tie_word_embeddings=False, **ids)
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=256, n_layer=4, n_head=8, n_positions=1024,
                          initializer_range=0.1, **ids)
    if family == "qwen3":   # per-head q/k RMSNorm, tied embeddings
        return Qwen3Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=32, max_position_embeddings=1024, initializer_range=0.1,
                           tie_word_embeddings=True, **ids)
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def build_demo_model(out_dir: str, family: str = "llama", seed: int = 0) -> str:
    """Write a tiny random-weight `family` model + tokenizer into out_dir; returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = model_config(family, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "DEMO_MODEL.json"), "w") as f:
        json.dump({"family": family, "seed": seed, "built_by": "handler.demo_model"}, f)
    return out_dir


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m handler build-demo-model",
                                description="Build a tiny random-weight causal LM + tokenizer locally.")
    p.add_argument("out_dir")
    p.add_argument("--family", choices=FAMILIES, default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if out_dir has a model")
    a = p.parse_args(argv)
    if not a.force and os.path.exists(os.path.join(a.out_dir, "config.json")):
        print(f"{a.out_dir} already holds a model (use --force to rebuild)")
        return 0
    build_demo_model(a.out_dir, a.family, a.seed)
    print(f"built a tiny {a.family} model in {a.out_dir}")
    return 0
