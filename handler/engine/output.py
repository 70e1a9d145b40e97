"""The output processor: the engine's per-step outputs -> text, stop strings, each request's Channel.

  engine thread    one list of SeqOutput per iteration (`put`), nothing else
  output thread    detokenizes, finds stop strings, renders top/prefill tokens' text, builds the
                   TokenEvent / DoneEvent / ErrorEvent and delivers it to the sequence's Channel;
                   then wakes the readers of every channel it delivered to, once per batch
  engine again     `end(seq_id, Finish.STOP)` when a stop string ended a sequence the engine still
                   runs; its later outputs are dropped here

So string work never delays the next model step (the forward releases the GIL; this thread runs
meanwhile). Channels are made here (`open`) and written only here. No torch.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from handler.engine.detok import IncrementalDetokenizer
from handler.engine.request import SamplingParams
from handler.engine.types import DoneEvent, ErrorEvent, Finish, SeqOutput, TokenEvent

log = logging.getLogger("lmi.engine")


@dataclass(eq=False)
class Channel:
    """What one sequence's reader gets: TokenEvents, the last with `done` set, or an ErrorEvent
    (which may follow some tokens). Made by OutputProcessor.open; read by one HTTP thread."""
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
    # An event-loop front end's wake-up for the reader (handler/http/hub.py: a gevent Event made
    # by the processor's waker); None: the reader blocks on `events` itself.
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


class _Stream:
    """One open channel's text state."""
    __slots__ = ("ch", "detok", "tokens", "cum_logprob", "prompt_logprobs")

    def __init__(self, ch: Channel):
        self.ch = ch
        self.detok: IncrementalDetokenizer | None = None    # made with the first token
        self.tokens = 0
        self.cum_logprob = 0.0
        self.prompt_logprobs: tuple = ()


class OutputProcessor:
    """end(seq_id, reason): the engine's way to end a sequence from another thread (thread-safe).
    waker: None, or an object with `event()` (a channel's wake-up, made in the submitting
    thread) and `__call__(channels)` (wake their readers; called from this processor's thread)."""

    def __init__(self, tokenizer, end: Callable[[int, Finish], None], waker=None):
        self.tokenizer = tokenizer
        self._end = end
        self.waker = waker
        self._streams: dict[int, _Stream] = {}
        self._pieces: dict[int, str] = {}
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        # Every special token, the added ones (<|im_start|>, ...) included: what spaces_between_special_tokens spaces.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._all_special = self._special | frozenset(i for i, t in added.items() if getattr(t, "special", False))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # ---- any thread
    def open(self, seq_id: int, prompt_ids: list[int], params: SamplingParams, *, prompt_index: int,
             sample_index: int, stream: bool) -> Channel:
        """The channel of a sequence about to be submitted (before the engine can emit for it)."""
        ch = Channel(seq_id, prompt_ids, params, prompt_index=prompt_index, sample_index=sample_index,
                     held=None if stream else [],
                     wake=self.waker.event() if self.waker is not None else None)
        self._streams[seq_id] = _Stream(ch)
        return ch

    @property
    def alive(self) -> bool:
        """False once its thread, having been started, has ended."""
        return self._thread is None or self._thread.is_alive()

    # ---- the engine thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmi-output", daemon=True)
        self._thread.start()

    def put(self, outputs: list[SeqOutput]) -> None:
        self._queue.put(outputs)

    def close(self) -> None:
        """Stop the thread once every batch put so far is processed."""
        if self._thread is not None:
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()
            self._thread = None

    # ---- the processor's thread (or the caller's, when the engine is run by hand)
    def _run(self) -> None:
        while True:
            outputs = self._queue.get()
            if outputs is None:
                return
            try:
                self.process(outputs)
            except Exception:       # a bug: log it, keep serving the next batches
                log.exception("processing an output batch failed")

    def process(self, outputs: list[SeqOutput]) -> None:
        """One batch: every output to its channel, then one wake-up for the channels delivered to."""
        touched = []
        for out in outputs:
            st = self._streams.get(out.seq_id)
            if st is None:          # ended here already (a stop string), or never opened
                continue
            try:
                event = self._event(st, out)
            except Exception as e:  # e.g. the tokenizer on one sequence: fail it alone
                log.exception("the output of sequence %d failed", out.seq_id)
                self._end(out.seq_id, Finish.FAILED)
                event = ErrorEvent(500, f"internal engine error: {type(e).__name__}: {e}")
            if event is None:       # aborted: nobody reads
                self._streams.pop(out.seq_id, None)
                continue
            last = isinstance(event, ErrorEvent) or event.done is not None
            if last:
                self._streams.pop(out.seq_id, None)
            if st.ch.deliver(event, last) and self.waker is not None:
                touched.append(st.ch)
        if touched:
            self.waker(touched)

    def _piece(self, token: int) -> str:
        """One token's own text (top tokens, prefill), special tokens included."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode(
                [token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text

    def _event(self, st: _Stream, out: SeqOutput):
        if out.error is not None:
            return out.error
        if out.token is None:
            return None
        ch = st.ch
        p = ch.params
        if st.detok is None:
            st.detok = IncrementalDetokenizer(self.tokenizer, ch.prompt_ids, p.stop_sequences,
                                              include_stop=p.include_stop_str_in_output,
                                              skip_special_tokens=p.skip_special_tokens,
                                              spaces_between_special_tokens=p.spaces_between_special_tokens,
                                              min_tokens=p.min_tokens, special_ids=self._all_special)
        detok = st.detok
        finish = out.finish
        stop_id = out.token in p.stop_token_ids and st.tokens + 1 >= p.min_tokens
        if stop_id and finish is None:
            self._end(ch.seq_id, Finish.STOP)
            finish = Finish.STOP
        # The token that ends a sequence (EOS, a stop token id) is not text, kept special or not.
        text = "" if (stop_id or finish == Finish.EOS) and not p.skip_special_tokens else detok.add(out.token)
        st.tokens += 1
        st.cum_logprob += out.logprob
        if out.prompt_logprobs is not None:
            st.prompt_logprobs = out.prompt_logprobs
        if detok.stopped:           # the stop string ends it, whatever else this token did
            if finish is None:
                self._end(ch.seq_id, Finish.STOP)
            finish = Finish.STOP
        elif finish is not None:
            text += detok.flush()
        done = None
        if finish is not None:
            prefill = prefill_top = None
            if ch.params.decoder_input_details:
                got = tuple(st.prompt_logprobs)
                if ch.params.prompt_top_n is not None:     # (log-prob, rank, alternatives) each
                    prefill_top = (None,) + tuple(
                        (rank, tuple((i, self._piece(i), a) for i, a in alts)) for _lp, rank, alts in got)
                    got = tuple(x[0] for x in got)
                lps = (None,) + got
                prefill = tuple((t, self._piece(t), lp) for t, lp in zip(ch.prompt_ids, lps))
            done = DoneEvent(str(finish), detok.text, st.tokens, len(ch.prompt_ids), prefill=prefill,
                             prefill_top=prefill_top,
                             cumulative_log_prob=st.cum_logprob, queue_time_s=out.queue_time_s,
                             preemptions=out.preemptions, stop_string=detok.matched)
        top = tuple((t, self._piece(t), lp) for t, lp in out.top)
        return TokenEvent(out.token, text, out.logprob, done, special=out.token in self._special,
                          top_tokens=top, time=out.time)
