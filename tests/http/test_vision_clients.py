"""Real clients against a real server of the tiny LLaVA (gunicorn, loopback): the `openai` SDK sends
a base64 PNG and gets transformers' greedy answer; the same image's second request skips the encoder
(/metrics: images encoded unchanged, a cache hit more); the `anthropic` SDK's image block and LMI's
chat on /invocations give the same answer; a text-only server refuses the image (400)."""
from __future__ import annotations

import base64

import pytest
import requests

from tests.model.test_vision import hf_greedy, png, url
from tests.support.server import Server, flat_metrics

pytestmark = pytest.mark.slow

# No prefix caching: a repeated image's blocks would be found there and the encoder not even asked; here
# the encoder cache is what spares the second run.
PROPS = "option.rolling_batch=auto\noption.max_rolling_batch_size=4\noption.kv_cache_tokens=2048\n"
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def server(llava_model_dir, tmp_path_factory):
    srv = Server(PROPS, llava_model_dir, tmp_path_factory.mktemp("vlm"))
    yield srv
    srv.stop()


def _encoder(srv) -> tuple[float, float]:
    m = flat_metrics(requests.get(srv.url + "/metrics", timeout=30).text)
    pick = lambda name: next(v for k, v in m.items() if k.startswith(name))     # noqa: E731
    return pick("lmi_encoder_images_total"), pick("lmi_encoder_cache_hits_total")


def _want(model_dir, n) -> str:
    from transformers import AutoTokenizer
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(1)}},
                                         {"type": "text", "text": QUESTION}]}]
    ids = hf_greedy(model_dir, msgs, n)[1]
    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def test_openai_sdk_sends_a_png_and_the_repeat_skips_the_encoder(server, llava_model_dir):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url(1), "detail": "low"}},
        {"type": "text", "text": QUESTION}]}]
    r = client.chat.completions.create(model="llava", messages=messages, temperature=0, max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == _want(llava_model_dir, 8)
    assert r.usage.prompt_tokens > 16           # the image's 16 tokens are in the prompt
    encoded, hits = _encoder(server)
    assert encoded >= 1
    again = client.chat.completions.create(model="llava", messages=messages, temperature=0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == r.choices[0].message.content
    assert _encoder(server) == (encoded, hits + 1)      # encoded once: the second came from the cache
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="llava", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert e.value.body["param"] == "messages[0].content[0]" and "option.allow_remote_images" in e.value.body["message"]
    assert "messages[0].content[0]" in str(e.value)     # what the SDK shows names the part as well


def test_anthropic_sdk_and_lmi_chat_take_the_same_image(server, llava_model_dir):
    import anthropic
    want = _want(llava_model_dir, 6)
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    m = claude.messages.create(model="llava", max_tokens=6, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png(1)).decode()}},
        {"type": "text", "text": QUESTION}]}], extra_body={"ignore_eos": True})
    # greedy (the model's generation config: the SDK sends no temperature); ignore_eos is not a Messages
    # field: the answer may end at EOS, so it is a prefix
    assert want.startswith(m.content[0].text) and m.content[0].text
    r = server.post({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(1)}},
                                                               {"type": "text", "text": QUESTION}]}],
                     "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


def test_a_text_only_server_refuses_images(demo_model_dir, tmp_path):
    srv = Server("option.rolling_batch=auto\n", demo_model_dir, tmp_path)
    try:
        r = requests.post(srv.url + "/v1/chat/completions", timeout=60, json={"max_tokens": 3, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": url(1)}}]}]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[0].content[1]" and "text only" in r.json()["error"]["message"]
    finally:
        srv.stop()
