"""The types the engine shares with its neighbours. No torch: plain ids, counts and strings.

  scheduler -> runner   StepPlan of StepItems (what to feed, where its KV lives, whether to sample)
  runner -> scheduler   one SampleResult per StepItem
  engine -> output      one list of SeqOutput per step (token ids, finish reason, log-probs)
  output -> readers     TokenEvent (the last carries a DoneEvent) or ErrorEvent, per Channel
  engine -> runner      the Runner Protocol: all the engine touches of handler.model's ModelRunner
  engine -> proposer    the Proposer Protocol: speculative decoding's drafts, asked between steps
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from handler.engine.request import SamplingParams


class Finish(StrEnum):
    """Why a sequence ended. The values are the protocol's finish_reason strings."""
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    ABORTED = "aborted"
    FAILED = "failed"


# ---- images (vision-language models): what the engine knows of one
# An image's place in a prompt rendered for a template that takes text (handler/http/protocols/media.py
# writes it; the model's MediaProcessor replaces it with its own placeholder). Private-use characters.
IMAGE_MARKER = "\ue000image\ue001"


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: the run of placeholder tokens its embeddings replace and its content
    hash. The scheduler keys prefix-cache blocks by `key` (two images never share KV blocks), the
    runner's encoder cache too; `data` (the processor's tensors for the vision stage) is opaque here."""
    key: str                # content hash (sha256 of the decoded pixels)
    offset: int             # the first placeholder token's position in the prompt
    length: int             # placeholder tokens (= the image's embedding rows)
    data: Any = field(default=None, compare=False, repr=False)
    # An image whose placeholders come in several runs (Idefics3's tiles, text markers between them):
    # ((offset, length), ...) in order, their lengths summing to `length`; () for one run.
    runs: tuple = ()
    # Each run attends to itself both ways at prefill (the model's family says so: Gemma 3), so a run is
    # prefilled in one step: the scheduler ends a chunk before it or takes it whole (Sequence.chunk_end).
    whole: bool = False

    @property
    def spans(self) -> tuple:
        return self.runs or ((self.offset, self.length),)

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        last = self.spans[-1]
        return last[0] + last[1]

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


# ---- one step: scheduler -> runner -> scheduler
@dataclass(frozen=True)
class StepItem:
    seq_id: int
    token_ids: list[int]        # fed this step, at positions start_pos .. start_pos+len-1
    start_pos: int
    block_table: list[int]
    sample: bool                # the chunk reaches the end of the known tokens
    params: SamplingParams
    history: list[int]          # prompt + output so far (repetition penalty); do not mutate
    num_prompt: int = 0         # history[:num_prompt] is the prompt (penalties on the output)
    prompt_logprobs: bool = False   # return log-probs of history[p+1] for every fed position p
    guide: Any = None           # the sequence's GuideState: the sampler masks what it disallows
    # Speculative decoding (handler/engine/spec.py): k proposed tokens fed after token_ids[0] (the
    # last sampled token, so token_ids = [last, *draft]); the runner verifies them (logits of all
    # k+1 positions) and answers the accepted prefix plus one token of its own.
    draft: tuple = ()
    # The prompt's images whose placeholder tokens this item feeds (some or all of them: a chunk may
    # cut an image; the runner encodes it whole, once, and takes the rows this chunk feeds).
    media: tuple[ImageRef, ...] = ()
    # All of the prompt's images (the sequence's, whether this item feeds them or not): M-RoPE models
    # (Qwen2-VL) place every later token by what the images before it took.
    prompt_media: tuple[ImageRef, ...] = ()


@dataclass(frozen=True)
class SampleResult:
    """The runner's answer for one item."""
    token: int | None = None        # None: a prompt chunk that does not reach the end
    logprob: float = 0.0
    top: tuple = ()                 # top_n_tokens: ((id, logprob), ...), most likely first
    prompt_logprobs: tuple = ()     # log-probs of history[start_pos+1 ...] when asked for
    error: tuple[int, str] | None = None   # (HTTP status, message): this item alone failed
    # A verified draft (StepItem.draft): the tokens after `token`, each (token, logprob, top), in
    # order; `token` is the first accepted one (or the correction when none was).
    more: tuple = ()


@dataclass
class StepPlan:
    items: list[StepItem]
    preempted: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks, before the forward


@dataclass(frozen=True)
class ErrorEvent:
    status: int                 # HTTP status: 424 model failure, 503 shutting down, ...
    message: str


# ---- what the engine emits: one batch per step, turned into text outside its loop
@dataclass(frozen=True)
class SeqOutput:
    """One sequence's news from one engine iteration: a sampled token, its end, or both.
    `finish` is decided here once (length or EOS by the scheduler; failed or aborted by the
    engine); a stop string is the output processor's to find (handler/engine/output.py)."""
    seq_id: int
    token: int | None = None        # None: the sequence ended without a new token
    logprob: float = 0.0
    top: tuple = ()                 # top_n_tokens: ((id, logprob), ...), most likely first
    finish: Finish | None = None
    error: ErrorEvent | None = None  # the reader's last event when the sequence failed
    time: float = 0.0               # time.monotonic() when the engine emitted it
    queue_time_s: float = 0.0       # submit -> first scheduled
    preemptions: int = 0
    # decoder_input_details, with the first token: log-probs of prompt tokens 1..
    prompt_logprobs: tuple | None = None


