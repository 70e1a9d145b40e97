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
  llava   LLaVA-1.5 style: CLIP vision tower, 2-layer MLP projector, a Llama-family language model;
          vision_feature_layer / _select_strategy from the config; one run of placeholders per image
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


def _llava_tower(config) -> nn.Module:
    """LlavaModel without its language model: get_image_features reads only the tower, the projector
    and the config."""
    from transformers import AutoModel
    from transformers.models.llava.modeling_llava import LlavaModel, LlavaMultiModalProjector
    m = LlavaModel.__new__(LlavaModel)
    nn.Module.__init__(m)
    m.config = config
    m.vision_tower = AutoModel.from_config(config.vision_config)
    m.multi_modal_projector = LlavaMultiModalProjector(config)
    return m


def _llava_features(tower, pixel_values: torch.Tensor) -> list[torch.Tensor]:
    cfg = tower.config
    out = tower.get_image_features(pixel_values=pixel_values, vision_feature_layer=cfg.vision_feature_layer,
                                   vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                                   return_dict=True)
    return list(out.pooler_output)


@dataclass(frozen=True)
class Family:
    name: str
    names: Callable[[str], tuple[str, str]]     # checkpoint name -> ("text" | "vision", name)
    tower: Callable                             # config -> the image side (an nn.Module)
    features: Callable                          # (tower, pixel_values [N, ...]) -> N tensors [tokens, hidden]
    pixel_keys: tuple = ("pixel_values",)       # the processor's per-image tensors


FAMILIES = {"llava": Family("llava", _llava_text_name, _llava_tower, _llava_features)}


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
        self.hf = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.family = family
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
            out = self.hf(text=text, images=[i.image for i in images], return_tensors="pt", add_special_tokens=False)
        except (ValueError, TypeError) as e:    # an image the processor cannot take (a size it refuses)
            raise RequestError(images[0].where, f"the model's processor refused the image: {str(e)[:200]}") from None
        ids = out["input_ids"][0].tolist()
        spans = self._spans(ids, len(images))
        refs = tuple(ImageRef(img.hash, start, length, data={k: out[k][i:i + 1] for k in self.family.pixel_keys})
                     for i, (img, (start, length)) in enumerate(zip(images, spans)))
        return ids, refs

    def _spans(self, ids: list[int], n: int) -> list[tuple[int, int]]:
        """Each image's run of placeholder tokens, in order (equal runs: LLaVA's fixed resolution)."""
        where = [p for p, t in enumerate(ids) if t == self.image_token_id]
        if not n or len(where) % n:
            raise RequestError("messages", f"{len(where)} image tokens for {n} images")
        length = len(where) // n
        spans = []
        for k in range(n):
            run = where[k * length:(k + 1) * length]
            if run[-1] - run[0] != length - 1:
                raise RequestError("messages", "an image's tokens are not contiguous in the prompt (two "
                                               "placeholders side by side?)")
            spans.append((run[0], length))
        return spans


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
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_bytes, self.held = cache_bytes, 0
        self.counts = {"encoder_runs": 0, "encoder_images": 0, "encoder_cache_hits": 0}
        log.info("vision: %s tower (%d parameters) on %s; encoder cache %.0f MB", family.name,
                 sum(p.numel() for p in params.values()), device, cache_bytes / 1e6)

    def stats(self) -> dict:
        return {**self.counts, "encoder_cache_bytes": self.held, "encoder_cache_images": len(self.cache)}

    @torch.inference_mode()
    def encode(self, refs: list[ImageRef]) -> list[torch.Tensor]:
        """One tower run per group of same-shaped pixels; each image's embeddings [length, hidden]."""
        out: list[torch.Tensor | None] = [None] * len(refs)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(refs):
            groups.setdefault(tuple(r.data[self.family.pixel_keys[0]].shape[1:]), []).append(i)
        for members in groups.values():
            pixels = torch.cat([refs[i].data[self.family.pixel_keys[0]] for i in members]).to(self.device, self.dtype)
            feats = self.family.features(self.tower, pixels)
            self.counts["encoder_runs"] += 1
            self.counts["encoder_images"] += len(members)
            for i, f in zip(members, feats):
                if f.shape[0] != refs[i].length:
                    raise RuntimeError(f"the vision tower gave {f.shape[0]} embeddings for an image of "
                                       f"{refs[i].length} tokens")
                out[i] = f
        return out

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
        """key -> embeddings for every image named: cached, or encoded now (all missing ones together)."""
        got, missing = {}, []
        for key, r in refs.items():
            f = self.cache.get(key)
            if f is None:
                missing.append(r)
            else:
                self.cache.move_to_end(key)
                self.counts["encoder_cache_hits"] += 1
                got[key] = f
        if missing:
            for r, f in zip(missing, self.encode(missing)):
                got[r.key] = f
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
                lo, hi = max(s, m.offset), min(s + n, m.offset + m.length)
                if lo < hi:
                    rows.extend(range(base + lo - s, base + hi - s))
                    parts.append(feats[m.key][lo - m.offset:hi - m.offset])
            base += n
        return torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(parts)
