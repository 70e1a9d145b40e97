"""The app's routes, one Flask blueprint per protocol; the plumbing they share is in common.py.

  sagemaker  GET /ping, GET /execution-parameters, POST /invocations, POST /predictions/<model>
  adapters   LoRA adapter management: /adapters[/<name>], /models/<model>/adapters[/<name>]
  openai     POST /v1/chat/completions, POST /v1/completions, GET /v1/models
  anthropic  POST /v1/messages, POST /v1/messages/count_tokens
  responses  POST /v1/responses, GET / DELETE /v1/responses/<id>
  tgi        POST /generate, POST /generate_stream, POST /
  pooling    POST /v1/embeddings, /embed, /predict, /rerank, /v1/rerank, /score (embedding, classification
             and cross-encoder models; their /invocations too)
  ops        GET /metrics, GET /openapi.json
"""
from __future__ import annotations

from handler.http.routes import adapters, anthropic, ops, openai, pooling, responses, sagemaker, tgi

BLUEPRINTS = (sagemaker.bp, adapters.bp, openai.bp, anthropic.bp, responses.bp, tgi.bp, pooling.bp, ops.bp)
