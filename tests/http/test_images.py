"""Images in requests (handler/http/protocols/media.py): every protocol's image part becomes one
`ImageInput` (decoded by Pillow, its content hash) in the order the parts came; each bad image is a
400 naming the part and the limit, in the protocol's own error shape; a text-only model refuses
images; the engine receives the model processor's ImageRefs."""
from __future__ import annotations

import base64
import io

import pytest

from handler.engine.request import RequestError
from handler.engine.types import IMAGE_MARKER, ImageRef
from handler.http.protocols import anthropic, media, openai, responses
from tests.http.test_hardening import make_app

PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}"
                  "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n"
                  "{% endfor %}<|assistant|>")


def png(w=8, h=6, color=(255, 0, 0), fmt="PNG") -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, kind="image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


class Tok:
    """One token per character; renders with `template`, recording the messages it got."""

    def __init__(self, template=PARTS_TEMPLATE):
        self.chat_template = template
        self.msgs = None

    def __len__(self):
        return 1000

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 1000 for c in text]}

    def apply_chat_template(self, msgs, tools=None, tokenize=False, add_generation_prompt=True, chat_template=None,
                            **kw):
        import jinja2
        self.msgs = msgs
        return jinja2.Template(chat_template or self.chat_template).render(messages=msgs)


def chat(*content, role="user", **kw):
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": role, "content": list(content)}],
            "max_tokens": 4, **kw}


def image_part(url, **kw):
    return {"type": "image_url", "image_url": {"url": url, **kw}}


RED, BLUE = png(color=(255, 0, 0)), png(color=(0, 0, 255))


# ---- one internal form for every protocol
def test_chat_completions_images_in_order_with_hashes():
    tok = Tok()
    gen = openai.parse_chat(chat({"type": "text", "text": "compare"}, image_part(data_url(RED), detail="low"),
                                 image_part(data_url(BLUE)), image_part(data_url(png(color=(255, 0, 0), fmt="BMP")))),
                            tok)
    imgs = gen.images[0]
    assert [i.where for i in imgs] == ["messages[1].content[1]", "messages[1].content[2]", "messages[1].content[3]"]
    assert [i.detail for i in imgs] == ["low", "auto", "auto"]
    assert imgs[0].image.size == (8, 6) and imgs[0].image.mode == "RGB"
    # the hash is the decoded pixels': the same red square as PNG and as BMP is one image, blue another
    assert imgs[0].hash == imgs[2].hash != imgs[1].hash
    assert gen.prompts[0] == "<|system|>be brief\n<|user|>compare<image><image><image>\n<|assistant|>"
    assert tok.msgs[1]["content"][1] == {"type": "image"}


def test_a_text_template_gets_the_marker_where_the_part_stood():
    tok = Tok("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    gen = openai.parse_chat(chat(image_part(data_url(RED)), {"type": "text", "text": "what?"}), tok)
    assert gen.prompts[0] == f"be brief|{IMAGE_MARKER}\nwhat?|"


def test_lmi_chat_on_invocations_takes_the_same_parts():
    gen = openai.parse_chat(chat(image_part(data_url(RED)), {"type": "text", "text": "hi"}), Tok(), lmi=True)
    assert [i.where for i in gen.images[0]] == ["messages[1].content[0]"]


def test_anthropic_image_blocks_become_the_same_images():
    tok = Tok()
    body = {"model": "m", "max_tokens": 4, "system": "be brief", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(BLUE).decode()}}]}]}
    gen = anthropic.parse(body, tok)
    ref = openai.parse_chat(chat({"type": "text", "text": "compare"}, image_part(data_url(RED)),
                                 image_part(data_url(BLUE))), Tok())
    # named by their own blocks (the system prompt is messages[0] only in the translation)
    assert [i.where for i in gen.images[0]] == ["messages[0].content[1]", "messages[0].content[2]"]
    assert [i.hash for i in gen.images[0]] == [i.hash for i in ref.images[0]]
    assert gen.prompts == ref.prompts


