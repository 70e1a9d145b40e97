"""Closed-loop HTTP load client: C threads, each sending its next request as soon as the
last one finished, until N are done. Streams when the server does (jsonlines) to time the
first token; counts output tokens from stream lines or `details`, never from text.

Bodies are LMI's ({"inputs", "parameters", "stream"}); an API adapter turns each into its
server's body and reads the answer into the same Record: `LMI` (/invocations) or
`OpenAICompletions` (/v1/completions, for servers without /invocations such as vLLM)."""
from __future__ import annotations

import json
import sys
import threading
import time

import requests

from handler.tools.bench.metrics import Record


def _error_text(resp) -> str:
    try:
        body = resp.json()
        msg = body.get("message") or body.get("error") or json.dumps(body)
        if isinstance(msg, dict):   # OpenAI's {"error": {"message": ...}}
            msg = msg.get("message") or json.dumps(msg)
    except ValueError:
        msg = resp.text[:200]
    return f"HTTP {resp.status_code}: {msg}"


class LMI:
    """LMI's /invocations: the body as drawn; jsonlines stream or one JSON body with details."""
    name = "lmi"

    @staticmethod
    def url(base: str) -> str:
        return invocations_url(base)

    @staticmethod
    def body(b: dict) -> dict:
        return b

    @staticmethod
    def read(resp, rec: Record, t0: float, body: dict) -> None:
        if "jsonlines" in resp.headers.get("content-type", ""):
            _read_stream(resp, rec, t0)
        else:
            _read_json(resp.json(), rec)


class OpenAICompletions:
    """OpenAI's /v1/completions with vLLM's extensions: greedy (temperature 0), `ignore_eos`,
    `max_tokens` = max_new_tokens, streamed as SSE with `stream_options.include_usage` so the
    last chunk's usage.completion_tokens counts the output exactly (a chunk may carry several
    tokens or none). TTFT: the first chunk carrying a choice. Finish reasons map to LMI's
    (stop -> eos_token). `eos_after: K` is sent as max_tokens = min(K, max_new_tokens) and
    reported as eos_token when K <= max_new_tokens, as the peers do."""
    name = "openai"

    def __init__(self, model: str = "bench"):
        self.model = model   # vLLM refuses a name it does not serve (--served-model-name)

    @staticmethod
    def url(base: str) -> str:
        return base.rstrip("/").removesuffix("/invocations") + "/v1/completions"

    def body(self, b: dict) -> dict:
        p = b.get("parameters") or {}
        n, k = p.get("max_new_tokens", 30), p.get("eos_after")
        out = {"model": self.model, "prompt": b["inputs"], "max_tokens": min(n, k) if k else n,
               "temperature": 0, "ignore_eos": bool(p.get("ignore_eos", False)),
               "stream": bool(b.get("stream", False))}
        if out["stream"]:
            out["stream_options"] = {"include_usage": True}
        if p.get("guided_json") is not None:      # vLLM's current name for it (ours too)
            out["structured_outputs"] = {"json": p["guided_json"]}
        return out

    @staticmethod
    def _reason(reason, body: dict) -> str | None:
        p = body.get("parameters") or {}
        k = p.get("eos_after")
        if k is not None and k <= p.get("max_new_tokens", 30):
            return "eos_token"
        return {"stop": "eos_token", "length": "length"}.get(reason, reason)

    def read(self, resp, rec: Record, t0: float, body: dict) -> None:
        if "text/event-stream" not in resp.headers.get("content-type", ""):
            answer = resp.json()
            rec.tokens = int(answer["usage"]["completion_tokens"])
            rec.finish_reason = self._reason(answer["choices"][0].get("finish_reason"), body)
            return
        usage = reason = None
        for line in resp.iter_lines(chunk_size=None):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                rec.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"[:300]
                return
            for c in chunk.get("choices") or ():
                if rec.ttft is None:
                    rec.ttft = time.perf_counter() - t0 - rec.start
                reason = c.get("finish_reason") or reason
            if chunk.get("usage"):
                usage = chunk["usage"]
        if usage is None:
            rec.error = "stream ended without a usage chunk (stream_options.include_usage)"
            return
        rec.tokens = int(usage["completion_tokens"])
        rec.finish_reason = self._reason(reason, body)


class LlamaCppCompletions(OpenAICompletions):
    """llama.cpp's llama-server on /v1/completions: OpenAI's body with the prompt sent as the
    token ids our tokenizer gives (every cell then prefills the very same ids; llama.cpp would
    otherwise tokenize with the GGUF's copy of the vocabulary) and `"cache_prompt": false` (its
    prompt cache off per request). Its last streamed chunk carries `usage` (no stream_options
    needed; sent anyway, it is accepted)."""
    name = "llamacpp"

    def __init__(self, tokenizer, model: str = "bench"):
        super().__init__(model)
        self.tok = tokenizer

    def body(self, b: dict) -> dict:
        out = super().body(b)
        out["prompt"] = list(self.tok(b["inputs"])["input_ids"])
        out["cache_prompt"] = False
        out.pop("structured_outputs", None)   # vLLM's name; llama.cpp's differs (json_schema)
        return out


