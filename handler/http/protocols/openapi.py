"""GET /openapi.json: the generation routes' request bodies, from the declared models; the pooling
routes' (embeddings, rerank, score) written out.

The sampling parameters (handler/engine/request.Parameters), OpenAI's scalar fields
(handler/http/protocols/openai.ChatFields, CompletionFields) and the Messages and Responses bodies
(anthropic.MessagesRequest, responses.ResponsesRequest: whole, blocks and items included) are
pydantic models; their JSON schemas are the document's components. The free-form parts (`messages`, `tools`, the guided-
decoding parameters) are described by docs/API.md and checked by their own parsers.
"""
from __future__ import annotations

import copy
import json
from functools import lru_cache

from handler.engine import guide
from handler.engine.request import (ALIASES, MAX_NEW_TOKENS, MAX_TOKEN_ID, TOKEN_KEY, Parameters,
                                    RequestOptions)
from handler.http.protocols.anthropic import CountTokensRequest, MessagesRequest
from handler.http.protocols.lmi import LmiRequest
from handler.http.protocols import tools
from handler.http.protocols.openai import KWARG_NAME, RESERVED_KWARGS, ChatFields, CompletionFields
from handler.http.protocols.responses import MAX_LIST, ResponsesRequest

_TEXT_OR_LIST = {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}, "minItems": 1}
_PROMPT = {"anyOf": [*_TEXT_OR_LIST["anyOf"], _IDS, {"type": "array", "items": _IDS, "minItems": 1}]}


# Guided decoding's shapes (handler/engine/guide.py); what the constraint's own language accepts (a
# schema, a regular expression, a grammar the compiler takes) is the compiler's to say
_TEXT = {"type": "string", "minLength": 1}
_CHOICES = {"type": "array", "minItems": 1, "items": _TEXT}
GUIDED = {
    "guided_json": {"anyOf": [{"type": ["object", "boolean"]}, _TEXT]},     # true / false: JSON Schema's own
    "guided_regex": _TEXT, "guided_grammar": _TEXT, "guided_choice": _CHOICES,
    # vLLM's StructuredOutputsParams: one constraint among these keys (null or false ones are absent)
    "structured_outputs": {"type": "object", "additionalProperties": False, "properties": {
        "json": {"anyOf": [{"type": ["object", "boolean", "null"]}, _TEXT]},
        "regex": {"anyOf": [_TEXT, {"type": "null"}]},
        "choice": {"anyOf": [_CHOICES, {"type": "null"}]}, "grammar": {"anyOf": [_TEXT, {"type": "null"}]},
        "json_object": {"enum": [True, False, None]},
        **{k: {} for k in guide.STRUCTURED_QUIET if k != "structural_tag"}},   # structural_tag: refused
        # exactly one constraint (a null, or json_object false, is none)
        "oneOf": [*({"required": [k], "properties": {k: {"not": {"type": "null"}}}}
                    for k in ("json", "regex", "choice", "grammar")),
                  {"required": ["json_object"], "properties": {"json_object": {"const": True}}}]},
    "grammar": {"oneOf": [
        {"type": "object", "required": ["type"],       # no value (or null): any JSON object
         "properties": {"type": {"const": "json"},
                        "value": {"anyOf": [{"type": ["object", "boolean", "null"]}, _TEXT]}}},
        {"type": "object", "required": ["type", "value"], "properties": {"type": {"const": "regex"}, "value": _TEXT}},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}}]},
}
_OPENAI_GUIDED = {k: v for k, v in GUIDED.items() if k != "grammar"}
RESPONSE_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"description": "not checked"}, "schema": {"anyOf": [{"type": ["object", "boolean"]}, _TEXT]},
            "strict": {"description": "accepted (the schema is always enforced)"}}}}}]}


