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


def model_on(model_dir: str, device: str, dtype: torch.dtype):
    """(tokenizer, model) in `dtype` on `device`, SDPA attention: the oracle off the CPU / in bf16."""
    return _load_on(model_dir, device, str(dtype).removeprefix("torch."))


@functools.lru_cache(maxsize=8)
def _load_on(model_dir: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    return tok, model


@torch.inference_mode()
def greedy_ids(model, tok, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """`model.generate` greedy for one prompt alone, on the model's device and dtype."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


@torch.inference_mode()
def near_tie_divergence(model, prompt_ids: list[int], want: list[int], got: list[int],
                        noise: float) -> str | None:
    """None when `got` equals `want` (the oracle's greedy tokens) or first parts from it at a
    near-tie: there the oracle's top two logits lie within `noise` x max(1, |logit|max) of each
    other and `got` took the other of the two (rounding in another summation order may flip
    such a choice; after it the streams are different texts and are not compared). Else why not."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a == b:
            continue
        ids = torch.tensor([prompt_ids + want[:i]], device=model.device)
        logits = model(ids).logits[0, -1].float()
        top = logits.topk(2)
        gap = (top.values[0] - top.values[1]).item()
        bound = noise * max(1.0, logits.abs().max().item())
        if b in top.indices.tolist() and gap <= bound:
            return None
        return (f"token {i}: got {b}, generate gave {a}; the top two logits {top.indices.tolist()} are "
                f"{gap:.4g} apart (a near-tie is <= {bound:.4g})")
    if len(want) != len(got):
        return f"lengths differ: got {len(got)} tokens, generate gave {len(want)}"
    return None
