"""Two peer servers that speak the subset of the /invocations contract the benchmark uses,
so our strategies are measured against what a user could run instead:

  hf_naive         the server a user would write: Flask threaded, one lock, `model.generate`
                   on one request at a time (no streaming: its TTFT is recorded as unknown)
  transformers_cb  transformers' own continuous batching (`init_continuous_batching`,
                   `add_request`, results routed per request), streaming, with an explicit
                   KV size (num_blocks x page_size tokens) equal to our servers' kv_cache_tokens

Run: python -m handler.tools.bench.peers --kind hf_naive|transformers_cb --model-dir DIR --port P

Request subset: {"inputs": str, "parameters": {"max_new_tokens", "ignore_eos", "details",
"eos_after"}, "stream": bool}. `eos_after: K` (the benchmark's knob) ends the sequence after
K tokens with finish_reason "eos_token"; the peers implement it by asking for min(K, max)
tokens, which gives their schedulers knowledge ours lacks; neither reserves KV by the
requested length (one sequence at a time / blocks on demand), so it does not help them.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import queue
import sys
import threading
import uuid

KINDS = ("hf_naive", "transformers_cb")


class BadRequest(ValueError):
    pass


def parse_body(body) -> tuple[str, int, bool, int | None, bool, bool]:
    """-> (prompt, max_new_tokens, ignore_eos, eos_after, details, stream)."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), str):
        raise BadRequest("inputs: must be one string for the peer servers")
    p = body.get("parameters") or {}
    n = p.get("max_new_tokens", 30)
    if not isinstance(n, int) or n < 1:
        raise BadRequest(f"parameters.max_new_tokens={n!r}: must be an integer >= 1")
    k = p.get("eos_after")
    if k is not None and (not isinstance(k, int) or k < 1):
        raise BadRequest(f"parameters.eos_after={k!r}: must be an integer >= 1")
    return (body["inputs"], n, bool(p.get("ignore_eos", False)), k,
            bool(p.get("details", False)), bool(body.get("stream", False)))


def final_body(text: str, ids: list[int], reason: str, tok, details: bool) -> dict:
    out = {"generated_text": text}
    if details:
        out["details"] = {"finish_reason": reason, "generated_tokens": len(ids),
                          "tokens": [{"id": i, "text": t, "log_prob": None}
                                     for i, t in zip(ids, tok.convert_ids_to_tokens(ids))]}
    return out


def _reason(ids: list[int], n: int, k: int | None, eos: int | None, ignore_eos: bool) -> str:
    if k is not None and len(ids) >= k:  # K == max_new_tokens: EOS came last, as a sampled one would
        return "eos_token"
    if not ignore_eos and ids and ids[-1] == eos:
        return "eos_token"
    return "length"


class NaiveBackend:
    """One request at a time through model.generate."""

    def __init__(self, model, tok, **_):
        self.model, self.tok = model, tok
        self.lock = threading.Lock()

    def generate(self, prompt, n, ignore_eos, k):
        import torch
        from transformers import GenerationConfig

        want = min(n, k) if k else n
        eos = self.tok.eos_token_id
        cfg = GenerationConfig(do_sample=False, max_new_tokens=want, pad_token_id=self.tok.pad_token_id,
                               eos_token_id=eos, min_new_tokens=want if ignore_eos else 0)
        ids = self.tok(prompt, return_tensors="pt")["input_ids"].to(self.model.device)
        with self.lock, torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        new = out[0, ids.shape[1]:].tolist()
        return new, _reason(new, n, k, eos, ignore_eos)

    def stream(self, *a):
        return None  # not streaming: the naive server answers with one JSON body