# Rules across fields that JSON Schema states (the server's 400s name the same fields; docs/API.md)
_STREAMED = {"required": ["stream"], "properties": {"stream": {"const": True}}}
_CHAT_RULES = [
    # top_logprobs needs logprobs: true
    {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
     "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
    # prompt log-probs come without stream (vLLM's rule too)
    {"if": _STREAMED, "then": {"properties": {"prompt_logprobs": {"type": "null"}}}}]
_COMPLETION_RULES = [
    # max_tokens 0 asks for the prompt's log-probs: with echo or prompt_logprobs
    {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
     "then": {"anyOf": [{"required": ["echo"], "properties": {"echo": {"const": True}}},
                        {"required": ["prompt_logprobs"], "properties": {"prompt_logprobs": {"type": "integer"}}}]}},
    # prompt log-probs (max_tokens 0, echo with logprobs, prompt_logprobs) come without stream
    {"if": _STREAMED, "then": {
        "properties": {"max_tokens": {"not": {"const": 0}}, "prompt_logprobs": {"type": "null"}},
        "not": {"required": ["echo", "logprobs"],
                "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}}}}]
_TEMPLATE_KWARGS = {"type": "object", "description": "extra variables for the chat template",
                    "propertyNames": {"pattern": KWARG_NAME.pattern, "not": {"enum": list(RESERVED_KWARGS)}}}


def _parameters_schema() -> dict:
    """Parameters plus the request options, the aliases and the guided-decoding names (any JSON)."""
    s = Parameters.model_json_schema()
    props = dict(s["properties"])
    props.update(RequestOptions.model_json_schema()["properties"])
    for alias, canon in ALIASES.items():
        props[alias] = {**props[canon], "description": f"the same as {canon}"}
    for name in guide.PARAMETERS:
        props[name] = {**GUIDED[name], "description": "guided decoding (docs/API.md)"}
    return {"type": "object", "title": "Parameters", "description": s.get("description", ""),
            "properties": props, "additionalProperties": True}


def _body(schema: dict, required: list[str], extra: dict) -> dict:
    """A model's schema with `extra` properties (the free-form or separately parsed parts) in
    place of the model's own of those names."""
    s = dict(schema)
    s["properties"] = {**s.get("properties", {}), **extra}
    s["required"] = required
    s["additionalProperties"] = True
    return s


# What every generation route can answer (handler/http/routes/common.py): the body's checks, its size
# and media type, a slow body, an unknown adapter, the model failing, a full queue or a loading model
_STATUS = {"200": {"description": "the generated text (or a stream)"},
           "400": {"description": "a bad request: one line naming the field"},
           "404": {"description": "an unknown adapter"},
           "408": {"description": "the body did not arrive in time"},
           "413": {"description": "the body is over option.max_payload_mb"},
           "415": {"description": "the body is not JSON"},
           "424": {"description": "the model failed"},
           "503": {"description": "the queue is full, or the model is loading"},
           "504": {"description": "request_timeout passed"}}
# TGI answers a bad request with 422 (handler/http/routes/common.tgi_error)
_TGI = {**{k: v for k, v in _STATUS.items() if k != "400"},
        "422": {"description": "a bad request (TGI's validation error)"}}
# Anthropic's codes for ours (handler/http/protocols/anthropic.status)
_ANTHROPIC = {**{k: v for k, v in _STATUS.items() if k not in ("424", "503")},
              "500": _STATUS["424"], "529": _STATUS["503"]}


def _post(summary: str, ref: str, statuses: dict = _STATUS) -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": f"#/components/schemas/{ref}"}}}},
                     "responses": dict(statuses)}}


def _pooling_schemas() -> dict:
    """The pooling routes' bodies (handler/http/protocols/pool_*.py), written out: no pydantic models there."""
    def obj(required, **props):
        return {"type": "object", "required": required, "properties": props, "additionalProperties": True}
    flag, positive = {"type": "boolean"}, {"type": "integer", "minimum": 1}
    texts = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
    pair = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 2, "maxItems": 2}
    return {
        "EmbeddingsRequest": obj(["input"], input=_PROMPT, model={"type": "string"},
                                 encoding_format={"enum": ["float", "base64"]}, dimensions=positive,
                                 truncate_prompt_tokens={"type": "integer", "minimum": -1}),
        "EmbedRequest": obj(["inputs"], inputs=_TEXT_OR_LIST, normalize=flag, truncate=flag,
                            truncation_direction={"enum": ["Right", "Left"]}, dimensions=positive),
        "PredictRequest": obj(["inputs"], inputs={"anyOf": [{"type": "string", "minLength": 1}, pair,
                                                            {"type": "array", "items": {"anyOf": [
                                                                {"type": "string", "minLength": 1}, pair]},
                                                             "minItems": 1}]},
                              raw_scores=flag, truncate=flag),
        "TEIRerankRequest": obj(["query", "texts"], query={"type": "string", "minLength": 1}, texts=texts,
                                raw_scores=flag, return_text=flag, truncate=flag),
        "RerankRequest": obj(["query", "documents"], query={"type": "string", "minLength": 1}, model={"type": "string"},
                             documents={"type": "array", "minItems": 1, "items": {"anyOf": [
                                 {"type": "string", "minLength": 1}, obj(["text"], text={"type": "string"})]}},
                             top_n=positive, return_documents=flag, truncate={"enum": ["NONE", "START", "END"]}),
        "ScoreRequest": obj(["text_1", "text_2"], text_1=_TEXT_OR_LIST, text_2=_TEXT_OR_LIST, model={"type": "string"}),
    }


_POOLED = {"200": {"description": "vectors or scores"}, "400": _STATUS["400"], "424": _STATUS["424"],
           "503": _STATUS["503"]}


def _stored() -> dict:
    """GET / DELETE /v1/responses/{response_id}."""
    param = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    found = {"404": {"description": "no stored response of that id"}}
    return {"get": {"summary": "A stored response", "parameters": param,
                    "responses": {"200": {"description": "the response object"}, **found}},
            "delete": {"summary": "Delete a stored response", "parameters": param,
                       "responses": {"200": {"description": "{id, object, deleted: true}"}, **found}}}


def _input_items() -> dict:
    """GET /v1/responses/{response_id}/input_items: OpenAI's list (responses.input_items)."""
    param = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
             {"name": "limit", "in": "query", "required": False,
              "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIST, "default": 20}},
             {"name": "order", "in": "query", "required": False,
              "schema": {"enum": ["asc", "desc"], "default": "desc"}},
             {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
              "description": "an item id: the page starts after it"}]
    return {"get": {"summary": "A stored response's input items", "parameters": param,
                    "responses": {"200": {"description": "{object: list, data, first_id, last_id, has_more}"},
                                  "400": {"description": "a bad limit, order or after"},
                                  "404": {"description": "no stored response of that id"}}}}


# A chat message as the chat template receives it (openai.render_chat): a role, text or text parts
_CHAT_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": True, "properties": {
    "role": {"type": "string", "description": "system, user, assistant, tool, or any the chat template takes"},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    "name": {"description": "passed to the template when a string"},
    "tool_call_id": {"description": "passed to the template when a string"},
    "tool_calls": {"type": ["array", "null"], "items": {"type": "object", "required": ["function"], "properties": {
        "id": {"description": "passed to the chat template as it is"},
        "type": {"description": "function (not checked)"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": ["string", "object", "null"]}}}}}}}}
_CHAT_MESSAGES = {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE}
# A function tool as handler/http/protocols/tools.parse reads it (its parameters: a JSON schema)
_TOOLS = {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": tools.NAME.pattern},
        "parameters": {"type": ["object", "null"]}, "description": {}}}}}}


# Media blocks and parts: documents, files and audio are refused (a 400 naming them); images are taken
# (docs/API.md) but left out of the document: no schema says "a decodable image within the limits"
_REFUSED = ("ImageBlock", "MediaBlock", "ImagePart", "MediaPart")
_BLOCK = "#/$defs/"
# Anthropic's message: tool results come from the user, tool calls and thinking from the assistant
_ANTHROPIC_MESSAGE = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "user"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"$ref": _BLOCK + "TextBlock"}, {"$ref": _BLOCK + "ToolResultBlock"}]}}]}}},
    {"type": "object", "required": ["role", "content"], "properties": {     # may be empty: a prefill
        "role": {"const": "assistant"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [
            {"$ref": _BLOCK + "TextBlock"}, {"$ref": _BLOCK + "ToolUseBlock"},
            {"$ref": _BLOCK + "ThinkingBlock"}]}}]}}}]}


