"""GET /openapi.json: the generation routes' request bodies, from the declared models; the pooling
routes' (embeddings, rerank, score) written out.

The sampling parameters (handler/engine/request.Parameters), OpenAI's scalar fields
(handler/http/protocols/openai.ChatFields, CompletionFields) and the Messages and Responses bodies
(anthropic.MessagesRequest, responses.ResponsesRequest: whole, blocks and items included) are
pydantic models; their JSON schemas are the document's components. The free-form parts (`messages`, `tools`, the guided-
decoding parameters) are described by docs/API.md and checked by their own parsers.
"""
from __future__ import annotations

import json
from functools import lru_cache

from handler.engine import guide
from handler.engine.request import ALIASES, Parameters, RequestOptions
from handler.http.protocols.anthropic import CountTokensRequest, MessagesRequest
from handler.http.protocols.lmi import LmiRequest
from handler.http.protocols.openai import ChatFields, CompletionFields
from handler.http.protocols.responses import ResponsesRequest

_TEXT_OR_LIST = {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT = {"anyOf": [*_TEXT_OR_LIST["anyOf"], _IDS, {"type": "array", "items": _IDS, "minItems": 1}]}


def _parameters_schema() -> dict:
    """Parameters plus the request options, the aliases and the guided-decoding names (any JSON)."""
    s = Parameters.model_json_schema()
    props = dict(s["properties"])
    props.update(RequestOptions.model_json_schema()["properties"])
    for alias, canon in ALIASES.items():
        props[alias] = {**props[canon], "description": f"the same as {canon}"}
    for name in guide.PARAMETERS:
        props[name] = {"description": "guided decoding (docs/API.md)"}
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


_STATUS = {"200": {"description": "the generated text (or a stream)"},
           "400": {"description": "a bad request: one line naming the field"},
           "424": {"description": "the model failed"},
           "503": {"description": "the queue is full, or the model is loading"}}
# Anthropic's codes for ours (handler/http/protocols/anthropic.status)
_ANTHROPIC = {"200": _STATUS["200"], "400": _STATUS["400"], "500": _STATUS["424"], "529": _STATUS["503"]}


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


@lru_cache(maxsize=1)
def document() -> dict:
    params = _parameters_schema()
    lmi = _body(LmiRequest.model_json_schema(), ["inputs"],
                {"inputs": _TEXT_OR_LIST, "parameters": {"$ref": "#/components/schemas/Parameters"},
                 "adapters": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                 "messages": {"type": "array", "items": {"type": "object"}}})
    tgi = _body(LmiRequest.model_json_schema(), ["inputs"],      # one string; adapter_id in parameters
                {"inputs": {"type": "string", "minLength": 1},
                 "parameters": {"$ref": "#/components/schemas/Parameters"}})
    lmi["title"], tgi["title"] = "LMIRequest", "TGIRequest"
    tgi["properties"].pop("adapters", None)
    chat = _body(ChatFields.model_json_schema(), ["messages"],
                 {"messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
                  "model": {"type": "string"}, "tools": {"type": "array"}, "response_format": {"type": "object"}})
    completion = _body(CompletionFields.model_json_schema(), ["prompt"],
                       {"prompt": _PROMPT, "model": {"type": "string"}, "response_format": {"type": "object"}})
    schemas = {"Parameters": params, "LMIRequest": lmi, "TGIRequest": tgi,
               "ChatCompletionRequest": chat, "CompletionRequest": completion,
               "MessagesRequest": MessagesRequest.model_json_schema(),
               "CountTokensRequest": CountTokensRequest.model_json_schema(),
               "ResponsesRequest": ResponsesRequest.model_json_schema()}
    schemas.update(_pooling_schemas())
    for s in list(schemas.values()):    # nested models' definitions, moved to components
        for name, d in s.pop("$defs", {}).items():
            schemas.setdefault(name, d)
    doc = {"openapi": "3.1.0", "info": {"title": "lmi-serve", "version": "1.0.0"},
           "paths": {"/invocations": _post("LMI / SageMaker generation", "LMIRequest"),
                     "/v1/chat/completions": _post("OpenAI Chat Completions", "ChatCompletionRequest"),
                     "/v1/completions": _post("OpenAI Completions", "CompletionRequest"),
                     "/v1/messages": _post("Anthropic Messages", "MessagesRequest", _ANTHROPIC),
                     "/v1/messages/count_tokens": _post("Anthropic Messages: count a prompt's tokens",
                                                        "CountTokensRequest", _ANTHROPIC),
                     "/v1/responses": _post("OpenAI Responses", "ResponsesRequest",
                                            {**_STATUS, "404": {"description": "unknown previous_response_id"}}),
                     "/v1/responses/{response_id}": _stored(),
                     "/generate": _post("TGI generation", "TGIRequest"),
                     "/generate_stream": _post("TGI streamed generation", "TGIRequest"),
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
