"""OpenAI tool calling: `tools` + `tool_choice` -> how the chat is rendered and what constrains the
output; the output -> `message.tool_calls` (or tool-call deltas when streamed).

  none             the tools are not shown; a plain answer
  required         the output is a JSON list of {"name", "arguments"} (a grammar: at least one
                   call, each name one of the tools, each arguments valid for its parameters)
  {"function": f}  the output is f's arguments (a grammar: f's parameters schema)
  auto             the tools reach the chat template; calls are parsed from the output in the
                   format of option.tool_call_parser, or the one the template documents
                   (handler/http/protocols/tool_parsers.py: hermes, llama3_json, mistral, pythonic,
                   granite). A template with none (or more than one) is a 400 unless the option names
                   the format; option.enable_auto_tool_choice=false refuses `auto` (as vLLM without it).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from handler.engine import guide
from handler.engine.errors import RequestError, show
from handler.http.protocols import tool_parsers

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclass
class Tools:
    """A request's tools as the protocol uses them; `choice`: none | auto | required | named."""
    functions: list[dict] = field(default_factory=list)   # [{"name", "description"?, "parameters"}]
    choice: str = "none"
    name: str | None = None          # the named function (choice == "named")
    fmt: str | None = None           # auto: the call format (tool_parsers.FAMILIES)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    @property
    def active(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict] | None:
        """What apply_chat_template(tools=...) gets (OpenAI's shape)."""
        if not self.active:
            return None
        fns = [f for f in self.functions if self.choice != "named" or f["name"] == self.name]
        return [{"type": "function", "function": f} for f in fns]


@dataclass(frozen=True)
class Options:
    """The server's tool settings (option.tool_call_parser, option.enable_auto_tool_choice)."""
    parser: str = "auto"         # a tool_parsers family, or auto (from the template)
    enable_auto: bool = True


def template_format(tokenizer, parser: str = "auto") -> str | None:
    """The tool-call format: the configured family, else the one the chat template documents."""
    if parser != "auto":
        return parser
    tpl = getattr(tokenizer, "chat_template", None)
    tpl = tpl if isinstance(tpl, str) else json.dumps(tpl or "")
    return tool_parsers.detect(tpl)


def parse(payload: dict, tokenizer, options: Options = Options()) -> Tools:
    raw = payload.get("tools")
    choice = payload.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice", f"needs `tools`, got {show(choice)}")
        return Tools()
    if not isinstance(raw, list):
        raise RequestError("tools", f"must be a list of {{\"type\": \"function\", \"function\": ...}}, got {show(raw)}")
    fns = []
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError(where, f'must be {{"type": "function", "function": {{"name", "parameters"}}}}, '
                                      f'got {show(t)}')
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise RequestError(f"{where}.function.name", f"must be 1-64 letters, digits, _ . : or -, got {show(name)}")
        if name in (g["name"] for g in fns):
            raise RequestError(f"{where}.function.name", f"{show(name)} is listed twice")
        params = f.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        guide.json_schema(f"{where}.function.parameters", params)      # a 400 here, not at compile
        fn = {"name": name, "parameters": params}
        if isinstance(f.get("description"), str):
            fn["description"] = f["description"]
        fns.append(fn)
    tools = Tools(fns)
    if choice is None or choice == "auto":
        tools.choice = "auto"
        if not options.enable_auto:
            raise RequestError("tool_choice", "\"auto\" is off on this server (option.enable_auto_tool_choice="
                                              "false): use \"required\", {\"type\": \"function\", \"function\": "
                                              "{\"name\": ...}} or \"none\"")
        tools.fmt = template_format(tokenizer, options.parser)
        if tools.fmt is None:
            raise RequestError("tool_choice", "\"auto\" needs a tool-call format: set option.tool_call_parser ("
                                              + ", ".join(tool_parsers.FAMILIES) + "); this model's chat template "
                                              "documents none (or several). Or use tool_choice \"required\" "
                                              "or {\"type\": \"function\", \"function\": {\"name\": ...}} (the "
                                              "output is then constrained to a call), or \"none\"")
    elif choice in ("none", "required"):
        tools.choice = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) \
            and choice.get("type", "function") == "function":
        name = choice["function"].get("name")
        if name not in [f["name"] for f in fns]:
            raise RequestError("tool_choice.function.name", f"must name one of the tools "
                                                            f"({', '.join(f['name'] for f in fns)}), got {show(name)}")
        tools.choice, tools.name = "named", name
    else:
        raise RequestError("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", '
                                          f'"function": {{"name": ...}}}}, got {show(choice)}')
    return tools


def constraint(tools: Tools) -> guide.GuideSpec | None:
    """The grammar that forces the call(s) (required, named), or None."""
    if tools.choice == "named":
        fn = next(f for f in tools.functions if f["name"] == tools.name)
        return guide.json_schema("tools.function.parameters", fn["parameters"])
    if tools.choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"]} for f in tools.functions]
        schema = {"type": "array", "minItems": 1,
                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return guide.json_schema("tools", schema)
    return None


def call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": args}}


def parse_output(tools: Tools, text: str) -> tuple[str | None, list[dict]]:
    """The model's text -> (content, tool calls). Output that is not a complete call (cut by
    max_tokens) stays content, with no calls."""
    if tools.choice == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [call(tools.name, text)]
    if tools.choice == "required":
        try:
            items = json.loads(text)
            return None, [call(c["name"], c["arguments"]) for c in items]
        except (ValueError, TypeError, KeyError):
            return text, []
    if tools.choice == "auto" and tools.fmt is not None:
        got = tool_parsers.parse(tools.fmt, text, tools.names)
        if got is not None:
            content, calls = got
            return content, [call(c["name"], c["arguments"]) for c in calls]
    return text, []


class Streamer:
    """One choice's streamed deltas under tools: content as it comes (auto, until a call may
    begin), a named call's arguments token by token, other calls whole at the end."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""          # everything generated
        self.sent = 0           # chars of `text` sent as content (auto) or arguments (named)
        self.started = False    # named: the call's head has been sent

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        t = self.tools
        if t.choice == "named":
            out = []
            if not self.started:
                self.started = True
                self.id = call(t.name, "")["id"]
                out.append({"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                            "function": {"name": t.name, "arguments": ""}}]})
            if piece:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if t.choice == "auto":      # content up to where a call may begin, the rest held
            end = tool_parsers.call_start(t.fmt, self.text) if t.fmt else len(self.text)
            new = self.text[self.sent:end] if end > self.sent else ""
            self.sent = max(self.sent, end)
            return [{"content": new}] if new else []
        return []               # required: the calls come whole at the end

    def finish(self) -> tuple[list[dict], bool]:
        """The last deltas and whether calls were made."""
        t = self.tools
        if t.choice == "named":
            try:
                json.loads(self.text)
                return [], True
            except ValueError:
                return [], False
        content, calls = parse_output(t, self.text)
        out = []
        if calls:
            if t.choice == "auto":
                rest = self.text[self.sent:tool_parsers.call_start(t.fmt, self.text)]
                if rest.strip():
                    out.append({"content": rest})
            for i, c in enumerate(calls):        # OpenAI's shape: id, type and name, then the arguments
                out.append({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                            "function": {"name": c["function"]["name"], "arguments": ""}}]})
                out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
            return out, True
        rest = self.text[self.sent:]
        return ([{"content": rest}] if rest else []), False
