"""Prometheus metrics (prometheus_client, one registry per server) and the per-request log line.

Where each figure is recorded, so that the engine's loop stays free of it:
- HTTP threads, once per request when its response closes (`RequestTrace.finish`): the latency
  and length histograms and the outcome counter. Per-token times come from the events the
  engine already stamps (`TokenEvent.time`, `DoneEvent.queue_time_s`), noted (`RequestTrace.note`)
  as the route reads them (handler/http/protocols: collect / stream_events).
- The engine thread, once per step: two histogram observations (tokens and sequences per step)
  through Engine's `on_step`, given when the engine is built (handler/server.py).
- Scrape time (`EngineCollector`): gauges (running, waiting, KV, prefix cache) and the counters
  the engine keeps anyway (tokens, preemptions, prefix-cache hits), read from `EngineClient.stats()`
  (handler/engine/client.py: Engine.stats() and the derived KV figures).

Units: sequence-level histograms (TTFT, TPOT, queue, prompt/generation tokens) count engine
sequences (a list input of k prompts counts k); `lmi_e2e_request_latency_seconds` and
`lmi_requests_total` count HTTP requests (end-to-end: arrival to the last token). Latency histograms record successful requests only;
every request, failed or not, is counted once in `lmi_requests_total{outcome=...}`.
"""
from __future__ import annotations

import json
import logging
import random
import re
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

prometheus_client.disable_created_metrics()   # no *_created series: Grafana never plots them

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4
LABELS = ("model", "strategy")

# Seconds. Fine at the low end: a CPU decode step of a small model is a few milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
                   20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_SEQ_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)

# HTTP status -> outcome label, unless the route named a finer reason (`RequestTrace.reason`).
OUTCOMES = {200: "ok", 400: "bad_request", 404: "not_found", 405: "method_not_allowed",
            411: "length_required", 413: "too_large", 415: "unsupported_media_type", 422: "bad_request",
            424: "model_failure", 429: "throttled", 499: "aborted", 500: "internal",
            503: "unavailable", 504: "timeout"}

# Engine.stats() key -> (exported name, type, help). Keys not listed are still exported (as
# gauges named lmi_<key>) so that a new engine figure shows up before it is described here.
ENGINE_SERIES = {
    "running": ("lmi_running", "gauge", "Sequences in the running batch"),
    "waiting": ("lmi_waiting", "gauge", "Sequences waiting for admission"),
    "kv_utilization": ("lmi_kv_utilization", "gauge",
                       "KV slots written / KV slots allocated (1 - internal fragmentation)"),
    "kv_tokens_stored": ("lmi_kv_tokens_stored", "gauge", "KV slots holding a computed token"),
    "kv_tokens_allocated": ("lmi_kv_tokens_allocated", "gauge", "KV slots reserved by running sequences"),
    "kv_tokens_total": ("lmi_kv_tokens_total_capacity", "gauge", "KV slots in the pool"),
    "steps": ("lmi_steps", "counter", "Engine steps (forward passes)"),
    "prefill_tokens": ("lmi_prefill_tokens", "counter",
                       "Prompt tokens computed (recomputation after preemption included)"),
    "decode_tokens": ("lmi_decode_tokens", "counter", "Tokens fed as single decode steps"),
    "preemptions": ("lmi_preemptions", "counter", "Sequences preempted (recomputed later)"),
    "cached_prompt_tokens": ("lmi_cached_prompt_tokens", "counter",
                             "Prompt tokens served from the prefix cache at admission"),
    "admitted": ("lmi_admitted", "counter", "Sequences admitted into the running batch"),
    "forked_prompt_tokens": ("lmi_forked_prompt_tokens", "counter",
                             "Prompt tokens that n/best_of samples shared instead of recomputing"),
    "requests": ("lmi_engine_sequences", "counter", "Sequences submitted to the engine"),
    "rejected_queue_full": ("lmi_rejected_queue_full", "counter", "Sequences refused: queue full"),
    "aborted": ("lmi_aborted", "counter", "Sequences aborted (client gone or time-out)"),
    # a pooling model's engine (handler/engine/pooling.py)
    "pooling_requests": ("lmi_pooling_requests", "counter", "Pooling requests admitted"),
    "pooling_inputs": ("lmi_pooling_inputs", "counter", "Inputs pooled (embedded or scored)"),
    "pooling_tokens": ("lmi_pooling_tokens", "counter", "Tokens of the inputs pooled"),
    "pooling_batches": ("lmi_pooling_batches", "counter", "Forwards of the pooling engine"),
    "pooling_failed_batches": ("lmi_pooling_failed_batches", "counter", "Pooling forwards that failed"),
    "failed": ("lmi_failed", "counter", "Sequences failed by a model error"),
    "finished": ("lmi_finished", "counter", "Sequences finished"),
    "generated_tokens": ("lmi_generated_tokens", "counter", "Tokens generated (every sequence)"),
    "prefix_cache_hit_tokens": ("lmi_prefix_cache_hit_tokens", "counter",
                                "Prompt tokens found in the prefix cache"),
    # a vision-language model's encoder stage (handler/model/vision.py)
    "encoder_runs": ("lmi_encoder_runs", "counter",
                     "Vision encoder forwards (each encodes one image: its tiles or crops)"),
    "encoder_images": ("lmi_encoder_images", "counter", "Images run through the vision encoder"),
    "encoder_cache_hits": ("lmi_encoder_cache_hits", "counter",
                           "Image embeddings served from the encoder cache (by the image's content hash)"),
    "encoder_cache_bytes": ("lmi_encoder_cache_bytes", "gauge", "Bytes of image embeddings in the encoder cache"),
    "encoder_cache_images": ("lmi_encoder_cache_images", "gauge", "Images in the encoder cache"),
}

