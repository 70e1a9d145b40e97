"""vLLM's token routes (POST /tokenize, /detokenize, also under /v1/): count a prompt's tokens
before sending it.

  /tokenize    {"prompt": str, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt":
               true, "tools"?, "chat_template_kwargs"?} (the chat template renders them; its special
               tokens are in the text) -> {"tokens": [ids], "count": n, "max_model_len": m}
  /detokenize  {"tokens": [ids]} -> {"prompt": text}
  GET /tokenizer_info  the tokenizer's special tokens, chat template and limits, as vLLM answers it
               (lm-evaluation-harness's local-completions then tokenizes through the two routes above,
               with no copy of the tokenizer on the client)
"""
from __future__ import annotations

from handler.engine.request import MAX_TOKEN_ID, RequestError, show
from handler.http.protocols import openai, tools as tooling

MAX_TOKENS = 1 << 20


def tokenize(body, tokenizer, max_model_len: int, server: openai.ServerOptions) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("prompt", 'send exactly one of "prompt" (a string) and "messages" (a chat)')
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("prompt", f"must be a string, got {show(prompt)}")
        special = body.get("add_special_tokens", True)
    else:
        choice = "required" if body.get("tools") else "none"      # the tools reach the template as given
        tools = tooling.parse({"tools": body.get("tools"), "tool_choice": choice}, tokenizer, server.tools)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs", f"must be a JSON object, got {show(kwargs)}")
        prompt = openai.render_chat(tokenizer, body["messages"], tools.template_tools(), kwargs,
                                    fmt=server.content_format)
        special = body.get("add_special_tokens", False)
    if not isinstance(special, bool):
        raise RequestError("add_special_tokens", f"must be true or false, got {show(special)}")
    ids = tokenizer(prompt, add_special_tokens=special)["input_ids"]
    return {"tokens": list(ids), "count": len(ids), "max_model_len": max_model_len}


def detokenize(body, tokenizer) -> dict:
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    ids = body.get("tokens")
    vocab = len(tokenizer)
    if not isinstance(ids, list) or len(ids) > MAX_TOKENS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise RequestError("tokens", f"must be a list of token ids (non-negative integers), got {show(ids)}")
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise RequestError("tokens", f"token id {bad} is not in this model's vocabulary (0..{vocab - 1})")
    return {"prompt": tokenizer.decode(ids)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """vLLM's /tokenizer_info fields: the special tokens as strings, the chat template, the limits."""
    def text(name):
        tok = getattr(tokenizer, name, None)
        return tok if isinstance(tok, str) else None
    template = getattr(tokenizer, "chat_template", None)
    return {"tokenizer_class": type(tokenizer).__name__,
            "eos_token": text("eos_token"), "bos_token": text("bos_token"), "pad_token": text("pad_token"),
            "unk_token": text("unk_token"), "chat_template": template if isinstance(template, str) else None,
            "model_max_length": max_model_len, "vocab_size": len(tokenizer),
            "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False))}
