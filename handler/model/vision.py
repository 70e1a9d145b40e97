"""Vision-language models: the image side of a step, before the language model's prefill.

  HTTP thread   Processor.process(prompt, images): the family's processor from transformers (its image
                tokens, its pixel tensors) -> token ids + one engine ImageRef per image (the run of
                placeholder tokens its embeddings replace, its content hash, its pixels as `data`)
  engine thread VisionStage.inject(items): for the images this step's items feed, the embeddings from
                the encoder cache (by content hash) or from one encoder run of the missing ones (the
                vision tower + projector: transformers' modules read from the checkpoint), sliced to
                the rows each item feeds (a chunk may cut an image) -> (rows, features) that the
                language model writes over those rows' token embeddings (llama.LlamaFamilyForCausalLM.step)

The language model is ours (handler/model/llama.py; its checkpoint names mapped by the family). The
scheduler keys prefix-cache blocks by the images' hashes (engine Sequence.cache_keys), so nothing here
needs to know about KV blocks.

Families (config.json's model_type):
  llava        LLaVA-1.5 style: CLIP vision tower, 2-layer MLP projector, a Llama-family language model;
               vision_feature_layer / _select_strategy from the config; one run of placeholders per image
  idefics3     Idefics3 / SmolVLM (v1): SigLIP-style tower + pixel-shuffle connector, a Llama language model;
               an image is split into tiles plus the whole image, each tile a run of image_seq_len tokens
               between text markers (one ImageRef with several `runs`)
  qwen2_vl,    dynamic resolution: an image is (h/14) x (w/14) patches merged 2x2, so its token count
  qwen2_5_vl   follows its size (image_grid_thw); the language model (qwen2) places tokens by M-RoPE: an
               image's tokens at (t, row, column) from where it starts, later tokens shifted by what
               the images before them took (positions(), from every ImageRef of the prompt)
  gemma3       Gemma 3: SigLIP tower, Gemma3MultiModalProjector (patches average-pooled to
               mm_tokens_per_image, RMS-normed, projected), a gemma3_text language model; each image a run
               of mm_tokens_per_image tokens between <start_of_image> / <end_of_image> (the prompt's
               placeholder is <start_of_image>); with pan and scan (the image processor's
               do_pan_and_scan) a wide or tall image is also its crops, each a run after the whole image's
               (one ImageRef, several runs). Its language model attends both ways within each run at
               prefill (transformers' token_type_ids blocks): the family is `bidirectional`, so its
               ImageRefs are `whole` (the scheduler never ends a prefill chunk inside a run) and the step's
               attention lets each image row see its whole run (kernels/torch_paged.py `blocks`:
               full layers causal OR same run, sliding layers that AND the window)
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from handler.engine.request import RequestError
from handler.engine.types import IMAGE_MARKER, ImageRef

log = logging.getLogger("lmi.vision")


def _llava_text_name(key: str) -> tuple[str, str]:
    """A LLaVA checkpoint name -> ("text", our language model's name) or ("vision", the image side's):
    transformers 4's layout (language_model.model.*, language_model.lm_head.*, vision_tower.*,
    multi_modal_projector.*) and transformers 5's (model.language_model.*, lm_head.*, model.vision_tower.*)."""
    for theirs, ours in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                         ("model.language_model.", "model."), ("lm_head.", "lm_head.")):
        if key.startswith(theirs):
            return "text", ours + key[len(theirs):]
    return "vision", key.removeprefix("model.")


def _shell(cls, config, **parts) -> nn.Module:
    """A transformers VLM model class without its language model (its __init__ would build one): the
    config and the image-side `parts` only, enough for its get_image_features."""
    m = cls.__new__(cls)
    nn.Module.__init__(m)
    m.config = config
    for name, part in parts.items():
        setattr(m, name, part)
    return m


