"""Guided (structured) decoding requests: `GuideSpec`, what a request constrains its output to, and
the checks that make a bad one a 400 naming its field before anything is compiled. No torch.

A spec is plain data (kind + canonical text) so that it hashes as a compile-cache key; the
grammar engine (handler/model/guided.py, xgrammar) compiles it and gives each sequence a matcher.
The LMI/vLLM/TGI request parameters that ask for one are parsed here (the parameter table in
handler/engine/request.py calls `PARAMETERS`); OpenAI's `response_format` and `tools` build specs
in handler/http/protocols/openai.py.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from handler.engine.errors import RequestError, show

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GUIDE_CHARS = 100_000           # a schema / regex / grammar's text at most

# JSON-schema keywords the grammar engine enforces, and those that only annotate; anything else
# (`not`, `if`, `uniqueItems`, `contains`, ...) would be silently unenforced: a 400 instead.
SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern",
    "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "format", "patternProperties", "propertyNames", "minProperties", "maxProperties",
    "unevaluatedProperties"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "nullable", "strict", "name"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class GuideSpec:
    """kind: json_schema (value: the schema as canonical JSON), json_object (any JSON object),
    regex, choice (value: a JSON list of strings), grammar (xgrammar's EBNF / GBNF).
    `field` names the request part it came from (errors); it is not part of the cache key."""
    kind: str
    value: str = ""
    field: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value


def _text(where: str, v, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise RequestError(where, f"must be a non-empty string ({what}), got {show(v)}")
    if len(v) > MAX_GUIDE_CHARS:
        raise RequestError(where, f"at most {MAX_GUIDE_CHARS} characters, got {len(v)}")
    return v


def _check_keywords(schema, where: str, depth: int = 0) -> None:
    if depth > 64:
        raise RequestError(where, "the schema is nested more than 64 levels deep")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise RequestError(where, f"must be a JSON schema (an object), got {show(schema)}")
    for k, v in schema.items():
        if k in ANNOTATIONS:
            continue
        if k not in SCHEMA_KEYWORDS:
            raise RequestError(where, f"JSON-schema keyword {show(k)} is not supported by guided decoding; "
                                      f"supported: {', '.join(sorted(SCHEMA_KEYWORDS))}")
        if k in _SUBSCHEMA_MAPS and isinstance(v, dict):
            for name, sub in v.items():
                _check_keywords(sub, f"{where}.{k}.{name}", depth + 1)
        elif k in _SUBSCHEMA_ONE and isinstance(v, (dict, bool)):
            _check_keywords(v, f"{where}.{k}", depth + 1)
        elif k in _SUBSCHEMA_LISTS and isinstance(v, list):
            for i, sub in enumerate(v):
                _check_keywords(sub, f"{where}.{k}[{i}]", depth + 1)


def json_schema(where: str, schema) -> GuideSpec:
    """A JSON schema (an object, or its JSON text) -> GuideSpec; a malformed schema or one with a
    keyword the engine cannot enforce is a 400 naming `where`."""
    if isinstance(schema, str):
        _text(where, schema, "a JSON schema")
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(where, f"is not valid JSON: {str(e)[:100]}") from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(where, f"must be a JSON schema (an object), got {show(schema)}")
    _check_keywords(schema, where)
    import jsonschema   # the meta-schema check (a malformed `type`, `required` not a list, ...)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise RequestError(where + at, f"is not a valid JSON schema: {e.message[:200]}") from None
    text = json.dumps(schema, ensure_ascii=False)     # key order kept: properties are generated in it
    if len(text) > MAX_GUIDE_CHARS:
        raise RequestError(where, f"the schema has more than {MAX_GUIDE_CHARS} characters")
    return GuideSpec("json_schema", text, where)


def json_object(where: str) -> GuideSpec:
    return GuideSpec("json_object", "", where)


def regex(where: str, v) -> GuideSpec:
    v = _text(where, v, "a regular expression")
    try:        # the engine's dialect is narrower; it names what it refuses at compile time
        re.compile(v)
    except re.error as e:
        raise RequestError(where, f"is not a valid regular expression: {e}") from None
    return GuideSpec("regex", v, where)


def choice(where: str, v) -> GuideSpec:
    if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
        raise RequestError(where, f"must be a non-empty list of non-empty strings, got {show(v)}")
    text = json.dumps(v, ensure_ascii=False)
    if len(text) > MAX_GUIDE_CHARS:
        raise RequestError(where, f"at most {MAX_GUIDE_CHARS} characters in all")
    return GuideSpec("choice", text, where)


def grammar(where: str, v) -> GuideSpec:
    return GuideSpec("grammar", _text(where, v, "an EBNF grammar"), where)


# ---- request parameters (LMI/vLLM `parameters`, TGI `parameters.grammar`) -> GuideSpec
def tgi_grammar(where: str, v) -> GuideSpec:
    """TGI: {"type": "json" | "regex", "value": schema | pattern} (also "json_object" with no value)."""
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise RequestError(where, f'must be {{"type": "json" | "regex", "value": ...}}, got {show(v)}')
    kind, value = v["type"], v.get("value")
    if kind == "json":
        return json_schema(f"{where}.value", value) if value not in (None, {}) else json_object(where)
    if kind == "json_object":
        return json_object(where)
    if kind == "regex":
        return regex(f"{where}.value", value)
    raise RequestError(f"{where}.type", f"must be one of json, regex, json_object; got {show(kind)}")


# vLLM's StructuredOutputsParams (`structured_outputs`), one constraint of these keys.
_STRUCTURED = {"json": json_schema, "regex": regex, "choice": choice, "grammar": grammar}
STRUCTURED_QUIET = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "whitespace_pattern", "backend", "structural_tag")


def structured_outputs(where: str, v) -> GuideSpec:
    if not isinstance(v, dict):
        raise RequestError(where, f"must be an object like {{\"json\": schema}}, got {show(v)}")
    found = []
    for k, x in v.items():
        if x is None or (k == "json_object" and x is False):     # a null (or json_object false) is absent
            continue
        if k in _STRUCTURED:
            found.append(_STRUCTURED[k](f"{where}.{k}", x))
        elif k == "json_object":
            if x is not True:
                raise RequestError(f"{where}.{k}", f"must be true or false, got {show(x)}")
            found.append(json_object(f"{where}.{k}"))
        elif k == "structural_tag":
            raise RequestError(f"{where}.{k}", "is not supported; use json, regex, choice or grammar")
        elif k not in STRUCTURED_QUIET:
            raise RequestError(f"{where}.{k}", "unknown key; use one of json, json_object, regex, choice, grammar")
    if len(found) != 1:
        raise RequestError(where, f"needs exactly one of json, json_object, regex, choice, grammar; got {len(found)}")
    return found[0]


# name -> check(field, value) -> GuideSpec, for the `parameters` table (vLLM's guided_* names,
# which LMI's vLLM backend passes through, and TGI's grammar).
PARAMETERS = {
    "guided_json": json_schema,
    "guided_regex": regex,
    "guided_choice": choice,
    "guided_grammar": grammar,
    "structured_outputs": structured_outputs,
    "grammar": tgi_grammar,
}
# Accepted and ignored: which backend (there is one) and its whitespace pattern.
QUIET_PARAMETERS = ("guided_decoding_backend", "guided_whitespace_pattern", "guided_options_request")
