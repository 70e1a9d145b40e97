"""Vision-language models on our engine (handler/model/vision.py): our language model, transformers'
vision tower + projector from the checkpoint as the stage before prefill. For tiny random LLaVA-1.5
(CLIP, fixed resolution), Qwen2-VL and Qwen2.5-VL (dynamic resolution, M-RoPE positions) and Idefics3
(SmolVLM v1: an image as tiles, several runs of image tokens between text markers): greedy output
equals transformers' `*ForConditionalGeneration.generate` with the model's own processor, token for
token, under rolling and paged (chunked prefill cutting images), with one and several images per
request, images in different turns, batched with text-only requests; a repeated image is encoded once;
the prefix cache never shares a block between two images behind the same tokens. Gemma 3 (SigLIP,
pan-and-scan crops as several runs, image runs attending both ways at prefill): the same parity, no
prefill chunk ending inside a run, and the answers depend on the bidirectional runs (transformers'
causal-only answers differ, and ours without the runs' blocks equal those)."""
from __future__ import annotations

import functools
import io

import pytest
import torch

from handler.engine.request import SamplingParams
from handler.engine.types import IMAGE_MARKER
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


FAMILIES = ["llava", "qwen2_vl", "qwen2_5_vl", "idefics3", "gemma3"]


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


@pytest.fixture(scope="module")
def gemma3_dir(demo_model_dir, tmp_path_factory):
    """Pan and scan on: images 1 and 2 (wide enough) are also 2 crops each, 3 runs of 16 tokens. Seed 1: a
    random model whose first answers differ by image (the tests check the answers depend on the image)."""
    from transformers import AutoTokenizer

    from handler.tools.demo_model import build_demo_gemma3
    return build_demo_gemma3(str(tmp_path_factory.mktemp("gemma3")), seed=1,
                             tokenizer=AutoTokenizer.from_pretrained(demo_model_dir))


@pytest.fixture(params=FAMILIES)
def vlm_dir(request, llava_model_dir, qwen_dirs, idefics_dir, gemma3_dir):
    return {"llava": llava_model_dir, "idefics3": idefics_dir, "gemma3": gemma3_dir, **qwen_dirs}[request.param]


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str):
    """(the model's processor, transformers' model) for a demo VLM directory."""
    import json
    import os

    import transformers

    from handler.model import vision
    family = json.load(open(os.path.join(model_dir, "DEMO_MODEL.json")))["family"]
    cls = {"llava": "LlavaForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
           "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration"}[family]
    f = vision.FAMILIES[family]
    # Qwen's processors are built without their video half (torchvision): vision.Processor does the same
    auto = f.processor is None or f.own_processor
    proc = transformers.AutoProcessor.from_pretrained(model_dir) if auto else f.processor(model_dir, False)
    return proc, getattr(transformers, cls).from_pretrained(model_dir, dtype=torch.float32).eval()


def _call_kwargs(model_dir: str, proc) -> dict:
    """The processor call's options as the model's config says (Gemma 3: pan and scan)."""
    import json
    import os

    from handler.model import vision
    f = vision.FAMILIES[json.load(open(os.path.join(model_dir, "DEMO_MODEL.json")))["family"]]
    return f.call(proc) if f.call is not None else {}


def _hf_messages(messages):
    """OpenAI messages -> what the processor's chat template takes (images as {"type": "image"})."""
    out = []
    for m in messages:
        c = m["content"]
        parts = [text(c)] if isinstance(c, str) else [{"type": "image"} if p["type"] == "image_url" else p for p in c]
        out.append({"role": m["role"], "content": parts})
    return out