def _llava_tower(config) -> nn.Module:
    """LlavaModel without its language model: get_image_features reads only the tower, the projector
    and the config."""
    from transformers import AutoModel
    from transformers.models.llava.modeling_llava import LlavaModel, LlavaMultiModalProjector
    return _shell(LlavaModel, config, vision_tower=AutoModel.from_config(config.vision_config),
                  multi_modal_projector=LlavaMultiModalProjector(config))


def _llava_encode(tower, datas: list[dict]) -> tuple[list[torch.Tensor], int]:
    """One tower run per pixel shape: (each image's embeddings, runs)."""
    cfg, out, runs = tower.config, [None] * len(datas), 0
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(datas):
        groups.setdefault(tuple(d["pixel_values"].shape[1:]), []).append(i)
    for members in groups.values():
        pixels = torch.cat([datas[i]["pixel_values"] for i in members])
        feats = tower.get_image_features(pixel_values=pixels, vision_feature_layer=cfg.vision_feature_layer,
                                         vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                                         return_dict=True).pooler_output
        runs += 1
        for i, f in zip(members, feats):
            out[i] = f
    return out, runs


def _llava_lengths(proc, out, ids: list[int], where: list[int], n: int) -> list[list[int]]:
    """LLaVA-1.5: every image one run of the same number of tokens."""
    return [[len(where) // n]] * n if n and len(where) % n == 0 else []


def _llava_data(out, i: int, runs: list[list[int]]) -> dict:
    return {"pixel_values": out["pixel_values"][i:i + 1]}


# ---- Qwen2-VL / Qwen2.5-VL
def _qwen_names(key: str) -> tuple[str, str]:
    """transformers 4's layout (model.layers.*, lm_head.*, visual.*) and 5's (model.language_model.*,
    model.visual.*)."""
    if key.startswith("model.language_model."):
        return "text", "model." + key[len("model.language_model."):]
    if key.startswith(("visual.", "model.visual.")):
        return "vision", key.removeprefix("model.")
    return "text", key


def _qwen_tower(model_class: str, vision_class: str):
    def build(config) -> nn.Module:
        import transformers
        from transformers.models import qwen2_5_vl, qwen2_vl
        mod = qwen2_vl.modeling_qwen2_vl if model_class.startswith("Qwen2VL") else qwen2_5_vl.modeling_qwen2_5_vl
        cls = getattr(transformers, model_class)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.config = config
        m.visual = getattr(mod, vision_class)._from_config(config.vision_config)
        return m
    return build


def _qwen_encode(tower, datas: list[dict]) -> tuple[list[torch.Tensor], int]:
    """Every image in one tower run (its patches concatenated, image_grid_thw says where each is)."""
    pixels = torch.cat([d["pixel_values"] for d in datas])
    grid = torch.cat([d["image_grid_thw"] for d in datas])
    feats = tower.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True).pooler_output
    return list(feats), 1


def _qwen_lengths(proc, out, ids: list[int], where: list[int], n: int) -> list[list[int]]:
    merge = out["merge_size"]
    return [[int(g.prod()) // merge ** 2] for g in out["image_grid_thw"]]


def _qwen_data(out, i: int, runs: list[list[int]]) -> dict:
    grid = out["image_grid_thw"]
    rows = [int(g.prod()) for g in grid]
    a = sum(rows[:i])
    t, h, w = (int(x) for x in grid[i])
    m = out["merge_size"]
    return {"pixel_values": out["pixel_values"][a:a + rows[i]], "image_grid_thw": grid[i:i + 1],
            "llm_grid": (t, h // m, w // m)}


# ---- Idefics3 (SmolVLM)
def _idefics_names(key: str) -> tuple[str, str]:
    """model.text_model.* / lm_head.* (the language model), model.vision_model.* / model.connector.*."""
    if key.startswith("model.text_model."):
        return "text", "model." + key[len("model.text_model."):]
    if key.startswith("lm_head."):
        return "text", key
    return "vision", key.removeprefix("model.")


def _idefics_tower(config) -> nn.Module:
    from transformers.models.idefics3.modeling_idefics3 import (Idefics3Connector, Idefics3Model,
                                                                Idefics3VisionTransformer)
    return _shell(Idefics3Model, config, vision_model=Idefics3VisionTransformer._from_config(config.vision_config),
                  connector=Idefics3Connector(config))


def _idefics_lengths(proc, out, ids: list[int], where: list[int], n: int) -> list[list[int]]:
    """An image is its tiles (rows x columns of the split image, then the whole image downscaled), each
    a run of image_seq_len tokens between text markers; the run after <global-img> is its last."""
    glob = proc.hf.global_image_token_id
    runs: list[list[int]] = []
    for p in where:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    images, cur = [], []
    for start, length in runs:
        cur.append(length)
        if start > 0 and ids[start - 1] == glob:
            images.append(cur)
            cur = []
    return images if not cur else []


def _idefics_data(out, i: int, runs: list[list[int]]) -> dict:
    a = sum(len(r) for r in runs[:i])
    b = a + len(runs[i])
    return {"pixel_values": out["pixel_values"][:, a:b], "pixel_attention_mask": out["pixel_attention_mask"][:, a:b]}


def _idefics_encode(tower, datas: list[dict]) -> tuple[list[torch.Tensor], int]:
    """Every image's tiles in one run; each image's rows are its tiles' in order."""
    pixels = torch.cat([d["pixel_values"] for d in datas], dim=1)
    mask = torch.cat([d["pixel_attention_mask"] for d in datas], dim=1)
    feats = tower.get_image_features(pixel_values=pixels, pixel_attention_mask=mask, return_dict=True).pooler_output[0]
    per_tile = feats.shape[0] // pixels.shape[1]
    return list(feats.split([d["pixel_values"].shape[1] * per_tile for d in datas])), 1


# ---- Gemma 3
def _gemma3_tower(config) -> nn.Module:
    """Gemma3Model without its language model: get_image_features reads the tower and the projector."""
    from transformers import AutoModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Model, Gemma3MultiModalProjector
    return _shell(Gemma3Model, config, vision_tower=AutoModel.from_config(config.vision_config),
                  multi_modal_projector=Gemma3MultiModalProjector(config))


def _gemma3_encode(tower, datas: list[dict]) -> tuple[list[torch.Tensor], int]:
    """Every image and crop in one tower run (one size: the processor resizes them all); an image's rows
    are its whole image's then its crops', as the prompt's runs."""
    pixels = torch.cat([d["pixel_values"] for d in datas])
    feats = tower.get_image_features(pixel_values=pixels, return_dict=True).pooler_output  # [crops, tokens, hidden]
    out, a = [], 0
    for d in datas:
        b = a + d["pixel_values"].shape[0]
        out.append(feats[a:b].reshape(-1, feats.shape[-1]))
        a = b
    return out, 1


def _gemma3_lengths(proc, out, ids: list[int], where: list[int], n: int) -> list[list[int]]:
    """Image i is 1 + num_crops[i] runs (the whole image, then its pan-and-scan crops), in prompt order."""
    runs: list[int] = []
    for k, p in enumerate(where):
        if k and where[k - 1] == p - 1:
            runs[-1] += 1
        else:
            runs.append(1)
    crops = [int(c) for c in out["num_crops"]]
    if len(crops) != n or sum(crops) + n != len(runs):
        return []
    images, k = [], 0
    for c in crops:
        images.append(runs[k:k + 1 + c])
        k += 1 + c
    return images


def _gemma3_data(out, i: int, runs: list[list[int]]) -> dict:
    a = sum(len(r) for r in runs[:i])
    return {"pixel_values": out["pixel_values"][a:a + len(runs[i])]}


def _gemma3_processor(model_dir: str, trust_remote_code: bool):
    """Gemma3Processor keeping each image's num_crops in its output (transformers drops it: an input the
    model does not take), which says how many runs of image tokens each image has."""
    from transformers import Gemma3Processor

    class Gemma3KeepCrops(Gemma3Processor):
        @property
        def unused_input_names(self) -> list[str]:
            return []

    return Gemma3KeepCrops.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


_PAN_AND_SCAN = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                 "pan_and_scan_min_ratio_to_activate")


def _gemma3_call(hf) -> dict:
    """Pan and scan as the image processor's config says: Gemma3Processor's own defaults (off; crops of at
    least 256 pixels, at most 4) would win over it at each call."""
    ip = hf.image_processor
    return {k: getattr(ip, k) for k in _PAN_AND_SCAN if getattr(ip, k, None) is not None}


def _image_only(processor_class: str):
    """The family's processor without its video half (transformers 5 builds video processors with
    torchvision; images need none): the same image tokens, from the same image processor and tokenizer."""
    def load(model_dir: str, trust_remote_code: bool):
        import transformers
        from transformers.processing_utils import ProcessorMixin
        base = getattr(transformers, processor_class)

        class ImageOnly(base):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
                self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
                self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class
        return ImageOnly.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return load


@dataclass(frozen=True)
class Family:
    name: str
    names: Callable[[str], tuple[str, str]]     # checkpoint name -> ("text" | "vision", name)
    tower: Callable                             # config -> the image side (an nn.Module)
    encode: Callable                            # (tower, [per-image data]) -> (embeddings [tokens, hidden] each, runs)
    lengths: Callable                           # (Processor, output, ids, image-token positions, n) -> per image its runs' lengths
    data: Callable                              # (processor output, i, runs) -> image i's tensors (ImageRef.data)
    processor: Callable | None = None           # (model_dir, trust) -> a processor where AutoProcessor cannot build one
    mrope: bool = False                         # positions by M-RoPE (positions())
    own_processor: bool = False                 # `processor` always (not only where AutoProcessor fails)
    call: Callable | None = None                # (processor) -> the keyword arguments of each processor call
    # The language model attends both ways within each run of an image's tokens at prefill (Gemma 3): its
    # ImageRefs are `whole` (no prefill chunk ends inside a run) and the runner gives the step's attention
    # the runs (kernels/torch_paged.py `blocks`).
    bidirectional: bool = False


FAMILIES = {
    "llava": Family("llava", _llava_text_name, _llava_tower, _llava_encode, _llava_lengths, _llava_data),
    "qwen2_vl": Family("qwen2_vl", _qwen_names, _qwen_tower("Qwen2VLModel", "Qwen2VisionTransformerPretrainedModel"),
                       _qwen_encode, _qwen_lengths, _qwen_data, _image_only("Qwen2VLProcessor"), mrope=True),
    "qwen2_5_vl": Family("qwen2_5_vl", _qwen_names,
                         _qwen_tower("Qwen2_5_VLModel", "Qwen2_5_VisionTransformerPretrainedModel"),
                         _qwen_encode, _qwen_lengths, _qwen_data, _image_only("Qwen2_5_VLProcessor"), mrope=True),
    "idefics3": Family("idefics3", _idefics_names, _idefics_tower, _idefics_encode, _idefics_lengths, _idefics_data),
    "gemma3": Family("gemma3", _llava_text_name, _gemma3_tower, _gemma3_encode, _gemma3_lengths, _gemma3_data,
                     _gemma3_processor, own_processor=True, call=_gemma3_call, bidirectional=True),
}


def positions(items, lengths: list[int]) -> torch.Tensor | None:
    """M-RoPE positions [3, T] of a packed step (T = sum of lengths, items in pack order), or None when
    no item's prompt has an image (then every position is its index). Text after images and every
    generated token sit at index + shift (the images before took max(rows, columns) positions for
    their rows x columns tokens); an image's tokens at (start + t, start + row, start + column), as
    transformers' get_rope_index places them."""
    if not any(it.prompt_media for it in items):
        return None
    out = torch.empty(3, sum(lengths), dtype=torch.long)
    base = 0
    for it, n in zip(items, lengths):
        s = it.start_pos
        rows = torch.arange(s, s + n)
        out[:, base:base + n] = rows
        shift = 0
        for m in sorted(it.prompt_media, key=lambda m: m.offset):
            t, h, w = m.data["llm_grid"]
            lo, hi = max(s, m.offset), min(s + n, m.offset + m.length)
            start = m.offset + shift
            if lo < hi:     # this image's tokens in this item
                k = torch.arange(lo - m.offset, hi - m.offset)
                seg = out[:, base + lo - s:base + hi - s]
                seg[0] = start + k // (h * w)
                seg[1] = start + (k // w) % h
                seg[2] = start + k % w
            shift += max(h, w) - m.length
            after = max(s, m.offset + m.length)     # tokens past this image move by the shift so far
            if after < s + n:
                out[:, base + after - s:base + n] = torch.arange(after, s + n) + shift
        base += n
    return out


def blocks(items) -> dict[int, list[tuple[int, int]]] | None:
    """A bidirectional family's step (Gemma 3): sequence index -> [(first, end)] positions of the image
    runs its prompt rows feed (kernels.step.Step.blocks; each run whole in this step's rows or begun
    before them: the scheduler's chunks never end inside one), or None where no prompt row feeds one.
    Sequences in pack order (runner.pack_step: a draft's rows are one sequence each)."""
    out, s = {}, 0
    for it in items:
        n, a = len(it.token_ids), it.start_pos
        if n > 1 and not it.draft:
            runs = [(lo, lo + length) for m in it.media if m.whole for lo, length in m.spans
                    if lo < a + n and a < lo + length]
            if runs:
                out[s] = runs
        s += n if it.draft else 1
    return out or None


def family_of(config) -> Family | None:
    """The VLM family of a transformers config, or None (a text-only model)."""
    return FAMILIES.get(getattr(config, "model_type", None))


def text_names(family: Family) -> Callable[[str], str | None]:
    """For llama.load: a checkpoint name -> our language model's, or None (the image side's)."""
    def rename(key: str) -> str | None:
        side, name = family.names(key)
        return name if side == "text" else None
    return rename


# ---- the HTTP side: prompt + images -> token ids + ImageRefs
class Processor:
    """The engine's MediaProcessor (handler/engine/types.py) over the model's own processor."""

    def __init__(self, model_dir: str, config, family: Family, trust_remote_code: bool = False):
        from transformers import AutoProcessor
        try:
            if family.own_processor:
                self.hf = family.processor(model_dir, trust_remote_code)
            else:
                self.hf = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (ImportError, AttributeError, ValueError, TypeError):
            if family.processor is None or family.own_processor:
                raise
            self.hf = family.processor(model_dir, trust_remote_code)
        self.family = family
        self.call_kwargs = family.call(self.hf) if family.call is not None else {}
        self.placeholder = self.hf.image_token
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index")

    def process(self, text: str, images: list) -> tuple[list[int], tuple[ImageRef, ...]]:
        text = text.replace(IMAGE_MARKER, self.placeholder)
        placed = text.count(self.placeholder)
        if placed != len(images):
            raise RequestError("messages", f"the chat template placed {placed} image placeholders "
                                           f"({self.placeholder!r}) for {len(images)} images")
        try:
            out = self.hf(text=text, images=[i.image for i in images], return_tensors="pt", add_special_tokens=False,
                          **self.call_kwargs)
        except (ValueError, TypeError) as e:    # an image the processor cannot take (a size it refuses)
            raise RequestError(images[0].where, f"the model's processor refused the image: {str(e)[:200]}") from None
        ids = out["input_ids"][0].tolist()
        if "image_grid_thw" in out:
            out["merge_size"] = self.hf.image_processor.merge_size
        where = [p for p, t in enumerate(ids) if t == self.image_token_id]
        runs = self.family.lengths(self, out, ids, where, len(images))
        if len(runs) != len(images) or sum(map(sum, runs)) != len(where):
            raise RequestError("messages", f"{len(where)} image tokens for {len(images)} images")
        refs, k = [], 0
        for i, img in enumerate(images):
            spans: list[tuple[int, int]] = []
            for n in runs[i]:
                run = where[k:k + n]
                if run[-1] - run[0] != n - 1:
                    raise RequestError("messages", "an image's tokens are not where its processor put them (two "
                                                   "placeholders side by side?)")
                if spans and sum(spans[-1]) == run[0]:
                    spans[-1] = (spans[-1][0], spans[-1][1] + n)
                else:
                    spans.append((run[0], n))
                k += n
            refs.append(ImageRef(img.hash, spans[0][0], sum(runs[i]), data=self.family.data(out, i, runs),
                                 runs=tuple(spans) if len(spans) > 1 else (), whole=self.family.bidirectional))
        return ids, tuple(refs)


# ---- the towers' attention on CPU
CPU_ATTENTION = "lmi_cpu"      # the name transformers' attention interface knows it by


def _cpu_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """transformers' attention interface for a vision tower on CPU: query [B, H, S, D], key / value
    [B, Hkv, S, D] -> ([B, S, H, D], None). Where every row sees all of its image's rows (no mask, not
    causal, no dropout: CLIP, SigLIP, Idefics3 and Gemma 3's towers on whole images, Qwen2-VL's per
    window), the C encoder kernel (kernels/cpu/attention.py encoder_attention: the panel GEMMs for
    long sequences, bf16 by vdpbf16ps); else (a padding mask, a dtype the kernel lacks) torch's SDPA."""
    from kernels import cpu as cpu_ext
    b, h, s, d = query.shape
    if attention_mask is None and not is_causal and not dropout and key.shape[2] == s:
        q, k, v = (x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value))
        out = torch.empty(b * s, h, d, dtype=query.dtype)
        if cpu_ext.encoder_attention(q, k, v, [i * s for i in range(b)], [s] * b,
                                     d ** -0.5 if scaling is None else scaling, out):
            return out.view(b, s, h, d), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _use_cpu_attention(tower: nn.Module) -> None:
    """The tower's attention layers call _cpu_attention (its masks are built as for SDPA), and its
    embeddings leave contiguous: SigLIP-style ones return patch_embeds.flatten(2).transpose(1, 2) plus
    positions, a transposed layout the whole residual stream then keeps (every layer norm copied it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionInterface.register(CPU_ATTENTION, _cpu_attention)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    # every config but the language model's (a shell holds its text_config without the module: left as
    # it is, transformers has nothing to warn about)
    text = getattr(tower.config, "text_config", None)
    keep = {"text_config": text._attn_implementation} if text is not None else {}
    tower.set_attn_implementation({"": CPU_ATTENTION, **{k: CPU_ATTENTION for k in tower.config.sub_configs}, **keep})
    for name, m in tower.named_modules():
        if name.rsplit(".", 1)[-1] == "embeddings":
            m.register_forward_hook(lambda _m, _args, out: out.contiguous() if isinstance(out, torch.Tensor) else out)


# ---- the engine side: the encoder stage and its cache
class VisionStage:
    """The vision tower + projector (their own weights from the checkpoint) and the encoder cache
    (content hash -> embeddings [tokens, hidden], least recently used dropped past `cache_bytes`).
    Engine thread only; stats() is read from others (a copy of ints)."""

    def __init__(self, model_dir: str, config, family: Family, files: list[str], dtype: torch.dtype,
                 device: torch.device, cache_bytes: int):
        from safetensors import safe_open
        from transformers.initialization import no_init_weights
        self.family, self.dtype, self.device = family, dtype, device
        with no_init_weights():
            tower = family.tower(config)
        params = dict(tower.named_parameters())
        filled = set()
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    side, name = family.names(key)
                    if side != "vision":
                        continue
                    p = params.get(name)
                    if p is None:
                        raise ValueError(f"unexpected tensor {key!r} in the checkpoint (no such vision parameter)")
                    t = f.get_tensor(key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"tensor {key}: checkpoint shape {list(t.shape)} does not fit {list(p.shape)}")
                    with torch.no_grad():
                        p.copy_(t)
                    filled.add(name)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")
        self.tower = tower.to(device=device, dtype=dtype).eval()
        packed = 0
        if device.type == "cpu":    # the tower's linear layers on our GEMMs by the language model's rule
            from handler.model.cpu import prepack_by_rule
            packed = prepack_by_rule(self.tower, dtype)[0]
            _use_cpu_attention(self.tower)
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_bytes, self.held = cache_bytes, 0
        self.counts = {"encoder_runs": 0, "encoder_images": 0, "encoder_cache_hits": 0}
        log.info("vision: %s tower (%d parameters) on %s, %d linear layers packed; encoder cache %.0f MB",
                 family.name, sum(p.numel() for p in params.values()), device, packed, cache_bytes / 1e6)

    def stats(self) -> dict:
        return {**self.counts, "encoder_cache_bytes": self.held, "encoder_cache_images": len(self.cache)}

    @torch.inference_mode()
    def encode(self, refs: list[ImageRef]) -> list[torch.Tensor]:
        """The images' embeddings [length, hidden] each, in as few tower runs as the family allows
        (features() gives it one image at a time)."""
        datas = [{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in r.data.items()}
                 for r in refs]
        for d in datas:
            if "pixel_values" in d:
                d["pixel_values"] = d["pixel_values"].to(self.dtype)
        feats, runs = self.family.encode(self.tower, datas)
        self.counts["encoder_runs"] += runs
        self.counts["encoder_images"] += len(refs)
        for r, f in zip(refs, feats):
            if f.shape[0] != r.length:
                raise RuntimeError(f"the vision tower gave {f.shape[0]} embeddings for an image of {r.length} tokens")
        return feats

    def _remember(self, key: str, feats: torch.Tensor, keep: set[str]) -> None:
        size = feats.numel() * feats.element_size()
        if size > self.cache_bytes:
            return
        self.cache[key] = feats
        self.held += size
        for old in list(self.cache):
            if self.held <= self.cache_bytes:
                break
            if old in keep:
                continue
            self.held -= self.cache[old].numel() * self.cache[old].element_size()
            del self.cache[old]

    def features(self, refs: dict[str, ImageRef]) -> dict[str, torch.Tensor]:
        """key -> embeddings for every image named: cached, or encoded now, one tower run an image (a run
        of several holds all their activations at once: SigLIP-B/16's at 512 px, 4 images in one run took
        1.23x the time of 4 runs, the activations past the last-level cache)."""
        got, missing = {}, []
        for key, r in refs.items():
            f = self.cache.get(key)
            if f is None:
                missing.append(r)
            else:
                self.cache.move_to_end(key)
                self.counts["encoder_cache_hits"] += 1
                got[key] = f
        for r in missing:
            got[r.key] = f = self.encode([r])[0]
            self._remember(r.key, f, set(refs))
        return got

    def inject(self, items) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the packed step [K], embeddings [K, hidden]) for the image tokens the items feed
        (rows in pack order: each item's tokens follow the previous item's), or None."""
        wanted = {m.key: m for it in items for m in it.media}
        if not wanted:
            return None
        feats = self.features(wanted)
        rows, parts, base = [], [], 0
        for it in items:
            s, n = it.start_pos, len(it.token_ids)
            for m in it.media:
                row = 0         # the image's embedding row of this run's first token
                for start, length in m.spans:
                    lo, hi = max(s, start), min(s + n, start + length)
                    if lo < hi:
                        rows.extend(range(base + lo - s, base + hi - s))
                        parts.append(feats[m.key][row + lo - start:row + hi - start])
                    row += length
            base += n
        if not parts:   # chunks only between an image's runs (the text between pan-and-scan crops, tiles)
            return None
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(parts)
