"""Protocols (LMI, OpenAI, TGI): HTTP body -> prompts + SamplingParams -> engine events -> body.

Each protocol module turns its request into a `Generation` and the engine's events back into its
own response shape; this module holds what they share: tokenizing, collecting a submission's
samples (prompt-major, `params.num_samples` per prompt) and streaming them with time-outs.
"""
from __future__ import annotations

import dataclasses
import queue
import time
from dataclasses import dataclass, field

from handler.engine.loop import DoneEvent, ErrorEvent, TokenEvent
from handler.engine.request import RequestError, SamplingParams
from handler.http.protocols import media


@dataclass
class Generation:
    """What a protocol asks the engine for."""
    prompts: list[str]                 # prompt texts (after any chat template)
    params: SamplingParams
    stream: bool = False
    is_list: bool = False              # the client sent a list (answer with a list)
    truncate: int | None = None        # keep the last N prompt tokens
    add_special_tokens: bool = True    # False for chat-templated prompts (the template has them)
    fill_max_tokens: bool = False      # no max_tokens given: generate up to the model's length
    fields: list[str] = field(default_factory=list)   # per prompt: the request field, for errors
    extra: dict = field(default_factory=dict)         # protocol-specific options
    adapter: str | None = None         # the LoRA adapter the body names (None: the base model)
    adapter_field: str = "adapters"    # where the body names it (errors)
    prompt_ids: list[list[int]] | None = None   # token-id prompts as sent (`prompts`: their text)
    prompt_tokens: list[int] = field(default_factory=list)   # per prompt, once tokenized
    images: list[list] | None = None   # per prompt: its media.ImageInputs, in order (None: text only)
    media: list[tuple] | None = None   # per prompt, once tokenized: its engine ImageRefs (types.py)


@dataclass
class Sample:
    """One finished sequence."""
    prompt_index: int
    sample_index: int
    tokens: list[TokenEvent]
    done: DoneEvent

    @property
    def cumulative_log_prob(self) -> float:
        return sum(t.log_prob for t in self.tokens)


class Timeout(Exception):
    pass


class Failed(Exception):
    def __init__(self, event: ErrorEvent):
        super().__init__(event.message)
        self.status, self.message = event.status, event.message


def bad_words_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM makes them: the word alone and after a space."""
    out: list[tuple[int, ...]] = []
    for w in words:
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def tokenize(tokenizer, gen: Generation, vision=None) -> list[list[int]]:
    """The prompts' token ids. A prompt with images goes through the model's processor (`vision`, an
    engine types.MediaProcessor: its image tokens, and gen.media); a model without one refuses them."""
    if gen.params.bad_words and not gen.params.bad_words_ids:
        gen.params = dataclasses.replace(gen.params, bad_words_ids=bad_words_ids(tokenizer, gen.params.bad_words))
    if gen.images and any(gen.images):
        if vision is None:
            raise media.to_text_only(next(imgs for imgs in gen.images if imgs))
        gen.media = [() for _ in gen.prompts]
    out = []
    for i, text in enumerate(gen.prompts):
        if gen.media is not None and gen.images[i]:
            ids, gen.media[i] = vision.process(text, gen.images[i])
        elif gen.prompt_ids is not None:
            ids = list(gen.prompt_ids[i])
        else:
            ids = tokenizer(text, add_special_tokens=gen.add_special_tokens)["input_ids"]
        if gen.truncate is not None:
            ids = ids[-gen.truncate:]
        if not ids:
            where = gen.fields[i] if i < len(gen.fields) else "inputs"
            raise RequestError(where, "encodes to no tokens")
        out.append(ids)
    gen.prompt_tokens = [len(ids) for ids in out]
    return out


def with_length(gen: Generation, prompt_ids: list[list[int]], max_len: int) -> None:
    """OpenAI without max_tokens: generate up to the model's length (as vLLM) or the KV cache's."""
    if gen.fill_max_tokens:
        room = max(1, max_len - max(len(ids) for ids in prompt_ids))
        gen.params = SamplingParams(**{**gen.params.__dict__, "max_new_tokens": room})


def events(engine, ch, deadline: float):
    """A channel's events until its last token; Timeout when the deadline passes."""
    wake = ch.wake
    while True:
        try:
            if wake is None:
                ev = ch.events.get(timeout=max(0.0, deadline - time.monotonic()))
            else:
                ev = _cooperative_get(ch, wake, deadline)
        except queue.Empty:
            engine.abort(ch.seq_id)
            raise Timeout() from None
        yield ev
        if isinstance(ev, ErrorEvent) or ev.done is not None:
            return


def _cooperative_get(ch, wake, deadline):
    """The channel's next event, waiting on its front end's event (handler/http/hub.py) rather than
    the queue: cleared before the queue is read, so a wake-up set after an empty read is kept."""
    while True:
        wake.clear()
        if not ch.events.empty():           # this greenlet is the only reader
            return ch.events.get_nowait()
        left = deadline - time.monotonic()
        if left <= 0 or not wake.wait(left):
            raise queue.Empty


def collect(engine, chans, deadline: float, observe=None) -> list[Sample]:
    """Every channel's tokens. Raises Failed or Timeout (aborting the rest). observe(i, event):
    each event of chans[i] as it is read (the request's metrics)."""
    samples = []
    try:
        for i, ch in enumerate(chans):
            tokens = []
            for ev in events(engine, ch, deadline):
                if observe is not None:
                    observe(i, ev)
                if isinstance(ev, ErrorEvent):
                    raise Failed(ev)
                tokens.append(ev)
            samples.append(Sample(ch.prompt_index, ch.sample_index, tokens, tokens[-1].done))
    except (Failed, Timeout):
        for ch in chans:
            engine.abort(ch.seq_id)
        raise
    return samples


def by_prompt(samples: list[Sample], n_prompts: int) -> list[list[Sample]]:
    out: list[list[Sample]] = [[] for _ in range(n_prompts)]
    for s in samples:
        out[s.prompt_index].append(s)
    return out


def ranked(samples: list[Sample]) -> list[Sample]:
    """Most likely first (best_of), ties in sample order."""
    return sorted(samples, key=lambda s: -s.cumulative_log_prob)


def stream_events(engine, chans, deadline: float, observe=None):
    """(prompt_index, sample_index, event) for each channel in turn; a time-out becomes an
    ErrorEvent(504). Closing the generator (client gone) aborts whatever has not finished.
    observe(i, event): each event of chans[i] as it is yielded (the request's metrics)."""
    pending = {ch.seq_id for ch in chans}
    try:
        for i, ch in enumerate(chans):
            p, s = ch.prompt_index, ch.sample_index
            try:
                for ev in events(engine, ch, deadline):
                    if isinstance(ev, ErrorEvent) or ev.done is not None:
                        pending.discard(ch.seq_id)
                    if observe is not None:
                        observe(i, ev)
                    yield p, s, ev
                    if isinstance(ev, ErrorEvent):
                        return
            except Timeout:
                pending.discard(ch.seq_id)
                ev = ErrorEvent(504, "request timed out")
                if observe is not None:
                    observe(i, ev)
                yield p, s, ev
                return
    finally:
        for sid in pending:
            engine.abort(sid)