def _each_object(node, fix) -> None:
    """fix(d) on every JSON object of a schema tree, parents before their children."""
    if isinstance(node, dict):
        fix(node)
        for v in node.values():
            _each_object(v, fix)
    elif isinstance(node, list):
        for v in node:
            _each_object(v, fix)


def _drop_refs(node, refs: set[str]) -> None:
    """Remove the alternatives that are references to `refs` from every anyOf/oneOf (and its discriminator)."""
    def fix(d):
        for key in ("anyOf", "oneOf"):
            if key in d:
                d[key] = [a for a in d[key] if not (isinstance(a, dict) and a.get("$ref") in refs)]
        mapping = d.get("discriminator", {}).get("mapping")
        if mapping:
            d["discriminator"]["mapping"] = {k: v for k, v in mapping.items() if v not in refs}
    _each_object(node, fix)


def _token_keys(node) -> None:
    """pydantic writes a dict with checked keys as patternProperties (which lets other keys through):
    logit_bias's keys are token ids and nothing else, i.e. propertyNames."""
    def fix(d):
        pattern = d.get("patternProperties", {})
        if TOKEN_KEY in pattern:
            d["additionalProperties"] = pattern.pop(TOKEN_KEY)
            d["propertyNames"] = {"pattern": TOKEN_KEY}
            del d["patternProperties"]
    _each_object(node, fix)


