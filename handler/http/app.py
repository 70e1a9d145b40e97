"""Flask app: SageMaker's contract (/ping, /invocations, /execution-parameters), the OpenAI routes
(/v1/chat/completions, /v1/completions, /v1/models), TGI's (/generate, /generate_stream, POST /)
and /metrics.

Thin on purpose: the routes are blueprints, one per protocol (handler/http/routes/), sharing the
plumbing of handler/http/routes/common.py; a protocol module in handler/http/protocols/ decodes
each body into a Generation and encodes the engine's samples or events. Routes and metrics see the
engine only through `ServerState.client` (handler.engine.client.EngineClient).
"""
from __future__ import annotations

import threading
import time

from flask import Flask

from handler.engine.client import EngineClient, client_for
from handler.http.guard import Admission, check_prompt, longest_token_chars
from handler.http.metrics import Metrics
from handler.http.protocols.store import ResponseStore
from handler.http.routes import BLUEPRINTS, common
from handler.http.routes.common import model_name, running_width

__all__ = ["ServerState", "create_app", "model_name", "running_width"]


class ServerState:
    """What the app serves from; the engine appears once the model has loaded (`engine`, set by
    its owner), and with it `client`, the facade the routes and metrics use."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._engine = None
        self._client: EngineClient | None = None
        self.error: str | None = None
        self.lock = threading.Lock()
        self.http = {"2xx": 0, "400": 0, "413": 0, "424": 0, "503": 0, "504": 0, "other": 0}
        self.started = int(time.time())
        # Client went away during its upload or mid-stream: not a server error.
        self.client_disconnects = 0
        # At most this many generation requests in flight: every running slot + the queue.
        self.admission = Admission(running_width(cfg) + cfg.job_queue_size)
        self._max_prompt_chars: int | None = None
        self.metrics = Metrics(model_name(cfg), cfg.strategy, lambda: self.client, self.http_stats)
        # The Responses API's stored responses (previous_response_id, GET /v1/responses/<id>).
        self.responses = ResponseStore(cfg.responses_store_max_items, int(cfg.responses_store_max_mb * 1e6))
        # The gevent worker's hub.HubWaker (set by server.create_state); None: threads block.
        self.waker = None
        # The model directory's model.py (handler.http.custom.CustomCode), loaded at start-up; None: none.
        self.custom = None
        # Adapter name -> the formatters of MODEL_DIR/adapters/<name>/model.py (LMI: over the model's).
        self.adapter_custom: dict = {}

    @property
    def engine(self):
        """The Engine (None while loading)."""
        return self._engine

    @engine.setter
    def engine(self, engine) -> None:
        self._client = None if engine is None else client_for(engine)
        self._engine = engine

    @property
    def client(self) -> EngineClient | None:
        """The engine's facade for the HTTP layer (None while loading)."""
        return self._client

    def http_stats(self) -> dict:
        """What the HTTP layer counts itself, for the metrics collector."""
        with self.lock:
            return {"responses": dict(self.http), "client_disconnects": self.client_disconnects,
                    "in_flight": self.admission.inside, "refused": self.admission.refused}

    def check_prompts(self, gen) -> None:
        """Before tokenizing: text the tokenizer cannot take, or too long to fit the context
        whatever it tokenizes to (a token covers at most the longest vocabulary entry's
        characters; x4 for normalizers that merge characters). Truncated prompts may be long."""
        client = self.client
        if self._max_prompt_chars is None:
            self._max_prompt_chars = 4 * client.max_model_len * longest_token_chars(client.tokenizer)
        limit = self._max_prompt_chars if gen.truncate is None else None
        for i, text in enumerate(gen.prompts):
            check_prompt(text, gen.fields[i] if i < len(gen.fields) else "inputs", limit,
                         client.max_model_len)

    def disconnected(self) -> None:
        with self.lock:
            self.client_disconnects += 1

    def count(self, status: int) -> None:
        key = "2xx" if 200 <= status < 300 else str(status) if str(status) in self.http else "other"
        with self.lock:
            self.http[key] += 1


def create_app(state: ServerState) -> Flask:
    app = Flask("lmi-serve")
    app.extensions[common.STATE_KEY] = state
    app.before_request(common.start_trace)
    app.after_request(common.record_response)
    for bp in BLUEPRINTS:
        app.register_blueprint(bp)
    common.register_error_handlers(app)
    app.wsgi_app = common.admitting(app.wsgi_app, state)
    return app