# ---- what a request's reader gets
@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str          # length | eos_token | stop_sequence
    generated_text: str
    generated_tokens: int
    prompt_tokens: int
    # decoder_input_details: every prompt token as (id, text, log_prob); the first has None.
    prefill: tuple | None = None
    # prompt log-probs with alternatives (params.prompt_top_n): per prompt token (rank,
    # ((id, text, log_prob), ...)); the first is None.
    prefill_top: tuple | None = None
    cumulative_log_prob: float = 0.0
    queue_time_s: float = 0.0       # submit -> first scheduled
    preemptions: int = 0
    stop_string: str | None = None  # the stop sequence that ended it (finish_reason stop_sequence)


@dataclass(frozen=True)
class TokenEvent:
    id: int
    text: str
    log_prob: float
    done: DoneEvent | None = None   # set on a sequence's last token
    special: bool = False           # a special token (EOS, ...): its text is "" in generated_text
    top_tokens: tuple = ()          # top_n_tokens: ((id, text, log_prob), ...) most likely first
    time: float = 0.0               # time.monotonic() when the engine emitted it


# ---- the runner, as the engine sees it
@runtime_checkable
class KVPool(Protocol):
    """The runner's KV pool: the engine's BlockManager hands out its blocks."""

    @property
    def num_blocks(self) -> int: ...


@runtime_checkable
class SamplerState(Protocol):
    """Per-sequence sampling state (seeded generators) that the runner keeps."""

    def reset(self) -> None:
        """Forget every sequence's state (after an engine error)."""


@runtime_checkable
class GuideState(Protocol):
    """One sequence's guided-decoding matcher (handler.model.guided.Matcher), opaque to the engine:
    the scheduler advances it with every token the sequence accepts; the sampler reads it."""

    def accept(self, token: int) -> bool:
        """Advance by one generated token; False when the grammar does not allow it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""


@runtime_checkable
class Guides(Protocol):
    """The runner's grammar compiler (handler.model.guided.Guides)."""

    def matcher(self, spec) -> GuideState:
        """A fresh matcher for a GuideSpec; raises RequestError (a 400 naming spec.field) when
        the spec cannot be compiled. Thread-safe: called from HTTP threads."""


@runtime_checkable
class Runner(Protocol):
    """Everything the Engine uses of a runner (handler.model.runner.ModelRunner; the tests'
    tests/support/fakes.FakeRunner). Called from the engine thread only."""

    # A Hugging Face tokenizer, or anything with: tok(text)["input_ids"], tok.decode(ids,
    # skip_special_tokens=, clean_up_tokenization_spaces=) and optionally all_special_ids.
    @property
    def tokenizer(self) -> Any: ...

    @property
    def kv(self) -> KVPool: ...

    @property
    def sampler(self) -> SamplerState: ...

    def step(self, items: list[StepItem], copies: list[tuple[int, int]]) -> list[SampleResult]:
        """Copy the KV blocks (src, dst), then run the items: one SampleResult per item, in
        order. Raising fails every item of the step."""

    def release(self, seq_id: int) -> None:
        """A sequence ended: drop whatever the runner keeps for it."""

    # Optional: `guides` (a Guides) where the runner can do guided decoding; without it a
    # request with SamplingParams.guide is refused. `media` (a MediaProcessor) where the model
    # takes images; without it a request with images is refused.


@runtime_checkable
class MediaProcessor(Protocol):
    """A vision-language model's processor (handler.model.vision): called from HTTP threads."""

    def process(self, text: str, images: list) -> tuple[list[int], tuple[ImageRef, ...]]:
        """A rendered prompt (its images as the template's placeholders or IMAGE_MARKER) and its
        decoded images (objects with .image, a PIL image, .hash and .where, the request field) ->
        (token ids with each image's tokens, one ImageRef per image). Raises RequestError (400)."""


# ---- speculative decoding's proposer, as the engine sees it
# One ask: (seq_id, the sequence's tokens (prompt + output; do not mutate), k: propose at most k).
DraftAsk = tuple[int, list[int], int]


@runtime_checkable
class Proposer(Protocol):
    """Speculative decoding's proposer (handler/engine/spec.py NgramProposer; handler/model/spec_draft.py
    DraftProposer, a second model). The Engine asks it between steps, in its own thread and inside
    the step watchdog's view, for the sequences the scheduler names (Scheduler.draft_asks); the
    scheduler receives only the ids (Scheduler.schedule's drafts)."""

    method: str     # "ngram" | "draft_model" (logs; the statistics are keyed by the configured method)

    def propose(self, asks: list[DraftAsk]) -> list[list[int]]:
        """One draft per ask, in order: at most k token ids each ([] for none). Raising costs the
        step its drafts, not the requests."""

    def release(self, seq_id: int) -> None:
        """The sequence finished or was preempted: drop whatever the proposer keeps for it."""

    def reset(self) -> None:
        """Forget every sequence (after an engine error)."""
