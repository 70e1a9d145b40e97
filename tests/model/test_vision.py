"""Vision-language models on our engine (handler/model/vision.py): our language model, transformers'
vision tower + projector from the checkpoint as the stage before prefill. For tiny random LLaVA-1.5
(CLIP, fixed resolution), Qwen2-VL and Qwen2.5-VL (dynamic resolution, M-RoPE positions) and Idefics3
(SmolVLM v1: an image as tiles, several runs of image tokens between text markers): greedy output
equals transformers' `*ForConditionalGeneration.generate` with the model's own processor, token for
token, under rolling and paged (chunked prefill cutting images), with one and several images per
request, images in different turns, batched with text-only requests; a repeated image is encoded once;
the prefix cache never shares a block between two images behind the same tokens."""
from __future__ import annotations

import functools
import io

import pytest
import torch

from handler.engine.request import SamplingParams
from handler.http import protocols as api
from handler.http.protocols import openai
from tests.support.engine import STRATEGIES, assert_drained, make_engine

NEW = 10
# Prefill chunks of 24 tokens: an image is 16, so several images per prompt are cut across steps.
PROPS = {"rolling": {**STRATEGIES["rolling"], "option.max_rolling_batch_prefill_tokens": "24"},
         "paged": {**STRATEGIES["paged"], "option.max_rolling_batch_prefill_tokens": "24",
                   "option.kv_cache_tokens": "1024", "option.enable_prefix_caching": "true"}}


def png(seed: int, size=None) -> bytes:
    """A random image; its size follows the seed (dynamic-resolution families get other token counts)."""
    from PIL import Image
    size = size or (60 + 10 * seed, 40 + 12 * seed)
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def url(seed: int) -> str:
    import base64
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


def img(seed: int):
    return {"type": "image_url", "image_url": {"url": url(seed)}}


def text(t: str):
    return {"type": "text", "text": t}


REQUESTS = {
    "one image": [{"role": "user", "content": [img(1), text("What is in the picture?")]}],
    "two images": [{"role": "user", "content": [img(2), img(3), text("Compare them.")]}],
    "two turns": [{"role": "user", "content": [img(4), text("Describe it.")]},
                  {"role": "assistant", "content": "A square."},
                  {"role": "user", "content": [img(5), text("And this one?")]}],
    "text only": [{"role": "user", "content": "Say something about Python."}],
    "same image again": [{"role": "user", "content": [img(1), text("Which colours?")]}],
}


FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl", "idefics3"]


