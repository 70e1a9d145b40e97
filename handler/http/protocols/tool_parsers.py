"""Tool-call parsers: a model's text -> (content, calls), one plain function per format family.

Each family's format, as its model card / chat template documents it:

  hermes       Qwen2.5 / Qwen3 / Hermes: `<tool_call>\n{"name": f, "arguments": {...}}\n</tool_call>`, one block
               per call. Small Qwen models also write the same object bare, or in a ```json fence, without
               the tags: taken as calls only when the whole answer is such objects naming declared tools.
  llama3_json  Llama 3.1-3.3: `<|python_tag|>` (optional) then `{"name": f, "parameters": {...}}`, several
               separated by `;`.
  mistral      Mistral: `[TOOL_CALLS][{"name": f, "arguments": {...}}, ...]`; tokenizer v11+:
               `[TOOL_CALLS]f[ARGS]{...}` per call.
  pythonic     Llama 3.2 / Llama 4: `[f(a=1, b="x"), g()]` (Llama 4 may wrap it in <|python_start|> ..
               <|python_end|>); parsed with `ast`, values must be literals (never evaluated).
  granite      Granite 3.x: `<|tool_call|>[{"name": f, "arguments": {...}}]`.
  qwen3_coder  Qwen3-Coder: `<tool_call>\n<function=f>\n<parameter=a>\nvalue\n</parameter>\n</function>\n</tool_call>`;
               a value is JSON when it parses as JSON, else the text.

A parser returns None when the text holds no call (it is all content), else (content before the
calls or None, [{"name", "arguments"}]) with arguments as a JSON object. A malformed call is no
call: the text stays content.
"""
from __future__ import annotations

import ast
import json
import re

FAMILIES = ("hermes", "llama3_json", "mistral", "pythonic", "granite", "qwen3_coder")

Parsed = tuple  # (content | None, [{"name": str, "arguments": dict}])

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)


def _obj_call(obj, args_keys=("arguments", "parameters")) -> dict | None:
    """{"name": f, "arguments"|"parameters": {...} or its JSON text} -> a call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


def _calls(items) -> list[dict] | None:
    items = items if isinstance(items, list) else [items]
    out = [_obj_call(x) for x in items]
    return out if out and all(out) else None


def _content(text: str) -> str | None:
    return text.strip() or None


def _json_values(text: str, sep: str = "") -> list | None:
    """Consecutive JSON values in `text` (whitespace or `sep` between them), or None."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i == len(text):
            return out or None
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


def hermes(text: str, names=None) -> Parsed | None:
    if "<tool_call>" in text:
        calls = []
        for body in _HERMES.findall(text):
            c = _obj_call(_loads(body))
            if c is None:
                return None
            calls.append(c)
        return (_content(text[:text.index("<tool_call>")]), calls) if calls else None
    return bare_json(text, names)


def bare_json(text: str, names=None) -> Parsed | None:
    """The whole answer is a call object, a list of them, or one of these in a ```json fence; every
    call names a declared tool (else it is an answer that happens to be JSON)."""
    body = text.strip()
    m = _FENCE.match(body)
    if m:
        body = m.group(1).strip()
    if not body.startswith(("{", "[")):
        return None
    values = _json_values(body)
    if values is None:
        return None
    calls = _calls([c for v in values for c in (v if isinstance(v, list) else [v])])
    if calls is None or (names is not None and any(c["name"] not in names for c in calls)):
        return None
    return None, calls


def llama3_json(text: str, names=None) -> Parsed | None:
    tag = "<|python_tag|>"
    if tag in text:
        head, body = text[:text.index(tag)], text[text.index(tag) + len(tag):]
    else:
        head, body = "", text.strip()
        if not body.startswith("{"):
            return None
    values = _json_values(body.strip(), sep=";")
    calls = _calls(values) if values else None
    if calls is None or (tag not in text and names is not None and any(c["name"] not in names for c in calls)):
        return None
    return _content(head), calls


def mistral(text: str, names=None) -> Parsed | None:
    tag = "[TOOL_CALLS]"
    if tag not in text:
        return None
    head, rest = text[:text.index(tag)], text[text.index(tag):]
    calls = []
    for part in rest.split(tag)[1:]:
        part = part.strip()
        if "[ARGS]" in part:                 # v11: name[ARGS]{...}
            name, _, args = part.partition("[ARGS]")
            c = _obj_call({"name": name.strip(), "arguments": _loads(args)})
            if c is None:
                return None
            calls.append(c)
            continue
        values = _json_values(part)
        got = _calls([c for v in values for c in (v if isinstance(v, list) else [v])]) if values else None
        if got is None:
            return None
        calls += got
    return (_content(head), calls) if calls else None


