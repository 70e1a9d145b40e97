"""The engine loop: intake -> schedule -> runner.step -> update -> per-request channels.

One thread owns the scheduler, the block manager and the runner. HTTP threads talk to it only
through `submit` / `abort` and read their results from a per-request `Channel`.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from handler.engine.blocks import BlockManager
from handler.engine.detok import IncrementalDetokenizer
from handler.engine.request import RequestError, SamplingParams
from handler.engine.scheduler import CapacityError, QueueFull, Scheduler, SchedulerPolicy, Sequence
# The events live in types.py; imported here also for `from handler.engine.loop import ...`.
from handler.engine.types import DoneEvent, ErrorEvent, Finish, Runner, SampleResult, TokenEvent

log = logging.getLogger("lmi.engine")


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
    # A reader that wants the whole answer (not a stream): its TokenEvents wait here and reach
    # `events` together with the last one, so its HTTP thread wakes once per sequence, not once
    # per token to take the GIL from the engine thread. None: each event is put at once.
    held: list | None = None
    # An event-loop front end's wake-up for the reader (handler/http/hub.py), set from
    # Engine.on_delivered; None: the reader blocks on `events` itself.
    wake: object = None

    def deliver(self, event, last: bool) -> bool:
        """`event` to the reader: held back when the reader wants the whole answer and this is
        not its last event (False), else put after whatever was held, in order (True)."""
        if self.held is not None:
            if not last:
                self.held.append(event)
                return False
            for ev in self.held:
                self.events.put(ev)
            self.held.clear()
        self.events.put(event)
        return True


class Engine:
    def __init__(self, runner: Runner, policy: SchedulerPolicy, block_size: int,
                 enable_prefix_caching: bool = False, step_timeout_s: float | None = None):
        self.runner = runner
        # The watchdog's bound on one model step (option.engine_step_timeout); None: no bound.
        self.step_timeout_s = step_timeout_s
        self._step_started: float | None = None     # monotonic start of the step in progress
        self.tokenizer = runner.tokenizer
        policy = dataclasses.replace(policy, prefix_caching=enable_prefix_caching)
        if enable_prefix_caching and not policy.prefix_caching:
            log.warning("option.enable_prefix_caching has no effect with the %s strategy (it reserves "
                        "every sequence's full length); it works with paged attention", policy.strategy)
        self.blocks = BlockManager(runner.kv.num_blocks, block_size, policy.prefix_caching)
        self.scheduler = Scheduler(policy, self.blocks)
        # Sequences waiting in the scheduler, as the engine thread last published it (under
        # _lock): HTTP threads count the queue from this and _intake, never the scheduler.
        self._waiting = 0
        self._running = 0
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._intake: list[tuple[Sequence, Channel]] = []
        self._aborts: list[int] = []
        self._channels: dict[int, Channel] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._pieces: dict[int, str] = {}
        self._special = frozenset(getattr(self.tokenizer, "all_special_ids", ()))
        self._stop = False
        self._by_hand = False   # run_by_hand(): no thread; the caller runs the iterations
        self.healthy = True
        self.on_step = None     # metrics: called with each step's plan (handler/http/metrics.py)
        # Called (engine thread) once per iteration with the channels that got events in it:
        # an event-loop front end wakes its readers from here (handler/http/hub.py), once per step.
        self.on_delivered = None
        self._touched: list[Channel] = []
        self.error: str | None = None
        self.counters = {"requests": 0, "rejected_queue_full": 0, "aborted": 0, "failed": 0,
                         "finished": 0, "generated_tokens": 0}
        # LoRA adapter name -> {"requests", "generated_tokens"} (/metrics, per adapter)
        self.adapter_counters: dict[str, dict[str, int]] = {}
        self._thread = threading.Thread(target=self._loop, name="lmi-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="lmi-watchdog", daemon=True)

    # ---- called from HTTP threads
    def start(self) -> "Engine":
        self._thread.start()
        self._watchdog.start()
        return self

    def check_health(self) -> bool:
        """False once the engine cannot serve: it was marked unhealthy (a broken rank group), its
        thread has died, or a model step has run past step_timeout_s (wedged: a kernel that never
        returns, a deadlock). The first time, `error` gets the reason and it is logged; it stays
        unhealthy (a wedged device is not trusted again: /ping's 503 gets the instance replaced)."""
        if not self.healthy:
            return False
        reason = None
        if (self._thread.ident is not None and not self._thread.is_alive() and not self._stop
                and not self._by_hand):
            reason = "the engine thread has died" + (f" ({self.error})" if self.error else "")
        started, bound = self._step_started, self.step_timeout_s
        if reason is None and started is not None and bound is not None:
            took = time.monotonic() - started
            if took > bound:
                reason = (f"a model step has run for {took:.1f} s, over option.engine_step_timeout="
                          f"{bound:g} s: the engine is wedged")
        if reason is None:
            return True
        with self._lock:
            if self.healthy:
                self.healthy = False
                self.error = reason
                log.error("unhealthy: %s; /ping answers 503", reason)
        return False

    def _watch(self) -> None:
        """Checks health about once a second (or four times per step_timeout_s), so that a dead or
        wedged engine is logged even before /ping asks; ends with the engine."""
        period = min(1.0, (self.step_timeout_s or 4.0) / 4)
        while not self._stop and self.check_health():
            time.sleep(period)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def submit(self, prompts_ids: list[list[int]], params: SamplingParams,
               stream: bool = True) -> list[Channel]:
        """Queue prompts (all or none): params.num_samples sequences per prompt, one Channel
        each, prompt-major. stream=False: each channel's token events arrive together with its
        last (Channel.held). Raises QueueFull (503: also when the engine is unhealthy, see
        check_health: nothing would answer) or CapacityError."""
        if not self.check_health():
            raise QueueFull(f"the server is unhealthy and takes no new requests: {self.error}")
        now = time.monotonic()
        k = params.num_samples
        # Guided decoding: one matcher per sequence, compiled (or found in the cache) here in the
        # caller's thread; a spec that cannot compile raises RequestError before anything queues.
        guides = [self._matcher(params) for _ in range(len(prompts_ids) * k)] \
            if params.guide is not None else None
        with self._lock:
            for ids in prompts_ids:
                self.scheduler.check_fits(len(ids), params)
            # Room: job_queue_size, plus the running slots now free (intake not yet drained may
            # go straight to one), so a server exactly at capacity still admits.
            free_slots = max(0, self.scheduler.policy.max_batch_size - self._running)
            pending = self._waiting + len(self._intake)
            if pending + len(prompts_ids) * k > self.scheduler.policy.max_waiting + free_slots:
                self.counters["rejected_queue_full"] += len(prompts_ids)
                raise QueueFull(f"the queue is full ({self.scheduler.policy.max_waiting} requests "
                                f"waiting; job_queue_size)")
            chans = []
            group = None
            for p_i, ids in enumerate(prompts_ids):
                first = None
                for s_i in range(k):
                    sid = next(self._ids)
                    group = sid if group is None else group
                    first = sid if first is None else first
                    # Each sample its own random stream: seed + index (as vLLM's n), so n
                    # seeded samples are reproducible and differ from each other.
                    sp = params if s_i == 0 or params.seed is None else \
                        dataclasses.replace(params, seed=params.seed + s_i)
                    ch = Channel(sid, ids, params, prompt_index=p_i, sample_index=s_i,
                                 held=None if stream else [])
                    self._intake.append((Sequence(
                        sid, list(ids), sp, now, group=group if len(prompts_ids) * k > 1 else None,
                        sample_index=s_i, fork_of=first if s_i else None,
                        guide=guides[p_i * k + s_i] if guides else None), ch))
                    chans.append(ch)
            self.counters["requests"] += len(prompts_ids)
            if params.adapter is not None:
                c = self.adapter_counters.setdefault(params.adapter.name,
                                                     {"requests": 0, "generated_tokens": 0})
                c["requests"] += len(prompts_ids)
        self._wake.set()
        return chans

    def _matcher(self, params: SamplingParams):
        guides = getattr(self.runner, "guides", None)
        if guides is None:
            raise RequestError(params.guide.field or "parameters",
                               "guided decoding is not available with this model runner")
        return guides.matcher(params.guide)

    def abort(self, seq_id: int) -> None:
        with self._lock:
            self._aborts.append(seq_id)
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    def run_by_hand(self) -> "Engine":
        """Stop the engine's thread and its watchdog: the caller runs `_iteration()` itself, in
        its own thread (benchmarks that time iterations, tests that step the engine)."""
        self.shutdown()
        self._thread.join()
        self._watchdog.join()
        self._stop, self._by_hand = False, True
        return self

    def stats(self) -> dict:
        s = self.scheduler
        with self._lock:
            waiting = self._waiting + len(self._intake)
        return {"strategy": s.policy.strategy, "waiting": waiting,
                "running": len(list(s.running)), **dict(s.stats), **s.kv_usage(), **self.counters,
                "prefix_cache_hit_tokens": self.blocks.hit_tokens,
                # Blocks holding a registered prefix (in use or not) / of those, unreferenced
                # and reclaimable (len() of a dict is atomic: safe from an HTTP thread).
                "prefix_cache_blocks_cached": len(self.blocks.cached),
                "prefix_cache_blocks_evictable": len(self.blocks.evictable)}

    # ---- the engine thread
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:   # the thread dies (a bug in reset, MemoryError): say why, fail all
            self.error = f"{type(e).__name__}: {e}"
            log.critical("the engine thread died: %s", self.error, exc_info=True)
            try:
                self.reset(ErrorEvent(503, f"the engine stopped: {self.error}"))
                self._wake_readers()
            except BaseException:
                pass
            # The thread ends here; check_health() sees it and /ping turns 503.

    def _serve(self) -> None:
        while not self._stop:
            try:
                self._iteration()
            except Exception as e:  # a bug, not a model failure: answer everyone, start clean
                log.exception("engine iteration failed; failing in-flight requests")
                self.reset(ErrorEvent(500, f"internal engine error: {type(e).__name__}: {e}"))
            self._wake_readers()
            with self._lock:
                self._waiting = len(self.scheduler.waiting)
                self._running = len(self.scheduler.running)
        self.reset(ErrorEvent(503, "the server is shutting down"))
        self._wake_readers()

    def _wake_readers(self) -> None:
        """The channels delivered to since the last call, to on_delivered (once per iteration)."""
        if self._touched:
            touched, self._touched = self._touched, []
            if self.on_delivered is not None:
                self.on_delivered(touched)

    def reset(self, event: ErrorEvent) -> None:
        """Answer every in-flight sequence with `event` and forget all engine state (engine
        thread only)."""
        for sid in list(self._channels):
            self._end(sid, Finish.FAILED, event)
        self.scheduler.reset()
        self.runner.sampler.reset()
        self._detok.clear()

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
        if self.on_step is not None:
            self.on_step(plan)
        self._step_started = time.monotonic()
        try:
            results = self.runner.step(plan.items, plan.copies)
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            self._step_started = None
            log.exception("model step failed")
            self.counters["failed"] += len(plan.items)
            for it in plan.items:
                self._end(it.seq_id, Finish.FAILED, ErrorEvent(424, f"model failure: {type(e).__name__}: {e}"))
            return
        self._step_started = None
        for seq, res in sched.update(plan, results):
            try:
                self._emit(seq, res)
            except Exception as e:      # e.g. the tokenizer on one sequence: fail it alone
                log.exception("emitting a token of sequence %d failed", seq.seq_id)
                self._end(seq.seq_id, Finish.FAILED,
                          ErrorEvent(500, f"internal engine error: {type(e).__name__}: {e}"))

    def _drain(self) -> None:
        with self._lock:
            intake, self._intake = self._intake, []
            aborts, self._aborts = self._aborts, []
            self._waiting += len(intake)    # counted until the exact figure after this iteration
        for seq, ch in intake:
            try:
                self.scheduler.add(seq)
            except (QueueFull, CapacityError) as e:   # raced past submit's check
                self._deliver(ch, ErrorEvent(503 if isinstance(e, QueueFull) else 400, str(e)), True)
                continue
            self._channels[seq.seq_id] = ch
            self._detok[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_ids, seq.params.stop_sequences,
                include_stop=seq.params.include_stop_str_in_output)
        for sid in aborts:
            if sid in self._channels:
                self.counters["aborted"] += 1
                self._end(sid, Finish.ABORTED)

    def _piece(self, token: int) -> str:
        """One token's own text (top tokens, prefill), special tokens included."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode(
                [token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text

    def _emit(self, seq: Sequence, res: SampleResult) -> None:
        ch = self._channels.get(seq.seq_id)
        if ch is None:
            return
        if res.error is not None:
            self.counters["failed"] += 1
            self._end(seq.seq_id, Finish.FAILED, ErrorEvent(*res.error))
            return
        token = res.token
        detok = self._detok[seq.seq_id]
        text = detok.add(token)
        if detok.stopped:               # a stop sequence ends it, whatever update decided
            seq.finish_reason = Finish.STOP
        elif seq.finished:
            text += detok.flush()
        self.counters["generated_tokens"] += 1
        if seq.params.adapter is not None:
            with self._lock:
                self.adapter_counters[seq.params.adapter.name]["generated_tokens"] += 1
        done = None
        if seq.finished:
            queued = (seq.first_scheduled or seq.arrival) - seq.arrival
            prefill = None
            if seq.params.decoder_input_details:
                lps = [None] + list(seq.prompt_logprobs)
                prefill = tuple((t, self._piece(t), lp) for t, lp in zip(seq.prompt_ids, lps))
            done = DoneEvent(str(seq.finish_reason), detok.text, seq.num_output, len(seq.prompt_ids),
                             prefill=prefill, cumulative_log_prob=seq.cum_logprob,
                             queue_time_s=queued, preemptions=seq.preemptions)
        top = tuple((t, self._piece(t), lp) for t, lp in res.top)
        ev = TokenEvent(token, text, res.logprob, done, special=token in self._special,
                        top_tokens=top, time=time.monotonic())
        self._deliver(ch, ev, done is not None)
        if done:
            self.counters["finished"] += 1
            self._end(seq.seq_id, seq.finish_reason)

    def _end(self, seq_id: int, reason: Finish, event: ErrorEvent | None = None) -> None:
        """The one exit of a sequence: the scheduler frees its blocks and records `reason`
        (unless it had one); `event`, if any, is its channel's last."""
        self.scheduler.finish(seq_id, reason)
        self.runner.release(seq_id)
        self._detok.pop(seq_id, None)
        ch = self._channels.pop(seq_id, None)
        if ch is not None and event is not None:
            self._deliver(ch, event, True)

    def _deliver(self, ch: Channel, event, last: bool) -> None:
        if ch.deliver(event, last) and self.on_delivered is not None:
            self._touched.append(ch)
