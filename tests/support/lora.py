"""LoRA oracles: a random PEFT adapter saved in PEFT's format, and greedy decoding of the model PEFT merges."""
from __future__ import annotations

import torch


def build_adapter(model_dir: str, out_dir: str, seed: int, targets, r: int = 4, alpha: int = 16):
    """A PEFT LoRA adapter with random A and B saved to out_dir; returns the merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                 init_lora_weights=False))
    peft_model.save_pretrained(out_dir)
    return peft_model.merge_and_unload().eval()


def greedy(model, tok, prompt: str, n: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()