class CBBackend:
    """transformers' continuous batching manager; a router thread hands each request its outputs."""

    def __init__(self, model, tok, kv_cache_tokens, prefill_tokens, max_batch_size, page_size):
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        self.model, self.tok = model, tok
        gen = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=None,
                               pad_token_id=tok.pad_token_id)  # eos None -> -1: never stops early
        # transformers 5.23 calls the block "page_size"; 5.17 (the GPU machines) "block_size"
        size_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        cb = ContinuousBatchingConfig(**{size_key: page_size}, num_blocks=math.ceil(kv_cache_tokens / page_size),
                                      max_batch_tokens=prefill_tokens, max_requests_per_batch=max_batch_size)
        self.mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        if model.device.type == "cuda":
            self.mgr.warmup()
        self.mgr.start()
        self.queues: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._route, daemon=True).start()

    def _route(self):
        while True:
            r = self.mgr.get_result(timeout=0.2)
            if r is None:
                if not self.mgr.is_running():
                    with self.lock:
                        for q in self.queues.values():
                            q.put(None)
                    return
                continue
            with self.lock:
                q = self.queues.get(r.request_id)
            if q is not None:
                q.put(r)

    def _submit(self, prompt, n, ignore_eos, k, streaming):
        want = min(n, k) if k else n
        ids = self.tok(prompt)["input_ids"]
        rid = uuid.uuid4().hex
        q: queue.Queue = queue.Queue()
        with self.lock:
            self.queues[rid] = q
        eos = None if ignore_eos else self.tok.eos_token_id
        self.mgr.add_request(ids, request_id=rid, max_new_tokens=want, streaming=streaming, eos_token_id=eos)
        return rid, q

    def _results(self, rid, q):
        try:
            while True:
                r = q.get()
                if r is None:
                    raise RuntimeError("continuous batching manager stopped")
                if r.error:
                    raise RuntimeError(r.error)
                yield r
                if r.is_finished():
                    return
        finally:
            with self.lock:
                self.queues.pop(rid, None)

    def generate(self, prompt, n, ignore_eos, k):
        rid, q = self._submit(prompt, n, ignore_eos, k, streaming=False)
        *_, last = self._results(rid, q)
        new = list(last.generated_tokens)
        return new, _reason(new, n, k, self.tok.eos_token_id, ignore_eos)

    def stream(self, prompt, n, ignore_eos, k):
        """Yields (new token ids, finished, all ids) per manager output."""
        rid, q = self._submit(prompt, n, ignore_eos, k, streaming=True)
        sent = 0
        for r in self._results(rid, q):
            ids = list(r.generated_tokens)
            yield ids[sent:], r.is_finished(), ids
            sent = len(ids)


def make_app(backend):
    from flask import Flask, Response, jsonify, request

    app = Flask("peer")
    tok = backend.tok

    def err(code, msg):
        return jsonify({"code": code, "message": msg}), code

    @app.get("/ping")
    def ping():
        return jsonify({"status": "healthy"})

    @app.post("/invocations")
    def invocations():
        try:
            prompt, n, ignore_eos, k, details, stream = parse_body(request.get_json(force=True, silent=True))
        except BadRequest as e:
            return err(400, str(e))
        gen = backend.stream(prompt, n, ignore_eos, k) if stream else None
        if gen is None:
            try:
                ids, reason = backend.generate(prompt, n, ignore_eos, k)
            except Exception as e:  # noqa: BLE001 - the client records the message
                return err(424, f"{type(e).__name__}: {e}")
            return jsonify(final_body(tok.decode(ids), ids, reason, tok, details))

        def lines():
            try:
                for new, finished, ids in gen:
                    for j, t in enumerate(new):
                        msg = {"token": {"id": t, "text": tok.decode([t]), "log_prob": None}}
                        if finished and j == len(new) - 1:
                            msg.update(final_body(tok.decode(ids), ids, _reason(ids, n, k, tok.eos_token_id,
                                                                                ignore_eos), tok, details))
                        yield json.dumps(msg) + "\n"
            except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
                yield json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n"

        return Response(lines(), mimetype="application/jsonlines")

    return app


def load(model_dir: str, dtype: str = "auto"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    dt = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt, attn_implementation="sdpa")
    model.to("cuda" if cuda else "cpu").eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m handler.tools.bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="transformers_cb KV size in tokens")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="transformers_cb max_batch_tokens")
    p.add_argument("--max-batch-size", type=int, default=64, help="transformers_cb max_requests_per_batch")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.model_dir, "config.json")):
        print(f"error: --model-dir {a.model_dir!r} has no config.json", file=sys.stderr)
        return 2
    model, tok = load(a.model_dir, a.dtype)
    if a.kind == "hf_naive":
        backend = NaiveBackend(model, tok)
    else:
        backend = CBBackend(model, tok, a.kv_cache_tokens, a.prefill_tokens, a.max_batch_size, a.page_size)
    from werkzeug.serving import WSGIRequestHandler

    WSGIRequestHandler.protocol_version = "HTTP/1.1"  # keep-alive, chunked streaming
    make_app(backend).run(host=a.host, port=a.port, threaded=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