def test_responses_input_image_parts_become_the_same_images():
    body = {"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "compare"}, {"type": "input_image", "image_url": data_url(RED), "detail": "high"},
        {"type": "input_image", "image_url": data_url(BLUE)}]}]}
    gen = responses.parse(body, Tok())
    ref = openai.parse_chat(chat({"type": "text", "text": "compare"}, image_part(data_url(RED)),
                                 image_part(data_url(BLUE))), Tok())
    assert [i.where for i in gen.images[0]] == ["input[0].content[1]", "input[0].content[2]"]
    assert [i.hash for i in gen.images[0]] == [i.hash for i in ref.images[0]]
    assert gen.images[0][0].detail == "high" and gen.prompts == ref.prompts


# ---- bad input: a 400 naming the part and the limit
LIMITS = media.Limits(max_bytes=2_000, max_pixels=64 * 64, max_images=2)


@pytest.mark.parametrize("content,field,words", [
    ([image_part("data:image/png;base64,iVBORw0KGgoAAAANSUhEUg==")], "messages[1].content[0]", "decode"),
    ([image_part(data_url(png(32, 32)[:60]))], "messages[1].content[0]", "truncated or corrupt"),
    ([image_part(data_url(b"GIF89a not really"))], "messages[1].content[0]", "decode"),
    ([image_part("data:image/png;base64,@@@@")], "messages[1].content[0]", "not valid base64"),
    ([image_part("data:image/png,rawtext")], "messages[1].content[0]", "base64 data: URL"),
    ([image_part("ftp://x/y.png")], "messages[1].content[0]", "data: URL"),
    ([image_part(data_url(png(65, 64)))], "messages[1].content[0]", "65x64 = 4160 pixels, over option.max_image_pixels=4096"),
    ([image_part(data_url(png(40, 40, fmt="BMP")))], "messages[1].content[0]", "over option.max_image_mb=0.002"),
    ([image_part(data_url(RED)), image_part(data_url(RED)), {"type": "text", "text": "x"},
      image_part(data_url(BLUE))], "messages[1].content[3]", "at most 2 are taken (option.max_images_per_request=2)"),
    ([image_part("https://example.com/cat.png")], "messages[1].content[0]", "option.allow_remote_images=false"),
    ([image_part(data_url(RED), detail="ultra")], "messages[1].content[0].image_url.detail", "auto, low, high"),
    ([{"type": "input_audio", "input_audio": {}}], "messages[1].content[0]", "text and image_url parts"),
])
def test_bad_images_name_the_part_and_the_limit(content, field, words):
    server = openai.ServerOptions(images=LIMITS)
    with pytest.raises(RequestError) as e:
        openai.parse_chat(chat(*content), Tok(), server=server)
    assert e.value.field == field and words in e.value.message, (e.value.field, e.value.message)
    assert e.value.status == 400


def test_a_request_that_decodes_no_image_past_the_count():
    """The count is checked before an image is decoded: the third (undecodable) is refused for the count."""
    server = openai.ServerOptions(images=LIMITS)
    with pytest.raises(RequestError) as e:
        openai.parse_chat(chat(image_part(data_url(RED)), image_part(data_url(RED)), image_part("data:image/png;base64,AA==")),
                          Tok(), server=server)
    assert "option.max_images_per_request" in e.value.message


