"""Schemathesis hooks for tests/http/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

Every check runs. One kind of failure is dropped: positive_data_acceptance's, when the server refused a
body the document calls valid for a rule across fields that JSON Schema cannot state (a comparison
between two values, or what the loaded model's chat template takes); docs/API.md "Rules across fields"
lists them. A failure is dropped only when BOTH hold:
  - the answer is a 400/422 whose text carries the rule's own message (the field it names included), and
  - the body sent really breaks that rule (each rule's predicate below reads the body itself),
so a refusal that merely looks like one of these, or one of them for a body that keeps the rule, still
fails the run. The rules that JSON Schema can state are in the document instead (handler/http/protocols/
openapi.py: top_logprobs needs logprobs, max_tokens 0 needs echo or prompt_logprobs and no stream,
chat_template_kwargs' names). Each rule is also tested with its 4xx in tests/http."""
from __future__ import annotations

import os
import re
from typing import Any, Callable

import schemathesis
from schemathesis.core.failures import Failure

MAX_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens")


def _params(body: dict) -> dict:
    """Where a route keeps its sampling fields: LMI/TGI's `parameters`, or the body itself."""
    p = body.get("parameters")
    return p if isinstance(p, dict) else body


def _num(v) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _min_over_max(path: str, body: dict, text: str) -> bool:
    """The message carries both numbers: min_tokens the body's, the max the body's (or the default)."""
    m = re.search(r"must be <= max_new_tokens \((\d+)\), got (\d+)", text)
    if not m:
        return False
    top, low = int(m.group(1)), int(m.group(2))
    p = _params(body)
    asked = [_num(p.get(k)) for k in MAX_FIELDS if _num(p.get(k)) is not None]
    return low > top and _num(p.get("min_tokens")) == low and (top in asked or not asked)


def _best_of_streamed(path: str, body: dict, text: str) -> bool:
    p = _params(body)
    best_of = _num(p.get("best_of"))
    streamed = path == "/generate_stream" or body.get("stream") is True
    return streamed and best_of is not None and best_of != (_num(p.get("n")) or 1)


def _adapters_per_input(path: str, body: dict, text: str) -> bool:
    names, inputs = body.get("adapters"), body.get("inputs")
    n = len(inputs) if isinstance(inputs, list) else 1
    return isinstance(names, list) and (len(names) != n or len(set(names)) > 1)


def _too_long(path: str, body: dict, text: str) -> bool:
    """prompt tokens + max tokens beyond the model's length (the tokenizer counts the prompt: the message
    carries the counts, checked to add up and to be the body's max tokens, or the route's default)."""
    m = re.search(r"prompt \((\d+) tokens\) \+ \w+ \((\d+)\) exceeds this model's (\d+) tokens", text)
    if m:
        prompt, top, cap = map(int, m.groups())
        p = _params(body)
        asked = [_num(p.get(k)) for k in MAX_FIELDS if _num(p.get(k)) is not None]
        return prompt + top > cap and (top in asked or not asked)
    m = re.search(r"the prompt has (\d+) tokens; this model allows at most (\d+) prompt tokens", text)
    return bool(m) and int(m.group(1)) > int(m.group(2))


def _template(path: str, body: dict, text: str) -> bool:
    """The loaded model's chat template decides the roles and orders it takes (it raises on the others)."""
    return isinstance(body.get("messages"), list)


def _answers_no_call(path: str, body: dict, text: str) -> bool:
    """A tool_result / function_call_output whose id no tool_use / function_call of the body carries."""
    calls, results = set(), []

    def walk(node):
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "tool_use" or kind == "function_call":
                calls.add(node.get("id") if kind == "tool_use" else node.get("call_id"))
            elif kind == "tool_result" or kind == "function_call_output":
                results.append(node.get("tool_use_id") if kind == "tool_result" else node.get("call_id"))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(body)
    return any(r not in calls for r in results)


def _tool_choice(path: str, body: dict, text: str) -> bool:
    """A tool choice other than none (tools without one: auto) with tools, or one without tools."""
    choice = body.get("tool_choice")
    none = choice in ("none", {"type": "none"})
    return (bool(body.get("tools")) and not none) or (choice is not None and not none and not body.get("tools"))


def _no_message(path: str, body: dict, text: str) -> bool:
    return path == "/v1/responses" and isinstance(body.get("input"), list)


# The fields holding a constraint in its own language (a JSON schema, a regular expression, a grammar)
LANGUAGE_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "grammar", "structured_outputs",
                   "response_format", "text", "tools")
CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar", "structured_outputs")


def named_field(text: str) -> str:
    """The field an error names, in any of the protocols' shapes (handler/http/protocols/*.error_body)."""
    import json
    try:
        err = json.loads(text)
    except ValueError:
        return ""
    inner = err.get("error") if isinstance(err, dict) else None
    if isinstance(inner, dict) and inner.get("param"):
        return inner["param"]                                   # OpenAI's
    if isinstance(err, dict) and err.get("field"):
        return err["field"]                                     # LMI's
    message = inner.get("message") if isinstance(inner, dict) else inner   # Anthropic's, TGI's: "field: ..."
    return message.split(": ", 1)[0] if isinstance(message, str) else ""


def _constraint_language(path: str, body: dict, text: str) -> bool:
    """The compiler's word on a schema / regex / grammar: the error names a constraint field the body sets."""
    field = named_field(text).removeprefix("parameters.")
    top = re.split(r"[.\[]", field, maxsplit=1)[0]
    return top in LANGUAGE_FIELDS and _params(body).get(top, body.get(top)) is not None


