"""The app's routes, one Flask blueprint per protocol; the plumbing they share is in common.py.

  sagemaker  GET /ping, GET /execution-parameters, POST /invocations, POST /predictions/<model>
  adapters   LoRA adapter management: /adapters[/<name>], /models/<model>/adapters[/<name>]
  openai     POST /v1/chat/completions, POST /v1/completions, GET /v1/models
  tgi        POST /generate, POST /generate_stream, POST /
  ops        GET /metrics, GET /openapi.json
"""
from __future__ import annotations

from handler.http.routes import adapters, ops, openai, sagemaker, tgi

BLUEPRINTS = (sagemaker.bp, adapters.bp, openai.bp, tgi.bp, ops.bp)