log = logging.getLogger("lmi.request")
_ID_OK = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id(headers) -> tuple[str, str | None]:
    """(id, header it came in): SageMaker's X-Amzn-RequestId, else X-Request-Id, else a new one.
    An id that is not a short token of safe characters is replaced (it goes into logs/headers)."""
    for name in ("X-Amzn-RequestId", "X-Request-Id"):
        v = headers.get(name)
        if v and _ID_OK.fullmatch(v):
            return v, name
    # 128 random bits from the process's generator (reseeded in each forked worker): uuid4 reads
    # os.urandom, a system call that gives up the GIL on every request
    return f"{random.getrandbits(128):032x}", None


class EngineCollector:
    """Reads the engine's snapshot at scrape time; nothing is recorded between scrapes.
    get_client() -> the engine's handler.engine.client.EngineClient, or None while loading."""

    def __init__(self, get_client, labels: tuple[str, str], http_stats=None):
        self.get_client, self.labels, self.http_stats = get_client, list(labels), http_stats

    def _http(self, refused_box: list):
        h = self.http_stats()
        fam = CounterMetricFamily("lmi_http_responses", "Generation responses by status class",
                                  labels=LABELS + ("class",))
        for cls, n in h["responses"].items():
            fam.add_metric(self.labels + [cls], n)
        yield fam
        fam = CounterMetricFamily("lmi_http_client_disconnects",
                                  "Clients gone during their upload or mid-stream", labels=LABELS)
        fam.add_metric(self.labels, h["client_disconnects"])
        yield fam
        fam = GaugeMetricFamily("lmi_http_in_flight", "Generation requests admitted and not yet closed",
                                labels=LABELS)
        fam.add_metric(self.labels, h["in_flight"])
        yield fam
        refused_box.append(h["refused"])

    def collect(self):
        refused: list = []
        if self.http_stats is not None:
            yield from self._http(refused)
        client = self.get_client()
        if client is None:
            return
        stats = client.stats()
        # Refused at the HTTP door or by the engine: one count of queue-full refusals.
        stats["rejected_queue_full"] = stats.get("rejected_queue_full", 0) + sum(refused)
        extra = {"prefix_cache_blocks_cached": ("lmi_prefix_cache_blocks_cached", "gauge",
                                                "KV blocks holding a registered prefix (in use or not)"),
                 "prefix_cache_blocks_evictable": ("lmi_prefix_cache_blocks_evictable", "gauge",
                                                   "Cached-prefix blocks unreferenced and reclaimable"),
                 "kv_cache_usage": ("lmi_kv_cache_usage", "gauge", "KV slots allocated / KV slots in the pool"),
                 "prefix_cache_occupancy": ("lmi_prefix_cache_occupancy", "gauge",
                                            "Share of KV blocks holding a cached prefix")}
        for key, value in stats.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name, kind, doc = ENGINE_SERIES.get(key) or extra.get(key) or (
                f"lmi_{key}", "gauge", f"engine statistic {key}")
            fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=LABELS)
            fam.add_metric(self.labels, value)
            yield fam
        # LoRA: requests and generated tokens per adapter (handler/model/lora.py)
        per_adapter = client.adapter_counters()
        if per_adapter:
            for key, doc in (("requests", "Requests per LoRA adapter"),
                             ("generated_tokens", "Generated tokens per LoRA adapter")):
                fam = CounterMetricFamily(f"lmi_adapter_{key}", doc, labels=LABELS + ("adapter",))
                for adapter, c in sorted(per_adapter.items()):
                    fam.add_metric(self.labels + [adapter], c[key])
                yield fam
        yield from spec_families(stats.get("spec"), self.labels)
        causes = stats.get("preemptions_by_cause")
        if causes:
            fam = CounterMetricFamily("lmi_preemptions_by_cause", "Sequences preempted (recomputed later), by "
                                      "cause: kv_cache (blocks ran out), priority (a lower number needed room)",
                                      labels=LABELS + ("cause",))
            for cause, n in sorted(causes.items()):
                fam.add_metric(self.labels + [cause], n)
            yield fam