def test_images_in_an_assistant_turn_or_a_tool_result_are_refused_by_name():
    blk = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}}
    with pytest.raises(RequestError) as e:
        anthropic.parse({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": [blk]}]}, Tok())
    assert e.value.field == "messages[1].content[0]" and "assistant" in e.value.message
    with pytest.raises(RequestError) as e:
        responses.parse({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
                        Tok())
    assert e.value.field == "input[0].content[0]" and "file_id" in e.value.message


# ---- through the routes: each protocol's error shape; a text-only model; the engine's ImageRefs
def _bodies(url):
    source = {"type": "url", "url": url} if url.startswith("http") else \
        {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
    return {
        "/v1/chat/completions": ({"model": "m", "max_tokens": 3, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(url)]}]}, "messages[0].content[1]"),
        "/invocations": ({"max_tokens": 3, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, image_part(url)]}]}, "messages[0].content[1]"),
        "/v1/messages": ({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image", "source": source}]}]},
            "messages[0].content[1]"),
        "/v1/responses": ({"model": "m", "max_output_tokens": 3, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": url}]}]}, "input[0].content[1]"),
    }


def _field_and_message(path, r):
    body = r.get_json()
    if path == "/invocations":
        return body["field"], body["error"]
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        field, _, message = body["error"]["message"].partition(": ")
        return field, message
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["param"], body["error"]["message"]


@pytest.fixture
def app(demo_model_dir, tmp_path):
    made = []

    def make(props="option.rolling_batch=auto\n", vision=None):
        state, client = make_app(demo_model_dir, tmp_path, props, max_model_len=256)
        if vision is not None:
            state.engine.runner.media = vision
        made.append(state)
        return client

    yield make
    for state in made:
        state.engine.shutdown()


@pytest.mark.parametrize("path", list(_bodies("data:,")))
@pytest.mark.parametrize("case", ["undecodable", "pixels", "count", "remote", "text-only"])
def test_each_protocol_answers_bad_images_in_its_shape(app, path, case):
    props = "option.rolling_batch=auto\noption.max_image_pixels=100\noption.max_images_per_request=1\n"
    client = app(props)
    url = {"undecodable": data_url(b"\x89PNG\r\n\x1a\n broken"), "pixels": data_url(png(11, 10)),
           "remote": "http://example.com/a.png"}.get(case, data_url(png(5, 5)))
    body, field = _bodies(url)[path]
    words = {"undecodable": "decode", "pixels": "option.max_image_pixels=100",
             "count": "option.max_images_per_request=1", "remote": "option.allow_remote_images=false",
             "text-only": "reads text only"}[case]
    if case == "count":     # a second image, the one beyond the limit
        body = _bodies(data_url(png(5, 5)) + "")[path][0]
        msgs = body.get("messages") or body.get("input")
        msgs[0]["content"].append(dict(msgs[0]["content"][1]))
        field = field[:-2] + "2]"
    r = client.post(path, json=body)
    assert r.status_code == 400, r.get_data(as_text=True)
    got_field, message = _field_and_message(path, r)
    assert got_field == field and words in message, (got_field, message)


class FakeVision:
    """A MediaProcessor stand-in: each image is 3 tokens (<|image|> from the demo vocabulary), and
    the engine's ImageRefs are recorded."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen: list[tuple[ImageRef, ...]] = []

    def process(self, text, images):
        ids, refs = [], []
        pieces = text.replace(IMAGE_MARKER, "<image>").split("<image>")
        assert len(pieces) == len(images) + 1
        for k, piece in enumerate(pieces):
            ids += self.tok(piece, add_special_tokens=False)["input_ids"]
            if k < len(images):
                refs.append(ImageRef(images[k].hash, len(ids), 3, data=images[k].image.size))
                ids += [5, 5, 5]
        self.seen.append(tuple(refs))
        return ids, tuple(refs)


def test_a_vision_model_gets_imagerefs_through_every_protocol(app, demo_model_dir):
    from transformers import AutoTokenizer
    vision = FakeVision(AutoTokenizer.from_pretrained(demo_model_dir))
    client = app(vision=vision)
    url = data_url(png(5, 5))
    for path, (body, _field) in _bodies(url).items():
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.get_data(as_text=True))
    assert len(vision.seen) == 4
    hashes = {refs[0].key for refs in vision.seen}
    assert len(hashes) == 1 and all(refs[0].length == 3 and refs[0].data == (5, 5) for refs in vision.seen)
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in _bodies(url)["/v1/messages"][0].items()
                                                              if k != "max_tokens"})
    assert counted.status_code == 200 and len(vision.seen) == 5