@pytest.fixture(scope="module")
def qwen_dirs(demo_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from handler.tools.demo_model import build_demo_qwen_vl
    return {family: build_demo_qwen_vl(str(tmp_path_factory.mktemp(family)), version=v,
                                       tokenizer=AutoTokenizer.from_pretrained(demo_model_dir))
            for family, v in (("qwen2_vl", "2"), ("qwen2_5_vl", "2.5"))}


@pytest.fixture(scope="module")
def idefics_dir(demo_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from handler.tools.demo_model import build_demo_idefics3
    return build_demo_idefics3(str(tmp_path_factory.mktemp("idefics3")),
                               tokenizer=AutoTokenizer.from_pretrained(demo_model_dir))


@pytest.fixture(params=FAMILIES)
def vlm_dir(request, llava_model_dir, qwen_dirs, idefics_dir):
    return {"llava": llava_model_dir, "idefics3": idefics_dir, **qwen_dirs}[request.param]


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str):
    """(the model's processor, transformers' model) for a demo VLM directory."""
    import json
    import os

    import transformers

    from handler.model import vision
    family = json.load(open(os.path.join(model_dir, "DEMO_MODEL.json")))["family"]
    cls = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration"}[family]
    f = vision.FAMILIES[family]
    # Qwen's processors are built without their video half (torchvision): vision.Processor does the same
    proc = transformers.AutoProcessor.from_pretrained(model_dir) if f.processor is None else f.processor(model_dir, False)
    return proc, getattr(transformers, cls).from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_messages(messages):
    """OpenAI messages -> what the processor's chat template takes (images as {"type": "image"})."""
    out = []
    for m in messages:
        c = m["content"]
        parts = [text(c)] if isinstance(c, str) else [{"type": "image"} if p["type"] == "image_url" else p for p in c]
        out.append({"role": m["role"], "content": parts})
    return out


def hf_greedy(model_dir: str, messages, n: int = NEW) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) from transformers: the processor's template and tokens, `generate`."""
    proc, model = _hf(model_dir)
    prompt = proc.tokenizer.apply_chat_template(_hf_messages(messages), add_generation_prompt=True, tokenize=False)
    from PIL import Image
    images = [Image.open(io.BytesIO(png(_seed(p)))).convert("RGB")
              for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image_url"]
    inputs = proc(text=prompt, images=images or None, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=proc.tokenizer.pad_token_id)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def _seed(part) -> int:
    return next(s for s in range(10) if url(s) == part["image_url"]["url"])


class _Image:
    def __init__(self, data: bytes):
        from handler.http.protocols import media
        self.image, self.hash = media.decode(data, "x", media.Limits())
        self.where = "x"


def submit(engine, messages):
    """Through the HTTP layer's own steps: parse_chat (decode, render), tokenize (the model's processor)."""
    gen = openai.parse_chat({"messages": messages, "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
                            engine.tokenizer)
    ids = api.tokenize(engine.tokenizer, gen, engine.runner.media)
    return ids[0], engine.submit(ids, gen.params, media=gen.media)[0]


def collect(ch) -> list[int]:
    out = []
    while True:
        ev = ch.events.get(timeout=300)
        assert hasattr(ev, "id"), ev
        out.append(ev.id)
        if ev.done:
            return out


@pytest.mark.parametrize("strategy", ["rolling", "paged"])
def test_greedy_parity_with_generate(vlm_dir, tmp_path, strategy):
    engine = make_engine(vlm_dir, tmp_path, PROPS[strategy])
    plans = []
    engine.on_step = plans.append
    try:
        assert engine.runner.own and engine.runner.vision is not None
        sent = {name: submit(engine, msgs) for name, msgs in REQUESTS.items()}     # one batch
        got = {name: (ids, collect(ch)) for name, (ids, ch) in sent.items()}
        for name, msgs in REQUESTS.items():
            want_ids, want = hf_greedy(vlm_dir, msgs)
            assert got[name][0] == want_ids, name          # the processor's image tokens, placed alike
            assert got[name][1] == want, (strategy, name)
        # the answers depend on the image: the same question on another image answers otherwise
        assert got["one image"][1] != hf_greedy(vlm_dir, [{"role": "user", "content": [
            img(6), text("What is in the picture?")]}])[1]
        # what the steps were: an image cut between chunks, and image chunks beside text-only rows
        cut = [it for p in plans for it in p.items for m in it.media
               if m.offset < it.start_pos or m.end > it.start_pos + len(it.token_ids)]
        assert cut, "no chunk cut an image"
        assert any(any(it.media for it in p.items) and any(not it.media for it in p.items) for p in plans)
        stats = engine.stats()
        assert stats["encoder_images"] == 5         # images 1-5: the repeated one is encoded once
        assert stats["encoder_cache_hits"] >= 1
        assert_drained(engine)
    finally:
        engine.shutdown()


def test_the_prefix_cache_never_shares_blocks_between_images(vlm_dir, tmp_path):
    """Same text, different images: only the blocks before the image are shared (and the
    answers stay transformers'); the same image again reuses its blocks."""
    engine = make_engine(vlm_dir, tmp_path, PROPS["paged"])
    try:
        question = [text("What is in the picture? Answer in one long sentence please.")]
        runs = []
        for seed in (7, 8, 7):
            msgs = [{"role": "user", "content": [img(seed)] + question}]
            before = engine.stats()["cached_prompt_tokens"]
            ids, ch = submit(engine, msgs)
            out = collect(ch)
            assert out == hf_greedy(vlm_dir, msgs)[1], seed
            runs.append((engine.stats()["cached_prompt_tokens"] - before, out))
        image_at = engine.runner.media.process(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, question[0]]}], tokenize=False, add_generation_prompt=True),
            [_Image(png(7))])[1][0].offset
        block = int(PROPS["paged"]["option.block_size"])
        assert runs[0][0] == 0
        assert runs[1][0] == image_at // block * block          # nothing from the image's blocks on
        assert runs[2][0] == (len(ids) - 1) // block * block     # the same image: every full block
        assert runs[2][1] == runs[0][1] and runs[1][1] != runs[0][1]
        assert engine.stats()["encoder_images"] == 2            # 7, 8; 7 again is a cache hit
    finally:
        engine.shutdown()