def priority_label(priority: int) -> str:
    """A request priority as a label value: -9..9 as themselves, the rest in two open classes (a
    client's integer must not make a new series each)."""
    return str(priority) if -10 < priority < 10 else ("<=-10" if priority < 0 else ">=10")


def spec_families(spec: dict | None, labels: list):
    """Speculative decoding per method (handler/engine/spec.py; Engine.stats()["spec"]): draft
    tokens proposed and accepted, verify steps, the mean tokens a verify step emits (accepted + 1)
    and the acceptance rate (accepted / proposed)."""
    if not spec:
        return
    for key, doc in (("proposed", "Draft tokens proposed"), ("accepted", "Draft tokens accepted"),
                     ("verifies", "Sequence verify steps (one per sequence per step with a draft)")):
        fam = CounterMetricFamily(f"lmi_spec_decode_{key}", doc, labels=LABELS + ("method",))
        for method, c in sorted(spec.items()):
            fam.add_metric(labels + [method], c[key])
        yield fam
    for name, doc, f in (
            ("lmi_spec_decode_mean_accepted_length", "Tokens emitted per verify step (accepted + 1)",
             lambda c: (c["accepted"] + c["verifies"]) / c["verifies"] if c["verifies"] else 0.0),
            ("lmi_spec_decode_acceptance_rate", "Draft tokens accepted / proposed",
             lambda c: c["accepted"] / c["proposed"] if c["proposed"] else 0.0)):
        fam = GaugeMetricFamily(name, doc, labels=LABELS + ("method",))
        for method, c in sorted(spec.items()):
            fam.add_metric(labels + [method], f(c))
        yield fam


class Metrics:
    def __init__(self, model: str, strategy: str, get_client=lambda: None, http_stats=None):
        self.registry = CollectorRegistry()
        self.labels = (model, strategy)
        self.strategy = strategy

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*self.labels)

        self.ttft = hist("lmi_time_to_first_token_seconds",
                         "Request arrival to the sequence's first token", TTFT_BUCKETS)
        self.tpot = hist("lmi_time_per_output_token_seconds",
                         "Mean time between a sequence's tokens after the first", TPOT_BUCKETS)
        self.e2e = hist("lmi_e2e_request_latency_seconds",
                        "Request arrival to its response closed (HTTP requests)", LATENCY_BUCKETS)
        self.queue = hist("lmi_request_queue_time_seconds",
                          "Submission to first scheduled, per sequence", QUEUE_BUCKETS)
        self.queue_by_priority = Histogram(
            "lmi_request_queue_time_by_priority_seconds", "Submission to first scheduled, per sequence, by "
            "request priority (option.scheduling_policy=priority; 0 otherwise)", LABELS + ("priority",),
            buckets=QUEUE_BUCKETS, registry=self.registry)
        self.prompt_len = hist("lmi_request_prompt_tokens", "Prompt length per sequence", TOKEN_BUCKETS)
        self.output_len = hist("lmi_request_generation_tokens", "Generated tokens per sequence", TOKEN_BUCKETS)
        self.step_tokens = hist("lmi_step_tokens", "Tokens fed to the model per engine step",
                                STEP_TOKEN_BUCKETS)
        self.step_seqs = hist("lmi_step_sequences", "Sequences in the batch per engine step (occupancy)",
                              STEP_SEQ_BUCKETS)
        self.requests = Counter("lmi_requests", "HTTP inference requests by outcome",
                                LABELS + ("outcome", "code"), registry=self.registry)
        self.registry.register(EngineCollector(get_client, self.labels, http_stats))

    def count(self, outcome: str, code: int) -> None:
        """A request refused before Flask saw it (no trace)."""
        self.requests.labels(*self.labels, outcome, str(code)).inc()

    def observe_step(self, plan) -> None:
        """Engine thread, once per step."""
        self.step_tokens.observe(sum(len(it.token_ids) for it in plan.items))
        self.step_seqs.observe(len(plan.items))

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _Seq:
    __slots__ = ("prompt_tokens", "first", "last", "tokens", "done", "priority")

    def __init__(self, prompt_tokens: int, priority: int = 0):
        self.prompt_tokens, self.first, self.last, self.tokens, self.done = prompt_tokens, None, None, 0, None
        self.priority = priority


