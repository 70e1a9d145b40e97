"""Speculative decoding, the engine's half: the settings and the n-gram proposer. No torch.

Each step a decoding sequence may carry k proposed tokens (StepItem.draft). The runner feeds
[last token, d1..dk] at positions n..n+k, gets the logits of all k+1 positions and keeps the
longest prefix of the draft the target model agrees with, plus one token of its own (the
correction at the first disagreement, or the bonus token after k agreements): greedy by exact
match, sampled by rejection sampling so that the output distribution is the target's
(handler/model/spec_verify.py). The scheduler then counts n + 1 + accepted tokens as computed;
the KV slots written for rejected positions lie past that and are overwritten by later steps
(their blocks are released when the table shrinks back, and never registered in the prefix
cache, which only takes blocks full of computed tokens).

Who does what (as vLLM v1, where the runner drafts and the scheduler sees token ids only), in
each Engine.step, the model step's watchdog timing all of it:
  Scheduler.admit(now)        admission: the step's batch
  Scheduler.draft_asks()      which sequences decode this step and how many tokens each may take:
                              [(seq_id, tokens, k)] (no torch, no proposer)
  Proposer.propose(asks)      the engine's proposer (handler/engine/types.py) answers with token ids
  Scheduler.schedule(now, drafts)   slots and reservations for the drafts: it drops one when no
                              blocks are free for its slots (the sequence decodes one token)

Proposers (both implement types.Proposer: propose(asks) -> ids per ask, release(seq_id), reset()):
  ngram   prompt lookup: the longest suffix of the sequence (prompt_lookup_max down to
          prompt_lookup_min tokens) that occurred before in its prompt or output; the tokens that
          followed its most recent earlier occurrence are the draft. No second model, no state.
  draft_model   a second, small model's greedy tokens, from its own paged KV (handler/model/spec_draft.py;
          built at start-up by handler.server.build_draft and handed to the Engine).

Speculation is skipped for a step's sequence when it has no proposal, backs off after drafts that
were wholly rejected (the scheduler's MAX_SPEC_BACKOFF), is guided (its grammar
matcher cannot be rewound, so proposals are not checked against it: guided sequences decode one
token a step), wants prompt log-probs, or when `disable_by_batch_size` sequences or more run.
"""
from __future__ import annotations

from handler.config.speculative import DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN, SpecConfig  # noqa: F401
from handler.engine.types import DraftAsk


def proposer(spec: SpecConfig):
    """The proposer of a SpecConfig's method that needs no model (ngram); draft_model's holds a second
    model and is handed to the Engine (handler.server.build_draft)."""
    if spec.method != "ngram":
        raise ValueError(f"speculative method {spec.method} needs its proposer passed to the Engine")
    return NgramProposer(spec.lookup_min, spec.lookup_max)


def drafts_of(asks: list[DraftAsk], got: list[list[int]]) -> dict[int, list[int]]:
    """A proposer's answers as the scheduler takes them: seq_id -> at most k ids, empty ones left out."""
    if len(got) != len(asks):
        raise ValueError(f"the proposer answered {len(got)} drafts for {len(asks)} sequences")
    return {sid: list(d)[:k] for (sid, _, k), d in zip(asks, got) if d}


class PerSequence:
    """A stateless proposer from a function of one sequence's tokens, `draft(tokens, k) -> ids`
    (the n-gram lookup; the tests' oracles): the Proposer protocol with nothing to release."""
    method = "ngram"

    def draft(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose(self, asks: list[DraftAsk]) -> list[list[int]]:
        return [self.draft(tokens, k) for _, tokens, k in asks]

    def release(self, seq_id: int) -> None:
        pass

    def reset(self) -> None:
        pass


class NgramProposer(PerSequence):
    """Prompt lookup: find the sequence's last n tokens (n from lookup_max down to lookup_min)
    earlier in the sequence, most recent occurrence first; propose what followed it."""
    method = "ngram"

    def __init__(self, lookup_min: int = DEFAULT_LOOKUP_MIN, lookup_max: int = DEFAULT_LOOKUP_MAX):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def draft(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        if k <= 0 or L < self.lookup_min + 1:
            return []
        last = tokens[-1]
        for n in range(min(self.lookup_max, L - 1), self.lookup_min - 1, -1):
            suffix = tokens[L - n:]
            # Candidate ends: earlier positions holding the suffix's last token, most recent first.
            i = L - 2
            while i >= n - 1:
                if tokens[i] == last and tokens[i - n + 1:i + 1] == suffix:
                    follow = tokens[i + 1:i + 1 + k]
                    if follow:
                        return follow
                i -= 1
        return []