def _two_constraints(path: str, body: dict, text: str) -> bool:
    p = _params(body)
    asked = [k for k in CONSTRAINTS if p.get(k) is not None]
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        asked.append("response_format")
    if body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict):
        asked.append("tool_choice")
    return len(asked) > 1


# (rule, the field its error names, the server's message for it, the body breaks it)
RULES: list[tuple[str, str, re.Pattern, Callable[[str, dict, str], bool]]] = [
    ("min_tokens over the max tokens", r"(parameters\.)?min_tokens", re.compile(r"must be <= max_new_tokens"),
     _min_over_max),
    ("best_of with stream", r"(parameters\.)?best_of",
     re.compile(r"cannot be used with stream|not allowed when streaming"), _best_of_streamed),
    ("LMI adapters: one name per input, one adapter per request", r"adapters",
     re.compile(r"one name per input|one adapter per request"), _adapters_per_input),
    ("prompt + max tokens beyond the model's length", r"inputs|prompt|messages|input|.*max_\w*tokens",
     re.compile(r"exceeds this model's \d+ tokens|this model allows at most \d+ prompt tokens"), _too_long),
    ("roles and order the chat template takes", r"messages|chat_template|input",
     re.compile(r"the chat template refused these messages"), _template),
    ("a tool result answers an earlier call", r"(messages|input).*(tool_use_id|call_id)",
     re.compile(r"names no tool_use block|names no earlier function_call"), _answers_no_call),
    ("tool_choice needs the tools it names", r"tool_choice.*",
     re.compile(r"needs `tools`|must name one of the tools|needs a tool-call format"), _tool_choice),
    ("a Responses input needs a message", r"input", re.compile(r"holds no message to answer"), _no_message),
    ("a constraint's own language (the compiler decides)", r".+",
     re.compile(r"not supported by guided decoding|is not valid JSON|must be a JSON schema|is not a valid JSON "
                r"schema|is not a valid regular expression|cannot be compiled for guided decoding|nested more "
                r"than 64 levels"), _constraint_language),
    ("one output constraint per request", r".+", re.compile(r"one output constraint per request"),
     _two_constraints),
]


def excused(path: str, body: Any, status: int, text: str) -> str | None:
    """The rule a refusal of `body` at `path` is excused by, or None."""
    if status not in (400, 422) or not isinstance(body, dict):
        return None
    text = text or ""
    field = named_field(text)
    for name, names, message, broken in RULES:
        if re.fullmatch(names, field) and message.search(text) and broken(path, body, text):
            return name
    return None


# /invocations on the `current` line (option.lmi_compat) reads numbers and flags as vLLM's lax pydantic
# models do ("50" and 50.0 for an integer, "0.5" for a number, 0 / "true" / "yes" for a flag): a body the
# document calls invalid only for such a value is one it accepts on purpose (docs/API.md)
_LAX_FLAGS = {"0": False, "1": True, "true": True, "false": False, "yes": True, "no": False, "on": True,
              "off": False, "t": True, "f": False, "y": True, "n": False}
_LAX_NUMBER = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _lax(value, schema: dict):
    """value as the lax line reads it for a property of `schema` (its non-null alternative's type)."""
    kinds = {a.get("type") for a in schema.get("anyOf", [schema])}
    if "boolean" in kinds and isinstance(value, (int, str)) and not isinstance(value, bool):
        key = str(value).strip().lower()
        return _LAX_FLAGS.get(key, value)
    if kinds & {"integer", "number"} and isinstance(value, str) and _LAX_NUMBER.fullmatch(value):
        number = float(value)
        return int(number) if "integer" in kinds and number.is_integer() else number
    if kinds & {"integer", "number"} and isinstance(value, bool):
        return int(value)
    if "integer" in kinds and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def lax_valid(doc: dict, body) -> bool:
    """Whether an /invocations body, its parameters read as the lax line reads them, is valid."""
    from jsonschema import Draft202012Validator
    if not isinstance(body, dict) or not isinstance(body.get("parameters"), dict):
        return False
    props = doc["components"]["schemas"]["Parameters"]["properties"]
    params = {k: _lax(v, props[k]) if k in props else v for k, v in body["parameters"].items()}
    v = Draft202012Validator({"$ref": "#/components/schemas/LMIRequest", "components": doc["components"]})
    return v.is_valid({**body, "parameters": params})


@schemathesis.hook
def filter_failure(context, failure: Failure, case, response) -> bool:
    """Keep every failure but a positive_data_acceptance one that a rule across fields excuses (each
    excused one is appended to the file LMI_FUZZ_EXCUSED names, when set: rule, path, field)."""
    path = getattr(case, "path", None) or case.operation.path
    if type(failure).__name__ == "AcceptedNegativeData" and path == "/invocations":
        body = case.body if isinstance(case.body, dict) else {}
        if body.get("messages") is not None or body.get("prompt") is not None:
            # another API's body (routes/sagemaker.py dispatches chat and completions bodies by shape;
            # the document states LMI's shape only, and those APIs are fuzzed on their own routes)
            return False
        return not lax_valid(case.operation.schema.raw_schema, case.body)
    if type(failure).__name__ != "RejectedPositiveData":
        return True
    rule = excused(path, case.body, response.status_code, response.text)
    if rule is not None and os.environ.get("LMI_FUZZ_EXCUSED"):
        with open(os.environ["LMI_FUZZ_EXCUSED"], "a") as f:
            f.write(f"{rule}\t{path}\t{named_field(response.text or '')}\n")
    return rule is None
