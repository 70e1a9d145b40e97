"""The engine loop: intake -> drafts -> schedule -> runner.step -> update -> one batch of outputs per step.

One thread owns the scheduler, the block manager, the runner and speculative decoding's proposer.
HTTP threads talk to it only through `submit` / `abort`; each step's SeqOutputs go to the
OutputProcessor (handler/engine/output.py), which turns them into text and events on each request's
Channel outside this loop. `Engine.step()` is one iteration: the loop calls it, and so do the
benchmarks and tests that drive an engine by hand (`run_by_hand`).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time

from handler.engine.admission import Admission, CapacityError, QueueFull  # noqa: F401 (re-exported)
from handler.engine.blocks import BlockManager
from handler.engine.output import Channel, OutputProcessor  # noqa: F401 (Channel re-exported)
from handler.engine.request import RequestError, SamplingParams
from handler.engine.scheduler import Scheduler, SchedulerPolicy, Sequence
from handler.engine.spec import drafts_of
from handler.engine.spec import proposer as ngram_proposer
# The events live in types.py; imported here also for `from handler.engine.loop import ...`.
from handler.engine.types import (DoneEvent, ErrorEvent, Finish, Proposer, Runner, SeqOutput,  # noqa: F401
                                  TokenEvent)

log = logging.getLogger("lmi.engine")


class Engine:
    """on_step(plan): called (engine thread) with each step's plan before it runs (metrics).
    waker: the event-loop front end's reader wake-up (handler/http/hub.py), or None."""

    def __init__(self, runner: Runner, policy: SchedulerPolicy, block_size: int,
                 enable_prefix_caching: bool = False, step_timeout_s: float | None = None,
                 on_step=None, waker=None, proposer: Proposer | None = None):
        """proposer: speculative decoding's proposer (types.Proposer) when policy.spec is set; None:
        the n-gram one where the method is ngram (draft_model's holds a model: server.build_draft)."""
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
        # Asked between steps for the drafts of the sequences that decode next (Engine.step).
        self.proposer: Proposer | None = proposer if proposer is not None or policy.spec is None \
            else ngram_proposer(policy.spec)
        self.admission = Admission(policy.max_batch_size, policy.max_waiting, policy.max_model_len,
                                   self.blocks.num_blocks * self.blocks.block_size)
        self.output = OutputProcessor(self.tokenizer, self.end, waker)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._intake: list[Sequence] = []
        self._ends: list[tuple[int, Finish]] = []   # abort / end requests from other threads
        self._live: set[int] = set()                # sequences in the scheduler, not yet ended
        self._out: list[SeqOutput] = []             # this iteration's outputs
        self._stop = False
        self._by_hand = False   # run_by_hand(): no threads; the caller runs the iterations
        self.healthy = True
        self.on_step = on_step
        self.error: str | None = None
        self.counters = {"requests": 0, "rejected_queue_full": 0, "aborted": 0, "failed": 0,
                         "finished": 0, "generated_tokens": 0}
        # LoRA adapter name -> {"requests", "generated_tokens"} (/metrics, per adapter)
        self.adapter_counters: dict[str, dict[str, int]] = {}
        self._thread = threading.Thread(target=self._loop, name="lmi-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="lmi-watchdog", daemon=True)

    # ---- called from HTTP threads
    def start(self) -> "Engine":
        self.output.start()
        self._thread.start()
        self._watchdog.start()
        return self

    def check_health(self) -> bool:
        """False once the engine cannot serve: it was marked unhealthy (a broken rank group), its
        thread (or its output thread) has died, or a model step has run past step_timeout_s
        (wedged: a kernel that never returns, a deadlock). The first time, `error` gets the reason
        and it is logged; it stays unhealthy (a wedged device is not trusted again: /ping's 503
        gets the instance replaced)."""
        if not self.healthy:
            return False
        reason = None
        if (self._thread.ident is not None and not self._thread.is_alive() and not self._stop
                and not self._by_hand):
            reason = "the engine thread has died" + (f" ({self.error})" if self.error else "")
        elif not self.output.alive and not self._stop and not self._by_hand:
            reason = "the output thread has died"
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
               stream: bool = True, media: list[tuple] | None = None) -> list[Channel]:
        """Queue prompts (all or none): params.num_samples sequences per prompt, one Channel
        each, prompt-major. stream=False: each channel's token events arrive together with its
        last (Channel.held). `media`: per prompt its images (types.ImageRef, from the runner's
        MediaProcessor). Raises QueueFull (503: also when the engine is unhealthy, see
        check_health: nothing would answer) or CapacityError."""
        if not self.check_health():
            raise QueueFull(f"the server is unhealthy and takes no new requests: {self.error}")
        now = time.monotonic()
        k = params.num_samples
        # Guided decoding: one matcher per sequence, compiled (or found in the cache) here in the
        # caller's thread; a spec that cannot compile raises RequestError before anything queues.
        guides = [self._matcher(params) for _ in range(len(prompts_ids) * k)] \
            if params.guide is not None else None
        try:
            self.admission.admit([len(ids) for ids in prompts_ids], params)
        except QueueFull:
            with self._lock:
                self.counters["rejected_queue_full"] += len(prompts_ids)
            raise
        chans, seqs = [], []
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
                chans.append(self.output.open(sid, ids, params, prompt_index=p_i, sample_index=s_i,
                                              stream=stream))
                seqs.append(Sequence(
                    sid, list(ids), sp, now, group=group if len(prompts_ids) * k > 1 else None,
                    sample_index=s_i, fork_of=first if s_i else None,
                    guide=guides[p_i * k + s_i] if guides else None,
                    media=tuple(media[p_i]) if media else ()))
        with self._lock:
            self._intake.extend(seqs)
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
        """The reader is gone (or timed out): end the sequence, answer nobody."""
        self.end(seq_id, Finish.ABORTED)

    def end(self, seq_id: int, reason: Finish) -> None:
        """End a sequence from another thread (the output processor: a stop string, a failure)."""
        with self._lock:
            self._ends.append((seq_id, reason))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()

    def run_by_hand(self) -> "Engine":
        """Stop the engine's threads: the caller runs `step()` itself, in its own thread
        (benchmarks that time iterations, tests that step the engine); each step's outputs
        reach the channels before it returns."""
        self.shutdown()
        for thread in (self._thread, self._watchdog):
            if thread.ident is not None:    # started
                thread.join()
        self._stop, self._by_hand = False, True
        return self

    def stats(self) -> dict:
        s = self.scheduler
        with self._lock:
            waiting = len(s.waiting) + len(self._intake)
        return {"strategy": s.policy.strategy, "waiting": waiting,
                "running": len(list(s.running)), **dict(s.stats), **s.kv_usage(), **self.counters,
                "prefix_cache_hit_tokens": self.blocks.hit_tokens,
                # Blocks holding a registered prefix (in use or not) / of those, unreferenced
                # and reclaimable (len() of a dict is atomic: safe from an HTTP thread).
                "prefix_cache_blocks_cached": len(self.blocks.cached),
                "prefix_cache_blocks_evictable": len(self.blocks.evictable),
                # Speculative decoding per method: {"verifies", "proposed", "accepted"} (a copy).
                "spec": {m: dict(v) for m, v in s.spec_stats.items()},
                # Preemptions by cause (kv_cache, priority; a copy).
                "preemptions_by_cause": dict(s.preemption_causes),
                # A vision-language model's encoder stage: runs, images encoded, cache hits (a copy).
                **(vision.stats() if (vision := getattr(self.runner, "vision", None)) is not None else {})}

    # ---- the engine thread
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:   # the thread dies (a bug in reset, MemoryError): say why, fail all
            self.error = f"{type(e).__name__}: {e}"
            log.critical("the engine thread died: %s", self.error, exc_info=True)
            try:
                self.reset(ErrorEvent(503, f"the engine stopped: {self.error}"), intake=True)
            except BaseException:
                pass
            # The thread ends here; check_health() sees it and /ping turns 503.

    def _serve(self) -> None:
        while not self._stop:
            try:
                self.step()
            except Exception as e:  # a bug, not a model failure: answer everyone, start clean
                log.exception("engine iteration failed; failing in-flight requests")
                self.reset(ErrorEvent(500, f"internal engine error: {type(e).__name__}: {e}"))
        self.reset(ErrorEvent(503, "the server is shutting down"), intake=True)
        self.output.close()

    def _publish(self) -> list[SeqOutput]:
        """This iteration's outputs to the processor (its thread, or here when run by hand); returns them."""
        out, self._out = self._out, []
        if out:
            if self._by_hand:
                self.output.process(out)
            else:
                self.output.put(out)
        return out

    def reset(self, event: ErrorEvent, intake: bool = False) -> None:
        """Answer every sequence in flight with `event` (with intake: those submitted and not
        yet taken in too, as when the engine stops) and forget all engine state (engine thread
        only)."""
        if intake:
            with self._lock:
                taken, self._intake = self._intake, []
            self._live.update(seq.seq_id for seq in taken)
        for sid in list(self._live):
            self._end(sid, Finish.FAILED, event)
        self.scheduler.reset()
        if self.proposer is not None:
            self.proposer.reset()
        self.runner.sampler.reset()
        self._publish()

    def step(self) -> list[SeqOutput]:
        """One iteration of the engine (engine thread, or the caller's after run_by_hand): take in
        what was submitted and ended, draft, schedule, run the model step, apply its results, and
        hand the outputs to the output processor. Returns those outputs (token, finish, error per
        sequence; [] when nothing ran). With nothing to do it waits for a submission (at most 1 s);
        a plan that must wait (dynamic's batch delay) waits at most 50 ms."""
        try:
            self._step()
        finally:
            out = self._publish()
        return out

    def _propose(self) -> dict[int, list[int]]:
        """Speculative decoding's drafts for the sequences that decode this step (Scheduler.draft_asks,
        after admission), in this thread before the model step: the step watchdog is already timing
        it. A proposer that raises costs this step its drafts."""
        if self.proposer is None:
            return {}
        asks = self.scheduler.draft_asks()
        if not asks:
            return {}
        try:
            return drafts_of(asks, self.proposer.propose(asks))
        except Exception:
            log.warning("the %s proposer failed; this step decodes without drafts", self.proposer.method,
                        exc_info=True)
            for sid, _, _ in asks:
                self.proposer.release(sid)
            return {}

    def _step(self) -> None:
        self._drain()
        sched = self.scheduler
        if not sched.has_work:
            if not self._out:
                self._wake.wait(1.0)
                self._wake.clear()
            return
        # The watchdog times the drafts (a draft model's forwards) and the model step alike.
        self._step_started = time.monotonic()
        try:
            plan, results, now = self._run()
        finally:
            self._step_started = None
        if not plan.items:
            wait = sched.next_wakeup(time.monotonic())
            self._wake.wait(0.05 if wait is None else min(wait, 0.05))
            self._wake.clear()
            return
        if results is None:     # the model step failed (its sequences are ended)
            return
        got = sched.update(plan, results)
        # A verified draft gives a sequence several tokens in one step: its finish goes on the last.
        last = {seq.seq_id: i for i, (seq, _) in enumerate(got)}
        for i, (seq, res) in enumerate(got):
            if res.error is not None:
                self.counters["failed"] += 1
                self._end(seq.seq_id, Finish.FAILED, ErrorEvent(*res.error))
                continue
            self.counters["generated_tokens"] += 1
            p = seq.params
            if p.adapter is not None:
                with self._lock:
                    self.adapter_counters[p.adapter.name]["generated_tokens"] += 1
            first = seq.num_output == 1
            final = last[seq.seq_id] == i
            self._out.append(SeqOutput(
                seq.seq_id, res.token, res.logprob, res.top, seq.finish_reason if final else None, time=now,
                queue_time_s=(seq.first_scheduled or seq.arrival) - seq.arrival,
                preemptions=seq.preemptions,
                prompt_logprobs=tuple(seq.prompt_logprobs) if first and p.decoder_input_details else None))
            if seq.finished and final:
                self.counters["finished"] += 1
                self._end(seq.seq_id, seq.finish_reason, emitted=True)

    def _run(self):
        """Draft, schedule, run the model step: (plan, results or None when it failed, end time)."""
        sched = self.scheduler
        now = time.monotonic()
        sched.admit(now)        # then the drafts, for the step's batch, then its plan
        plan = sched.schedule(now, self._propose())
        if self.proposer is not None:
            for sid in plan.preempted:      # recomputed later: its draft state goes
                self.proposer.release(sid)
        if not plan.items:
            return plan, None, time.monotonic()
        if self.on_step is not None:
            self.on_step(plan)
        t0 = time.monotonic()
        try:
            results = self.runner.step(plan.items, plan.copies)
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            log.exception("model step failed")
            self.counters["failed"] += len(plan.items)
            for it in plan.items:
                self._end(it.seq_id, Finish.FAILED, ErrorEvent(424, f"model failure: {type(e).__name__}: {e}"))
            return plan, None, time.monotonic()
        now = time.monotonic()
        sched.observe_step(plan, now - t0)
        return plan, results, now

    def _drain(self) -> None:
        with self._lock:
            intake, self._intake = self._intake, []
            ends, self._ends = self._ends, []
        for seq in intake:
            self.scheduler.add(seq)
            self._live.add(seq.seq_id)
        for sid, reason in ends:
            if sid in self._live:
                self.counters[{Finish.ABORTED: "aborted", Finish.STOP: "finished"}.get(reason, "failed")] += 1
                self._end(sid, reason)

    def _end(self, seq_id: int, reason: Finish, event: ErrorEvent | None = None,
             emitted: bool = False) -> None:
        """The one exit of a sequence: the scheduler frees its blocks and records `reason`
        (unless it had one), the runner forgets it, admission counts it out, and (unless its
        last output is already out) the processor hears of its end: `event`, if any, is its
        reader's last."""
        if seq_id not in self._live:
            return
        self._live.discard(seq_id)
        self.scheduler.finish(seq_id, reason)
        self.runner.release(seq_id)
        if self.proposer is not None:
            self.proposer.release(seq_id)
        self.admission.release()
        if not emitted:
            self._out.append(SeqOutput(seq_id, finish=reason, error=event, time=time.monotonic()))
