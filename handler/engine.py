"""The engine loop: intake -> schedule -> runner.step -> update -> per-request channels.

One thread owns the scheduler, the block manager and the runner. HTTP threads talk to it only
through `submit` / `abort` and read their results from a per-request `Channel`.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .blocks import BlockManager
from .detok import IncrementalDetokenizer
from .request import SamplingParams
from .scheduler import CapacityError, QueueFull, Scheduler, SchedulerPolicy, Sequence

log = logging.getLogger("lmi.engine")


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str          # length | eos_token | stop_sequence
    generated_text: str
    generated_tokens: int
    prompt_tokens: int
    # decoder_input_details: every prompt token as (id, text, log_prob); the first has None.
    prefill: tuple | None = None
    cumulative_log_prob: float = 0.0
    queue_time_s: float = 0.0       # submit -> first scheduled
    preemptions: int = 0


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str
    log_prob: float
    done: DoneEvent | None = None   # set on a sequence's last token
    special: bool = False           # a special token (EOS, ...): its text is "" in generated_text
    top_tokens: tuple = ()          # top_n_tokens: ((id, text, log_prob), ...) most likely first
    time: float = 0.0               # time.monotonic() when the engine emitted it


@dataclass(frozen=True)
class ErrorEvent:
    status: int                 # HTTP status: 424 model failure, 503 shutting down, ...
    message: str


@dataclass(eq=False)
class Channel:
    """What one prompt's HTTP thread reads: TokenEvents, the last with `done` set, or an
    ErrorEvent (which may follow some tokens)."""
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    submitted: float = field(default_factory=time.monotonic)
    prompt_index: int = 0           # which prompt of the submission
    sample_index: int = 0           # which of that prompt's params.num_samples sequences


class Engine:
    def __init__(self, runner, policy: SchedulerPolicy, block_size: int,
                 enable_prefix_caching: bool = False):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.blocks = BlockManager(runner.kv.num_blocks, block_size,
                                   enable_prefix_caching and policy.strategy == "paged")
        self.scheduler = Scheduler(policy, self.blocks)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._intake: list[tuple[Sequence, Channel]] = []
        self._aborts: list[int] = []
        self._channels: dict[int, Channel] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._stop = False
        self.healthy = True
        self.error: str | None = None
        self.counters = {"requests": 0, "rejected_queue_full": 0, "aborted": 0, "failed": 0,
                         "finished": 0, "generated_tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="lmi-engine", daemon=True)

    # ---- called from HTTP threads
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def submit(self, prompts_ids: list[list[int]], params: SamplingParams) -> list[Channel]:
        """Queue prompts (all or none). Raises QueueFull or CapacityError."""
        now = time.monotonic()
        with self._lock:
            for ids in prompts_ids:
                self.scheduler.check_fits(len(ids), params)
            pending = len(self.scheduler.waiting) + len(self._intake)
            if pending + len(prompts_ids) > self.scheduler.policy.max_waiting:
                self.counters["rejected_queue_full"] += len(prompts_ids)
                raise QueueFull(f"the queue is full ({self.scheduler.policy.max_waiting} requests "
                                f"waiting; job_queue_size)")
            chans = []
            group = None
            for ids in prompts_ids:
                sid = next(self._ids)
                group = sid if group is None else group
                ch = Channel(sid, ids, params)
                self._intake.append((Sequence(sid, list(ids), params, now,
                                              group=group if len(prompts_ids) > 1 else None), ch))
                chans.append(ch)
            self.counters["requests"] += len(chans)
        self._wake.set()
        return chans

    def abort(self, seq_id: int) -> None:
        with self._lock:
            self._aborts.append(seq_id)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    def stats(self) -> dict:
        s = self.scheduler
        return {"strategy": s.policy.strategy, "waiting": len(s.waiting) + len(self._intake),
                "running": len(s.running), **s.stats, **s.kv_usage(), **self.counters,
                "prefix_cache_hit_tokens": self.blocks.hit_tokens}

    # ---- the engine thread
    def _loop(self) -> None:
        while not self._stop:
            try:
                self._iteration()
            except Exception as e:  # a bug, not a model failure: answer everyone, start clean
                log.exception("engine iteration failed; failing in-flight requests")
                for sid in list(self._channels):
                    self._end(sid, ErrorEvent(500, f"internal engine error: {type(e).__name__}: {e}"))
                self.blocks.__init__(self.blocks.num_blocks, self.blocks.block_size,
                                     self.blocks.prefix_caching)
                self.scheduler.__init__(self.scheduler.policy, self.blocks)
        for sid in list(self._channels):
            self._end(sid, ErrorEvent(503, "the server is shutting down"))

    def _iteration(self) -> None:
        self._drain()
        sched = self.scheduler
        if not sched.has_work:
            self._wake.wait(1.0)
            self._wake.clear()
            return
        plan = sched.schedule(time.monotonic())
        if not plan.items:
            wait = sched.next_wakeup(time.monotonic())
            self._wake.wait(0.05 if wait is None else min(wait, 0.05))
            self._wake.clear()
            return
        try:
            results = self.runner.step(plan.items)
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            log.exception("model step failed")
            self.counters["failed"] += len(plan.items)
            for it in plan.items:
                self._end(it.seq_id, ErrorEvent(424, f"model failure: {type(e).__name__}: {e}"))
            return
        by_seq = {it.seq_id: r for it, r in zip((i for i in plan.items if i.sample), results)}
        for seq in sched.update(plan, [t for t, _ in results]):
            self._emit(seq, *by_seq[seq.seq_id])

    def _drain(self) -> None:
        with self._lock:
            intake, self._intake = self._intake, []
            aborts, self._aborts = self._aborts, []
        for seq, ch in intake:
            try:
                self.scheduler.add(seq)
            except (QueueFull, CapacityError) as e:   # raced past submit's check
                ch.events.put(ErrorEvent(503 if isinstance(e, QueueFull) else 400, str(e)))
                continue
            self._channels[seq.seq_id] = ch
            self._detok[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_ids, seq.params.stop_sequences)
        for sid in aborts:
            if sid in self._channels:
                self.counters["aborted"] += 1
                self._end(sid, None)

    def _emit(self, seq: Sequence, token: int, logprob: float) -> None:
        ch = self._channels.get(seq.seq_id)
        if ch is None:
            return
        detok = self._detok[seq.seq_id]
        text = detok.add(token)
        if seq.finished and not detok.stopped:
            text += detok.flush()
        self.counters["generated_tokens"] += 1
        reason = "stop_sequence" if detok.stopped else seq.finish_reason
        done = None
        if reason:
            queued = (seq.first_scheduled or seq.arrival) - seq.arrival
            done = DoneEvent(reason, detok.text, seq.num_output, len(seq.prompt_ids),
                             queue_time_s=queued, preemptions=seq.preemptions)
        ch.events.put(TokenEvent(token, text, logprob, done, time=time.monotonic()))
        if done:
            self.counters["finished"] += 1
            self._end(seq.seq_id, None)

    def _end(self, seq_id: int, event) -> None:
        self.scheduler.finish(seq_id, "aborted")
        self.runner.release(seq_id)
        self._detok.pop(seq_id, None)
        ch = self._channels.pop(seq_id, None)
        if ch is not None and event is not None:
            ch.events.put(event)