class RequestTrace:
    """One HTTP request: its id, the events its channels delivered, and (once) its record."""

    def __init__(self, metrics: Metrics, rid: str, start: float | None = None):
        self.metrics, self.id = metrics, rid
        self.start = time.monotonic() if start is None else start
        self.seqs: list[_Seq] = []
        self.reason: str | None = None     # a finer outcome than the status gives (queue_full, ...)
        self.error = None                  # the first ErrorEvent seen
        self.status: int | None = None
        self._finished = False

    def watch(self, chans) -> None:
        """The request's sequences: `note(i, event)` then records chans[i]'s events."""
        for ch in chans:
            self.seqs.append(_Seq(len(ch.prompt_ids), ch.params.priority))

    def note(self, idx: int, ev) -> None:
        """One event of sequence idx, as the route reads it (an ErrorEvent(504): a time-out)."""
        s = self.seqs[idx]
        t = getattr(ev, "time", None)
        if t is None:                      # an ErrorEvent
            self.error = self.error or ev
            return
        s.first = t if s.first is None else s.first
        s.last = t
        s.tokens += 1
        if ev.done is not None:
            s.done = ev.done

    def outcome(self, status: int) -> tuple[str, int]:
        if status == 200:
            if self.error is not None:
                status = self.error.status
            elif not all(s.done for s in self.seqs):
                status = 499                       # accepted, then the client went away
        if self.reason and status != 200:
            return self.reason, status
        return OUTCOMES.get(status, "client_error" if status < 500 else "server_error"), status

    def finish(self, status: int) -> dict:
        """Record the request (once): metrics, then the log line. Returns the logged fields."""
        if self._finished:
            return {}
        self._finished = True
        end = time.monotonic()
        m = self.metrics
        outcome, code = self.outcome(status)
        m.requests.labels(*m.labels, outcome, str(code)).inc()
        ok = outcome == "ok"
        done = [s.done for s in self.seqs if s.done is not None]
        if ok:
            # As vLLM: arrival to the engine's last token (not the socket close, which races the
            # client reading its last line).
            m.e2e.observe(max((s.last for s in self.seqs if s.last is not None), default=end)
                          - self.start)
            for s in self.seqs:
                m.ttft.observe(s.first - self.start)
                if s.tokens > 1:
                    m.tpot.observe((s.last - s.first) / (s.tokens - 1))
                m.queue.observe(s.done.queue_time_s)
                m.queue_by_priority.labels(*m.labels, priority_label(s.priority)).observe(s.done.queue_time_s)
                m.prompt_len.observe(s.prompt_tokens)
                m.output_len.observe(s.done.generated_tokens)
        firsts = [s.first for s in self.seqs if s.first is not None]
        reasons = [d.finish_reason for d in done]
        fields = {
            "request_id": self.id, "status": code, "outcome": outcome, "strategy": m.strategy,
            "sequences": len(self.seqs),
            "prompt_tokens": sum(s.prompt_tokens for s in self.seqs),
            "output_tokens": sum(s.tokens for s in self.seqs),
            "queue_ms": _ms(max((d.queue_time_s for d in done), default=None)),
            "ttft_ms": _ms(min(firsts) - self.start if firsts else None),
            "total_ms": _ms(end - self.start),
            "finish_reason": reasons[0] if len(reasons) == 1 else (reasons or None),
            "preemptions": sum(d.preemptions for d in done),
        }
        log.info("%s", " ".join(f"{k}={_text(v)}" for k, v in fields.items()),
                 extra={"fields": fields})
        return fields


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _text(v) -> str:
    return "-" if v is None else ",".join(map(str, v)) if isinstance(v, list) else str(v)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, plus a record's `fields`
    (the request line's fields at the top level, for log queries such as CloudWatch Insights)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name}
        fields = getattr(record, "fields", None)
        if fields:
            out["message"] = "request"
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


JsonFormatter.converter = time.gmtime


def configure_logging(log_format: str, level: str = "INFO") -> None:
    """The root logger's format: "text" (the default) or "json" (option.log_format)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_format == "json":
        for name in ("", "gunicorn.error"):
            for h in logging.getLogger(name).handlers:
                h.setFormatter(JsonFormatter())
