"""option.chat_template (a file or the text; vLLM's --chat-template, LMI's vllm_rb_properties.chat_template),
option.chat_template_content_format, a request's own chat_template, and the tool/reasoning parser names LMI
users pass (LMI docs: tool_calling.md asks for a template; vLLM's parser names)."""
from __future__ import annotations


import pytest

from handler.config import ConfigError, load_config
from handler.engine.request import RequestError
from handler.http.protocols import openai
from tests.config.test_config import model_dir  # noqa: F401  (the fixture: a directory that passes the checks)
from tests.support.server import Server

# A template that loops over OpenAI content parts (as multimodal templates do) and one that takes text.
PARTS = ("{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}[{{ p.text }}]{% endfor %}"
         "{% endfor %}<assistant>")
TEXT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


@pytest.fixture
def load(tmp_path, model_dir):
    def _load(text: str, **kw):
        p = tmp_path / "serving.properties"
        p.write_text(text)
        return load_config(str(p), model_dir, env={}, gpu_count=0, **kw)
    return _load


def test_template_from_a_file_or_the_text(load, tmp_path):
    (tmp_path / "tpl.jinja").write_text(TEXT)
    assert load("option.chat_template=tpl.jinja\n").chat_template == TEXT          # beside the properties file
    assert load(f"option.chat_template={tmp_path / 'tpl.jinja'}\n").chat_template == TEXT
    assert load(f"option.chat_template={TEXT}\n").chat_template == TEXT
    assert load("option.rolling_batch=auto\n").chat_template is None


def test_bad_templates_stop_the_start_in_one_line(load):
    with pytest.raises(ConfigError) as e:
        load("option.chat_template=templates/absent.jinja\n")
    assert "option.chat_template=templates/absent.jinja is neither a file" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load("option.chat_template={% for m in messages %}{{ m.content }\n")
    assert "template line 1:" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given, parser", [("llama4_json", "llama3_json"), ("qwen3_xml", "qwen3_coder"),
                                           ("llama4_pythonic", "pythonic"), ("hermes", "hermes")])
def test_vllm_tool_parser_names(given, parser, load):
    assert load(f"option.tool_call_parser={given}\n").tool_call_parser == parser


@pytest.mark.parametrize("key, value", [("option.tool_call_parser", "deepseek_v3"),
                                        ("option.reasoning_parser", "granite")])
def test_parsers_we_lack_are_refused_with_our_list(key, value, load):
    with pytest.raises(ConfigError) as e:
        load(f"{key}={value}\n")
    assert f"{key}={value} is not supported; allowed: " in str(e.value)


def test_enable_reasoning(load):
    assert load("option.reasoning_parser=qwen3\noption.enable_reasoning=true\n").reasoning_parser == "qwen3"
    assert load("option.reasoning_parser=qwen3\noption.enable_reasoning=false\n").reasoning_parser == "none"
    with pytest.raises(ConfigError) as e:
        load("option.enable_reasoning=true\n")
    assert "needs option.reasoning_parser; allowed: deepseek_r1, qwen3" in str(e.value)


class Tok:
    """Renders with transformers' own chat-template code (the tokenizer's apply_chat_template)."""
    def __init__(self, template):
        from transformers.utils.chat_template_utils import render_jinja_template
        self.chat_template, self._render = template, render_jinja_template

    def apply_chat_template(self, msgs, tools=None, tokenize=False, add_generation_prompt=True,
                            chat_template=None, **kw):
        out, _ = self._render([msgs], tools=tools, chat_template=chat_template or self.chat_template,
                              add_generation_prompt=add_generation_prompt, **kw)
        return out[0]


def test_content_format():
    assert openai.content_format(PARTS) == "openai" and openai.content_format(TEXT) == "string"
    assert openai.render_chat(Tok(PARTS), MESSAGES) == "<user>[a][b]<assistant>"
    assert openai.render_chat(Tok(TEXT), MESSAGES) == "<user>a\nb<assistant>"        # LMI joins the parts
    assert openai.render_chat(Tok(TEXT), MESSAGES, fmt="openai").startswith("<user>[{")
    assert openai.render_chat(Tok(PARTS), [{"role": "user", "content": "x"}]) == "<user>[x]<assistant>"


def test_a_request_brings_its_own_template(demo_model_factory):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(demo_model_factory("llama"))
    g = openai.parse_chat({"messages": [{"role": "user", "content": "hi"}], "chat_template": TEXT}, tok)
    assert g.prompts == ["<user>hi<assistant>"]
    assert openai.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tok).prompts != g.prompts
    with pytest.raises(RequestError) as e:
        openai.parse_chat({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ raise_exception('no') }}"},
                          tok)
    assert e.value.field == "chat_template"
    with pytest.raises(RequestError) as e:
        openai.parse_chat({"messages": [{"role": "user", "content": "hi"}], "chat_template": 5}, tok)
    assert e.value.field == "chat_template"


@pytest.mark.slow
def test_served_model_renders_with_option_chat_template(demo_model_factory, tmp_path):
    (tmp_path / "tpl.jinja").write_text(TEXT)
    srv = Server(f"option.chat_template={tmp_path / 'tpl.jinja'}\noption.max_model_len=128\n",
                 demo_model_factory("llama"), tmp_path)
    try:
        import requests
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(demo_model_factory("llama"))
        r = requests.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tok("<user>hi<assistant>", add_special_tokens=False)["input_ids"]
        r = srv.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        want = len(tok("<user>hi<assistant>", add_special_tokens=False)["input_ids"])
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == want
    finally:
        srv.stop()