def send_one(session: requests.Session, url: str, body: dict, t0: float, timeout: float,
             api=LMI, wire: dict | None = None) -> Record:
    """POST one request; times are relative to t0 (time.perf_counter()). `body` is LMI's;
    `wire` is what goes out (api.body(body) unless given)."""
    start = time.perf_counter() - t0
    rec = Record(start=start, end=start)
    try:
        with session.post(url, json=api.body(body) if wire is None else wire, stream=True,
                          timeout=(10, timeout)) as resp:
            if resp.status_code != 200:
                rec.error = _error_text(resp)
            else:
                api.read(resp, rec, t0, body)
    except (requests.RequestException, ValueError, KeyError, TypeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    rec.end = time.perf_counter() - t0
    return rec


def _read_stream(resp, rec: Record, t0: float) -> None:
    # chunk_size=None: hand each chunk over as it arrives (a fixed size would wait to fill it).
    last = None
    for line in resp.iter_lines(chunk_size=None):
        if not line:
            continue
        msg = json.loads(line)
        if "error" in msg and "token" not in msg:
            rec.error = f"stream error: {msg['error']}"[:300]
            return
        if "token" in msg:
            if rec.ttft is None:
                rec.ttft = time.perf_counter() - t0 - rec.start
            rec.tokens += 1
        last = msg
    if last is None or "generated_text" not in last:
        rec.error = "stream ended without a final line carrying generated_text"
        return
    details = last.get("details") or {}
    rec.finish_reason = details.get("finish_reason")
    if "generated_tokens" in details:
        rec.tokens = int(details["generated_tokens"])


def _read_json(body, rec: Record) -> None:
    if isinstance(body, list):   # a one-element list answer is still one request
        body = body[0]
    details = body.get("details")
    if not details or "generated_tokens" not in details:
        raise KeyError("response has no details.generated_tokens (send parameters.details=true)")
    rec.tokens = int(details["generated_tokens"])
    rec.finish_reason = details.get("finish_reason")


def run_load(url: str, bodies: list[dict], concurrency: int, timeout: float = 900.0,
             progress: bool = True, desc: str = "bench", arrivals: list[float] | None = None,
             stop: threading.Event | None = None, on_start=None, on_done=None, api=LMI
             ) -> tuple[list[Record], float]:
    """Send `bodies` through `concurrency` closed-loop clients. Returns (records in body
    order, duration from the first send to the last answer).

    arrivals: open loop instead: body i is sent `arrivals[i]` seconds after the start (one
    thread per request in flight; `concurrency` is ignored). stop: once set, no further
    request is sent (those in flight finish; the records returned are those that ended).
    on_start(i, t) / on_done(i, record): called from the client threads (the tuner's watch).
    api: the adapter that turns LMI bodies into the server's (url must be its route)."""
    from tqdm import tqdm

    wire = [api.body(b) for b in bodies]   # translated before the clock starts
    records: list[Record | None] = [None] * len(bodies)
    next_i = iter(range(len(bodies)))
    lock = threading.Lock()
    bar = tqdm(total=len(bodies), desc=desc, file=sys.stderr, disable=not progress,
               unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()

    def one(s, i):
        if on_start:
            on_start(i, time.perf_counter() - t0)
        records[i] = send_one(s, url, bodies[i], t0, timeout, api, wire[i])
        if on_done:
            on_done(i, records[i])
        with lock:
            bar.update(1)

    def client():
        with requests.Session() as s:
            while stop is None or not stop.is_set():
                with lock:
                    i = next(next_i, None)
                if i is None:
                    return
                one(s, i)

    def opened(i):
        with requests.Session() as s:
            one(s, i)

    threads = []
    if arrivals is None:
        threads = [threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, len(bodies)))]
        for t in threads:
            t.start()
    else:
        for i in sorted(range(len(bodies)), key=lambda k: arrivals[k]):
            wait = arrivals[i] - (time.perf_counter() - t0)
            if stop is not None and stop.wait(max(0.0, wait)):
                break
            if stop is None and wait > 0:
                time.sleep(wait)
            threads.append(threading.Thread(target=opened, args=(i,), daemon=True))
            threads[-1].start()
    for t in threads:
        t.join()
    bar.close()
    done = [r for r in records if r is not None]
    duration = max(r.end for r in done) - min(r.start for r in done) if done else 0.0
    return done, duration


def invocations_url(url: str) -> str:
    """Accept a base URL (http://host:port) or the full /invocations URL."""
    url = url.rstrip("/")
    return url if url.endswith("/invocations") else url + "/invocations"


def wait_ready(base_url: str, timeout: float = 120.0, proc=None, path: str = "/ping") -> None:
    """Poll GET `path` (/ping; llama-server: /health) until 200; raise TimeoutError (or
    RuntimeError if proc died)."""
    base = base_url.rstrip("/").removesuffix("/invocations")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before /ping answered")
        try:
            if requests.get(base + path, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{base}{path} did not answer 200 within {timeout:.0f} s")