def _drop_discriminators(node) -> None:
    """A oneOf told apart by `type` with a member whose type is optional: the alternatives' own schemas decide."""
    _each_object(node, lambda d: d.pop("discriminator", None))


def _nullable(body: dict) -> None:
    """A body's optional fields take null: every parser reads a null as the field being absent."""
    required = set(body.get("required", []))
    for name, prop in body.get("properties", {}).items():
        if name not in required and prop.get("type") != "null":
            body["properties"][name] = {"anyOf": [{k: v for k, v in prop.items() if k != "default"},
                                                  {"type": "null"}], "default": None}


_PROPS = object()       # marks a "properties" map while walking the document
ADAPTER_FIELDS = ("adapters", "adapter_id")
# The fields whose token ids the parsers check against the vocabulary
VOCAB_FIELDS = ("prompt",)
# The fields whose bound is the model's length (admission refuses prompt + them beyond it)
MAX_TOKEN_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens")


POOLING_PATHS = ("/v1/embeddings", "/embed", "/predict", "/rerank", "/v1/rerank", "/score")


def document(vocab_size: int | None = None, max_model_len: int | None = None, priorities: bool = True,
             pooling: bool | None = None, lora: bool = True) -> dict:
    """The document; with the loaded model's vocabulary and length, its prompt token ids and token counts
    bounded by them (what the parsers check), so that a body valid against it is one we accept; without
    priority scheduling (option.scheduling_policy=fcfs) a priority can only be 0, without LoRA
    (option.enable_lora=false) no adapter can be named; `pooling`: the routes of
    an embedding/rerank model (True) or of a generating one (False), not both."""
    doc = _static()
    if vocab_size is None and max_model_len is None and priorities and pooling is None and lora:
        return doc
    doc = copy.deepcopy(doc)
    if pooling is not None:         # a loaded model serves either the generation or the pooling routes
        doc["paths"] = {k: v for k, v in doc["paths"].items()
                        if (k in POOLING_PATHS) == pooling}

    def bound(node, name=None):
        if isinstance(node, dict):
            if vocab_size and name in VOCAB_FIELDS and node.get("maximum") == MAX_TOKEN_ID:
                node["maximum"] = vocab_size - 1
            if not priorities and name == "priority" and node.get("type") == "integer":
                node["minimum"] = node["maximum"] = 0
            if max_model_len and name in MAX_TOKEN_FIELDS and node.get("maximum") == MAX_NEW_TOKENS:
                node["maximum"] = max_model_len - 1     # the prompt takes at least one position
            if vocab_size and node.get("pattern") == TOKEN_KEY:
                node["pattern"] = f"^\\s*({below(vocab_size)})\\s*$"
            for k, v in node.items():   # name: the field a schema belongs to (through anyOf/oneOf)
                if name is _PROPS:
                    bound(v, k)
                else:
                    bound(v, _PROPS if k == "properties" else name if k in ("anyOf", "oneOf", "items") else None)
        elif isinstance(node, list):
            for v in node:
                bound(v, name)
    bound(doc)
    if not lora:        # without option.enable_lora a body naming an adapter is refused
        for body in doc["components"]["schemas"].values():
            for name in ADAPTER_FIELDS:
                if name in body.get("properties", {}):
                    body["properties"][name] = {"type": "null"}   # null is an absent field
    return doc