def pythonic(text: str, names=None) -> Parsed | None:
    body = text.strip()
    for a, b in (("<|python_start|>", "<|python_end|>"),):
        if body.startswith(a):
            body = body[len(a):].removesuffix(b).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if len(args) != len(node.keywords):
            return None
        calls.append({"name": node.func.id, "arguments": args})
    return None, calls


def granite(text: str, names=None) -> Parsed | None:
    for tag in ("<|tool_call|>", "<tool_call>"):
        if tag in text:
            head, body = text[:text.index(tag)], text[text.index(tag) + len(tag):]
            values = _json_values(body.strip())
            calls = _calls([c for v in values for c in (v if isinstance(v, list) else [v])]) if values else None
            return (_content(head), calls) if calls else None
    return None


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def qwen3_coder(text: str, names=None) -> Parsed | None:
    if "<tool_call>" not in text:
        return None
    calls = []
    for block in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.DOTALL):
        fns = _XML_FUNCTION.findall(block)
        if len(fns) != 1:
            return None
        name, body = fns[0]
        args = {}
        for key, value in _XML_PARAMETER.findall(body):
            got = _loads(value)
            args[key] = value if got is None and value.strip() != "null" else got
        calls.append({"name": name, "arguments": args})
    return (_content(text[:text.index("<tool_call>")]), calls) if calls else None


def _loads(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return None


PARSERS = {"hermes": hermes, "llama3_json": llama3_json, "mistral": mistral, "pythonic": pythonic,
           "granite": granite, "qwen3_coder": qwen3_coder}

# Where a call may begin: content before it streams, the rest is held until it parses.
# (marker, only at the start of the answer)
STARTS = {
    "hermes": (("<tool_call>", False), ("{", True), ("[", True), ("```", True)),
    "llama3_json": (("<|python_tag|>", False), ("{", True)),
    "mistral": (("[TOOL_CALLS]", False),),
    "pythonic": (("[", True), ("<|python_start|>", True)),
    "granite": (("<|tool_call|>", False), ("<tool_call>", False)),
    "qwen3_coder": (("<tool_call>", False),),
}
# Markers that are special tokens in their tokenizers: the text must keep them.
SPECIAL_MARKERS = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>",
                   "pythonic": "<|python_start|>"}


def parse(family: str, text: str, names=None) -> Parsed | None:
    return PARSERS[family](text, names)


def call_start(family: str, text: str) -> int:
    """Where a call begins in `text` (len(text) if none yet), a partial marker at the end included."""
    best = len(text)
    lead = len(text) - len(text.lstrip())
    for marker, at_start in STARTS[family]:
        if at_start:
            rest = text[lead:]
            if rest and (rest.startswith(marker) or marker.startswith(rest)):
                best = min(best, lead)
            continue
        i = text.find(marker)
        if i >= 0:
            best = min(best, i)
            continue
        k = next((k for k in range(len(marker) - 1, 0, -1) if text.endswith(marker[:k])), 0)
        if k:
            best = min(best, len(text) - k)
    if not text.strip():
        return 0                          # whitespace only: wait for the first visible character
    return best


# What a chat template says about its call format (exactly one family, or no detection).
_TEMPLATE_SIGNS = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>", "dictionary of argument name and its value"),
    "mistral": ("[TOOL_CALLS]",),
    "pythonic": ("[func_name1(", "<|python_start|>"),
    "granite": ("<|tool_call|>",),
    "qwen3_coder": ("<function=",),
}


def detect(template: str) -> str | None:
    """The family a chat template documents, when exactly one matches (hermes's `<tool_call>` is
    also granite's older tag: granite's own `<|tool_call|>` wins)."""
    if "tools" not in template:
        return None
    found = {f for f, signs in _TEMPLATE_SIGNS.items() if any(s in template for s in signs)}
    if "granite" in found or "qwen3_coder" in found:
        found.discard("hermes")          # their templates show <tool_call> too
    if "pythonic" in found and "llama3_json" in found:
        found.discard("llama3_json")     # Llama 4 / 3.2-pythonic templates keep <|python_tag|> text
    return found.pop() if len(found) == 1 else None