def hf_greedy(model_dir: str, messages, n: int = NEW, causal: bool = False) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) from transformers: the processor's template and tokens, `generate`.
    `causal`: without token_type_ids (Gemma 3's image runs then attend causally only)."""
    proc, model = _hf(model_dir)
    prompt = proc.tokenizer.apply_chat_template(_hf_messages(messages), add_generation_prompt=True, tokenize=False)
    from PIL import Image
    images = [Image.open(io.BytesIO(png(_seed(p)))).convert("RGB")
              for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image_url"]
    inputs = proc(text=prompt, images=images or None, return_tensors="pt", add_special_tokens=False,
                  **(_call_kwargs(model_dir, proc) if images else {}))
    if causal:
        inputs.pop("token_type_ids")
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


def _runs_cut(plans) -> list:
    """Items whose chunk ends strictly inside a run of an image's tokens."""
    return [(it.seq_id, it.start_pos, len(it.token_ids)) for p in plans for it in p.items for m in it.media
            for a, n in m.spans if a < it.start_pos + len(it.token_ids) < a + n]


@pytest.mark.parametrize("strategy", ["rolling", "paged"])
@pytest.mark.parametrize("budget", ["12", "24"])
def test_gemma3_image_runs_attend_both_ways_and_chunks_never_cut_them(gemma3_dir, tmp_path, strategy, budget):
    """Gemma 3's image runs attend both ways at prefill (transformers' token_type_ids blocks). Prefill chunks
    of 12 / 24 tokens meet runs of 16: a chunk ends before a run or takes it whole (past the budget where
    the run is longer), never inside; the answers are transformers' generate with the processor's
    token_type_ids, and differ from its causal-only answers, which ours equal with the runs' blocks taken
    away (so the parity above rests on the bidirectional runs)."""
    import dataclasses

    from handler.engine.types import ImageRef
    engine = make_engine(gemma3_dir, tmp_path, {**PROPS[strategy], "option.max_rolling_batch_prefill_tokens": budget})
    plans = []
    engine.on_step = plans.append
    try:
        sent = {name: submit(engine, msgs) for name, msgs in REQUESTS.items()}
        got = {name: collect(ch) for name, (_, ch) in sent.items()}
        refs = {name: engine.runner.media.process(*_rendered(engine, msgs)) for name, msgs in REQUESTS.items()
                if name != "text only"}
        assert all(isinstance(m, ImageRef) and m.whole for _, ms in refs.values() for m in ms)
        assert len(refs["one image"][1][0].spans) == 3       # pan and scan: the whole image and 2 crops
        for name, msgs in REQUESTS.items():
            assert got[name] == hf_greedy(gemma3_dir, msgs)[1], (strategy, budget, name)
        assert not _runs_cut(plans), _runs_cut(plans)
        # chunks met runs: one ended at a run's first token, and (budget 12) one took a run past the budget
        starts = {a for p in plans for it in p.items for m in it.media for a, _ in m.spans}
        assert any(it.start_pos + len(it.token_ids) in starts for p in plans for it in p.items)
        if budget == "12":
            assert max(len(it.token_ids) for p in plans for it in p.items) > 12
        causal = {name: hf_greedy(gemma3_dir, msgs, causal=True)[1] for name, msgs in REQUESTS.items()}
        differ = [name for name in REQUESTS if causal[name] != got[name]]
        assert differ, "the bidirectional runs changed no answer: the test would not see them dropped"
        assert_drained(engine)
        if strategy == "paged":     # its prefix cache would hand back the KV the runs computed both ways
            return
        # without the runs' blocks (causal attention over the image rows) ours give transformers' causal answers
        engine.runner.vision.family = dataclasses.replace(engine.runner.vision.family, bidirectional=False)
        for name in differ:
            assert collect(submit(engine, REQUESTS[name])[1]) == causal[name], name
    finally:
        engine.shutdown()


def _rendered(engine, messages):
    """(the chat template's prompt, the images) as the HTTP layer hands them to the model's processor."""
    images = [_Image(png(_seed(p))) for m in messages if not isinstance(m["content"], str)
              for p in m["content"] if p["type"] == "image_url"]
    prompt = engine.tokenizer.apply_chat_template(_hf_messages(messages), tokenize=False, add_generation_prompt=True)
    return prompt, images


def test_gemma3_step_blocks_name_each_prompt_rows_image_runs():
    """vision.blocks: per sequence of the step (pack order, a draft's rows one sequence each), the runs of
    `whole` images its prompt rows feed; decode rows and causal families' images none."""
    from handler.engine.request import SamplingParams
    from handler.engine.types import ImageRef, StepItem
    from handler.model import vision
    p = SamplingParams(max_new_tokens=1)
    img_a = ImageRef("a", 3, 8, runs=((3, 4), (10, 4)), whole=True)
    img_b = ImageRef("b", 20, 4, whole=True)
    causal = ImageRef("c", 3, 4)
    items = [StepItem(0, [1, 2], 5, [0], False, p, [], draft=(7,)),        # a draft: 2 sequences
             StepItem(1, list(range(12)), 2, [1], False, p, [], media=(img_a,)),   # rows 2..13: both runs
             StepItem(2, [5], 30, [2], True, p, [], media=(img_b,)),        # a decode row
             StepItem(3, list(range(8)), 16, [3], True, p, [], media=(img_b,)),    # rows 16..23
             StepItem(4, list(range(8)), 0, [4], True, p, [], media=(causal,))]
    assert vision.blocks(items) == {2: [(3, 7), (10, 14)], 4: [(20, 24)]}
    assert vision.blocks(items[2:3] + items[4:]) is None


def test_gemma3_refuses_batch_invariant_one_token_forwards(gemma3_dir, tmp_path):
    """option.batch_invariant feeds a prompt one token a forward: an image run could not attend both ways."""
    from handler.model.runner import ModelLoadError
    with pytest.raises(ModelLoadError, match=r"option.batch_invariant=true .* gemma3 model's image tokens attend"):
        make_engine(gemma3_dir, tmp_path, {**PROPS["rolling"], "option.batch_invariant": "true"})


def test_the_tower_attends_in_the_c_kernel_as_sdpa_does(vlm_dir, tmp_path, monkeypatch):
    # On CPU the tower's attention layers call the C encoder kernel (one call a layer a run, or a window
    # for Qwen2-VL); its features equal the same tower's (same weights, same GEMMs) under torch's SDPA.
    from kernels import cpu as cpu_ext
    if not cpu_ext.encoder_attention_available(torch.float32):
        pytest.skip("no C kernels in this build: the towers attend by SDPA (the parity test covers it)")
    engine = make_engine(vlm_dir, tmp_path, PROPS["rolling"])
    try:
        stage, media = engine.runner.vision, engine.runner.media
        refs = [r for s in (1, 2) for r in media.process(IMAGE_MARKER + " Hi", [_Image(png(s))])[1]]
        calls, real = [], cpu_ext.encoder_attention
        monkeypatch.setattr(cpu_ext, "encoder_attention", lambda *a: calls.append(a[4]) or real(*a))
        laid = []       # the embeddings leave contiguous (SigLIP's would carry a transposed layout)
        for name, m in stage.tower.named_modules():
            if name.rsplit(".", 1)[-1] == "embeddings":
                m.register_forward_hook(lambda _m, _a, out: laid.append(out.is_contiguous()))
        ours = stage.encode(refs)
        assert calls and all(sum(c) > 0 for c in calls)
        assert all(laid)
        stage.tower.set_attn_implementation("sdpa")
        n = len(calls)
        want = stage.encode(refs)
        assert len(calls) == n                      # SDPA's run did not reach the kernel
        for a, b in zip(ours, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    finally:
        engine.shutdown()