def below(n: int) -> str:
    """A regular expression for the decimal integers 0 .. n-1 (no leading zeros)."""
    top = str(n - 1)
    alts = ["0"] if n > 0 else []
    if len(top) > 1:            # every shorter number
        alts.append(f"[1-9][0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else "[1-9]")
    for i, d in enumerate(top):     # the same length: equal up to i, smaller at i, anything after
        lo = "1" if i == 0 else "0"
        if int(d) > int(lo):
            rest = f"[0-9]{{{len(top) - i - 1}}}" if len(top) - i - 1 else ""
            alts.append(f"{top[:i]}[{lo}-{int(d) - 1}]{rest}")
    if len(top) > 1 or top != "0":
        alts.append(top)
    return "|".join(dict.fromkeys(alts))


@lru_cache(maxsize=1)
def _static() -> dict:
    params = _parameters_schema()
    lmi = _body(LmiRequest.model_json_schema(), ["inputs"],
                {"inputs": _TEXT_OR_LIST, "parameters": {"$ref": "#/components/schemas/Parameters"},
                 "adapters": {"anyOf": [{"type": "string", "minLength": 1},
                                        {"type": "array", "minItems": 1,
                                         "items": {"type": "string", "minLength": 1}}]},
                 "messages": _CHAT_MESSAGES})
    tgi = _body(LmiRequest.model_json_schema(), ["inputs"],      # one string; adapter_id in parameters
                {"inputs": {"type": "string", "minLength": 1},
                 "parameters": {"$ref": "#/components/schemas/Parameters"}})
    lmi["title"], tgi["title"] = "LMIRequest", "TGIRequest"
    tgi["properties"].pop("adapters", None)
    # a stream answers one string with one sample (lmi.parse, tgi.parse)
    one = {"anyOf": [{"const": 1}, {"type": "null"}]}
    one_sample = {"properties": {"n": one, "best_of": one}}
    lmi["allOf"] = [{"if": _STREAMED, "then": {"properties": {"inputs": {"type": "string"}, "parameters": one_sample}}}]
    tgi_stream = copy.deepcopy(tgi)
    tgi_stream["title"] = "TGIStreamRequest"
    tgi["allOf"] = [{"if": _STREAMED, "then": {"properties": {"parameters": one_sample}}}]
    tgi_stream["allOf"] = [{"properties": {"parameters": one_sample}}]
    chat = _body(ChatFields.model_json_schema(), ["messages"],
                 {"messages": _CHAT_MESSAGES,
                  "model": {"type": "string"}, "tools": _TOOLS, "response_format": RESPONSE_FORMAT,
                  "chat_template_kwargs": _TEMPLATE_KWARGS, **_OPENAI_GUIDED})
    chat["allOf"] = _CHAT_RULES
    completion = _body(CompletionFields.model_json_schema(), ["prompt"],
                       {"prompt": _PROMPT, "model": {"type": "string"}, "response_format": RESPONSE_FORMAT,
                        **_OPENAI_GUIDED})
    completion["allOf"] = _COMPLETION_RULES
    schemas = {"Parameters": params, "LMIRequest": lmi, "TGIRequest": tgi, "TGIStreamRequest": tgi_stream,
               "ChatCompletionRequest": chat, "CompletionRequest": completion,
               "MessagesRequest": MessagesRequest.model_json_schema(),
               "CountTokensRequest": CountTokensRequest.model_json_schema(),
               "ResponsesRequest": ResponsesRequest.model_json_schema()}
    schemas.update(_pooling_schemas())
    for s in list(schemas.values()):    # nested models' definitions, moved to components
        for name, d in s.pop("$defs", {}).items():
            schemas.setdefault(name, d)
    _token_keys(schemas)
    for name in _REFUSED:               # declared to be refused by name (a 400): not in the document
        schemas.pop(name, None)
    _drop_refs(schemas, {f"#/$defs/{n}" for n in _REFUSED})
    schemas["Message"] = _ANTHROPIC_MESSAGE
    schemas["ToolChoice"].update({"if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
                                  "then": {"required": ["type", "name"]}})
    schemas["MessageItem"]["required"].remove("type")   # an item without a type is a message (responses._items)
    _drop_discriminators(schemas["ResponsesRequest"])
    for name in ("Parameters", "LMIRequest", "TGIRequest", "TGIStreamRequest", "ChatCompletionRequest",
                 "CompletionRequest", "MessagesRequest", "CountTokensRequest", "ResponsesRequest"):
        _nullable(schemas[name])
    doc = {"openapi": "3.1.0", "info": {"title": "lmi-serve", "version": "1.0.0"},
           "paths": {"/invocations": _post("LMI / SageMaker generation", "LMIRequest"),
                     "/v1/chat/completions": _post("OpenAI Chat Completions", "ChatCompletionRequest"),
                     "/v1/completions": _post("OpenAI Completions", "CompletionRequest"),
                     "/v1/messages": _post("Anthropic Messages", "MessagesRequest", _ANTHROPIC),
                     "/v1/messages/count_tokens": _post("Anthropic Messages: count a prompt's tokens",
                                                        "CountTokensRequest", _ANTHROPIC),
                     "/v1/responses": _post("OpenAI Responses", "ResponsesRequest",
                                            {**_STATUS, "404": {"description": "an unknown adapter or previous_response_id"}}),
                     "/v1/responses/{response_id}": _stored(),
                     "/v1/responses/{response_id}/input_items": _input_items(),
                     "/generate": _post("TGI generation", "TGIRequest", _TGI),
                     "/generate_stream": _post("TGI streamed generation", "TGIStreamRequest", _TGI),
                     # pooling models (option.task=text_embedding | classify | rerank)
                     "/v1/embeddings": _post("OpenAI embeddings", "EmbeddingsRequest", _POOLED),
                     "/embed": _post("TEI embeddings", "EmbedRequest", _POOLED),
                     "/predict": _post("TEI classification", "PredictRequest", _POOLED),
                     "/rerank": {"post": {**_post("TEI rerank ({query, texts}) or Cohere / Jina rerank "
                                                  "({query, documents})", "RerankRequest", _POOLED)["post"],
                                          "requestBody": {"required": True, "content": {"application/json": {
                                              "schema": {"anyOf": [{"$ref": "#/components/schemas/TEIRerankRequest"},
                                                                   {"$ref": "#/components/schemas/RerankRequest"}]}}}}}},
                     "/v1/rerank": _post("Cohere / Jina rerank", "RerankRequest", _POOLED),
                     "/score": _post("vLLM score: text_1 against text_2", "ScoreRequest", _POOLED)},
           "components": {"schemas": schemas}}
    # pydantic writes nested references as #/$defs/X: point them at the components
    return json.loads(json.dumps(doc).replace('"#/$defs/', '"#/components/schemas/'))
