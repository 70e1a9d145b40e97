"""The pooling engine: embedding, classification and cross-encoder models (option.task != generate).

No KV cache and no decode steps: a request is a list of token sequences, each pooled by one forward.
One engine thread gathers waiting inputs into a batch by the dynamic batcher's contract: it starts a
batch when the first input waits, then takes more until `max_batch_tokens` tokens or
`max_batch_size` inputs are gathered or `max_batch_delay_s` has passed since the first one (0: at
once), and hands the batch to the runner (`PoolRunner.pool`: packed sequences in, one result each
out). A request's inputs may span several batches; the request is done when all of its are.

No torch here: results are whatever the runner returns per input (lists of floats), passed through.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from handler.engine.admission import CapacityError, QueueFull

log = logging.getLogger("lmi.pooling")

# What a runner computes for an input: `embed` a pooled vector (the model's pooling, normalized or not as
# the checkpoint says), `classify` the head's raw logits (a cross-encoder's relevance is one logit).
KINDS = ("embed", "classify")


@dataclass(frozen=True)
class PoolInput:
    """One sequence to pool: token ids, and segment ids for a pair (a cross-encoder's query + text)."""
    ids: list[int]
    type_ids: list[int] | None = None


class PoolRunner(Protocol):
    """What the engine needs of the model side (handler/model/pooling.py PoolingRunner)."""
    tokenizer: object
    max_model_len: int
    task: str                       # handler/config/task.py: text_embedding | classify | rerank

    def pool(self, inputs: list[PoolInput], kind: str) -> list[list[float]]: ...


@dataclass(eq=False)
class PoolJob:
    """One request's inputs and, once done, its results (one per input, in order) or its error."""
    inputs: list[PoolInput]
    kind: str
    results: list = field(default_factory=list)
    error: str | None = None
    submitted: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    wake: object = None             # the gevent front end's wake-up (handler/http/hub.py), else None
    remaining: int = 0
    prompt_tokens: int = 0

    def wait(self, timeout: float | None) -> bool:
        """True once done; False after `timeout` seconds."""
        if self.wake is not None:
            return bool(self.wake.wait(timeout)) or self.done.is_set()
        return self.done.wait(timeout)


@dataclass
class PoolingPolicy:
    max_batch_tokens: int           # tokens of one forward (a long input alone may exceed it)
    max_batch_size: int             # inputs of one forward
    max_batch_delay_s: float        # the dynamic batcher's wait after the first input
    max_waiting: int                # inputs waiting beyond the running batch (job_queue_size): 503 past it,
                                    # unless the queue is empty


class PoolingEngine:
    """Engine-like object for the HTTP layer's EngineClient (handler/engine/client.py PoolingClient)."""

    pooling = True

    def __init__(self, runner: PoolRunner, policy: PoolingPolicy, waker=None):
        self.runner, self.policy, self.waker = runner, policy, waker
        self.tokenizer = runner.tokenizer
        self.max_model_len = runner.max_model_len
        self.task = runner.task
        self.hidden_size = getattr(runner, "hidden_size", None)     # an embedding's width (dimensions' bound)
        self.id2label = dict(getattr(runner, "id2label", None) or {})     # a classifier's label names
        self._queue: collections.deque = collections.deque()    # (job, index) per waiting input
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.healthy, self.error = True, None
        # /metrics' names (handler/http/metrics.py ENGINE_SERIES)
        self.counters = {"pooling_requests": 0, "pooling_inputs": 0, "pooling_tokens": 0, "pooling_batches": 0,
                         "rejected_queue_full": 0, "pooling_failed_batches": 0}

    # ---- HTTP threads
    def submit(self, inputs: list[PoolInput], kind: str) -> PoolJob:
        """Queue a request's inputs; raises CapacityError (an input longer than the model) or QueueFull."""
        if kind not in KINDS:
            raise ValueError(f"unknown pooling kind {kind!r}")
        for i, x in enumerate(inputs):
            if len(x.ids) > self.max_model_len:
                raise CapacityError("input", f"input {i} has {len(x.ids)} tokens; this model takes at most "
                                             f"{self.max_model_len} (ask for truncation to cut it)")
            if not x.ids:
                raise CapacityError("input", f"input {i} has no tokens")
        job = PoolJob(list(inputs), kind, results=[None] * len(inputs), remaining=len(inputs),
                      prompt_tokens=sum(len(x.ids) for x in inputs))
        if self.waker is not None:
            job.wake = self.waker.event()
        with self._cv:
            if not self.healthy:
                raise QueueFull(f"the engine is not serving: {self.error}")
            # inputs beyond the running batch; a request alone may exceed it (it is never refused forever)
            if self._queue and len(self._queue) + len(inputs) > self.policy.max_waiting:
                self.counters["rejected_queue_full"] += 1
                raise QueueFull(f"the queue is full ({len(self._queue)} inputs waiting; job_queue_size="
                                f"{self.policy.max_waiting}); retry later")
            self.counters["pooling_requests"] += 1
            self._queue.extend((job, i) for i in range(len(inputs)))
            self._cv.notify()
        return job

    def stats(self) -> dict:
        with self._cv:
            return {**self.counters, "waiting": len(self._queue)}     # inputs queued

    def check_health(self) -> bool:
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            self.healthy, self.error = False, self.error or "the pooling engine thread died"
        return self.healthy

    # ---- the engine thread
    def start(self) -> "PoolingEngine":
        self._thread = threading.Thread(target=self._run, name="lmi-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _take(self) -> list[tuple[PoolJob, int]] | None:
        """The next batch, by the policy (module doc); None when stopping."""
        p = self.policy
        with self._cv:
            while not self._queue and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            deadline = time.monotonic() + p.max_batch_delay_s
            while not self._stop:
                tokens = sum(len(j.inputs[i].ids) for j, i in self._queue)
                left = deadline - time.monotonic()
                if tokens >= p.max_batch_tokens or len(self._queue) >= p.max_batch_size or left <= 0:
                    break
                self._cv.wait(left)
            batch, tokens = [], 0
            while self._queue and len(batch) < p.max_batch_size:
                job, i = self._queue[0]
                n = len(job.inputs[i].ids)
                if batch and tokens + n > p.max_batch_tokens:
                    break
                batch.append(self._queue.popleft())
                tokens += n
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            finished = []
            for kind in KINDS:      # one forward per kind (a server has one task; /score may embed)
                part = [(j, i) for j, i in batch if j.kind == kind]
                if part:
                    finished += self._forward(part, kind)
            if finished and self.waker is not None:
                self.waker(finished)

    def _forward(self, part: list[tuple[PoolJob, int]], kind: str) -> list[PoolJob]:
        try:
            out = self.runner.pool([j.inputs[i] for j, i in part], kind)
            error = None
        except Exception as e:      # the batch's requests fail (424); the engine goes on
            log.exception("pooling forward failed")
            out, error = None, f"the model failed: {type(e).__name__}: {e}"
        finished = []
        with self._cv:
            self.counters["pooling_batches"] += 1
            self.counters["pooling_failed_batches"] += error is not None
            for k, (job, i) in enumerate(part):
                if error is not None:
                    job.error = error
                else:
                    job.results[i] = out[k]
                    self.counters["pooling_inputs"] += 1
                    self.counters["pooling_tokens"] += len(job.inputs[i].ids)
                job.remaining -= 1
                if job.remaining == 0 or (error is not None and not job.done.is_set()):
                    if error is not None:   # its other inputs still queued are dropped
                        self._queue = collections.deque((j, x) for j, x in self._queue if j is not job)
                    job.done.set()
                    finished.append(job)
        return finished
