"""Speculative decoding, the engine's half: the settings and the proposers. No torch.

Each step a decoding sequence may carry k proposed tokens (StepItem.draft). The runner feeds
[last token, d1..dk] at positions n..n+k, gets the logits of all k+1 positions and keeps the
longest prefix of the draft the target model agrees with, plus one token of its own (the
correction at the first disagreement, or the bonus token after k agreements): greedy by exact
match, sampled by rejection sampling so that the output distribution is the target's
(handler/model/spec_verify.py). The scheduler then counts n + 1 + accepted tokens as computed;
the KV slots written for rejected positions lie past that and are overwritten by later steps
(their blocks are released when the table shrinks back, and never registered in the prefix
cache, which only takes blocks full of computed tokens).

Proposers:
  ngram   prompt lookup: the longest suffix of the sequence (prompt_lookup_max down to
          prompt_lookup_min tokens) that occurred before in its prompt or output; the tokens that
          followed its most recent earlier occurrence are the draft. No second model.
  draft_model   a second, small model's greedy tokens, from its own paged KV (handler/model/spec_draft.py:
          the model's calls live there; the Engine is handed the proposer, built at start-up).

A proposer has `method` and `propose(tokens, k) -> list[int]`; a batched, stateful one also has
`propose_batch([(seq_id, tokens, k), ...]) -> [proposal, ...]` (the scheduler calls it once a step with
every speculating sequence), `release(seq_id)` (the sequence finished or was preempted: drop its
state) and `reset()` (the engine forgot every sequence).

Speculation is skipped for a step's sequence when it has no proposal, backs off after drafts that
were wholly rejected (the scheduler's MAX_SPEC_BACKOFF), is guided (its grammar
matcher cannot be rewound, so proposals are not checked against it: guided sequences decode one
token a step), wants prompt log-probs, or when `disable_by_batch_size` sequences or more run.
"""
from __future__ import annotations

from handler.config.speculative import DEFAULT_LOOKUP_MAX, DEFAULT_LOOKUP_MIN, SpecConfig  # noqa: F401


def proposer(spec: SpecConfig):
    """The proposer of a SpecConfig's method that needs no model (ngram); draft_model's holds a second
    model and is handed to the Scheduler (handler.server.build_draft)."""
    if spec.method != "ngram":
        raise ValueError(f"speculative method {spec.method} needs its proposer passed to the Scheduler")
    return NgramProposer(spec.lookup_min, spec.lookup_max)


class NgramProposer:
    """Prompt lookup: find the sequence's last n tokens (n from lookup_max down to lookup_min)
    earlier in the sequence, most recent occurrence first; propose what followed it."""
    method = "ngram"

    def __init__(self, lookup_min: int = DEFAULT_LOOKUP_MIN, lookup_max: int = DEFAULT_LOOKUP_MAX):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, tokens: list[int], k: int) -> list[int]:
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
