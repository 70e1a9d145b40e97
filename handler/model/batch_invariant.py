"""`option.batch_invariant=true`: a sequence's numbers do not depend on what shares its batch.

Why the default packed step is not invariant: the step's matmuls run over all scheduled tokens
([T, hidden] with T the batch's token count) and the kernels pick their blocking and reduction
order by shape, so a row's result can differ in its last bits with T. The same holds for how a
prompt was chunked (the prefill budget is shared by the batch) and for a recompute after
preemption. Near a tie the sampler's sorted order then flips, and a seeded request draws another
token (greedy, an argmax, almost never flips).

This mode removes the dependence on shape altogether: every sequence feeds its tokens one at a
time through a forward of its own (one query row, attention over its own blocks only), whatever
the scheduler packed into the step. Each number a sequence sees is then a function of its own
tokens and positions only: not of its batch mates, its prefill chunking, or a preemption. With
per-request generators and a stable sort in the sampler, a seeded request gives the same tokens
whatever shares its batch. The price: a prompt of P tokens costs P forwards (prefill runs at
decode speed) and batch mates do not share weight reads.
"""
from __future__ import annotations

from dataclasses import replace


def step(packed_step, items, copies=()):
    """Run `items` (the scheduler's StepItems) one token of one sequence per forward through
    `packed_step` (the runner's packed forward + sampler); returns one SampleResult per item,
    as the packed step does: the last token's result, with the prompt log-probs of every
    token of the chunk joined."""
    out = []
    for it in items:
        if not it.token_ids:
            out.append(packed_step([it], copies)[0])
            copies = ()
            continue
        last = len(it.token_ids) - 1
        prompt_lps: list[float] = []
        for j, tok in enumerate(it.token_ids):
            res = packed_step([replace(it, token_ids=[tok], start_pos=it.start_pos + j,
                                       sample=it.sample and j == last)], copies)[0]
            copies = ()                  # copy-on-write blocks: once, before the first forward
            prompt_lps.extend(res.prompt_logprobs)
        out.append(replace(res, prompt_logprobs=tuple(prompt_lps)))
    return out
