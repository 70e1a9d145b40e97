"""The correctness oracle: what `model.generate` gives for one request alone (greedy, fp32, CPU)."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _load(model_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(model_dir: str, prompt: str, max_new_tokens: int, repetition_penalty: float = 1.0,
              ignore_eos: bool = False) -> list[int]:
    """Token ids `model.generate` produces for `prompt` alone (EOS included when it stops there)."""
    tok, model = _load(model_dir)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    kw = {}
    if ignore_eos:
        kw["eos_token_id"] = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, repetition_penalty=repetition_penalty,
                             pad_token_id=tok.pad_token_id, **kw)
    return out[0, ids.shape[1]:].tolist()


def tokenizer(model_dir: str):
    return _load(model_dir)[0]
