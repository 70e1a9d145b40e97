"""Speculative decoding, the runner's half: verify a draft from the logits of its k+1 positions.

A verify item (StepItem.draft = (d1..dk), token_ids = [last, d1..dk]) has one logit row per fed
position: row j scores the token after [history, d1..dj]. Row j is processed exactly as the
sampler would process a decode step whose history ends with d1..dj (penalties, logit_bias,
warpers: handler/model/sampling.py), then:

- greedy: the sampler's own argmax of each row (so its tie-breaking and log-probs are the ones a
  plain decode reports); d_{j+1} is accepted while it equals row j's token; the first row whose
  token differs gives the correction, or row k the bonus token after k acceptances.
- sampled (Leviathan et al. 2023, Chen et al. 2023): the proposal q is a point mass on d_{j+1},
  so d_{j+1} is accepted with probability min(1, p(d)/q(d)) = p(d) (p: row j's warped target
  distribution, u drawn from the sequence's own generator); on rejection the token is drawn from
  max(p - q, 0) normalised, i.e. p without d; after k acceptances the bonus is drawn from row k.
  Each emitted token is then distributed as the target's own sampling would give it.
"""
from __future__ import annotations

import dataclasses

import torch

from handler.engine.types import SampleResult, StepItem
from handler.model import sampling


def _rows(it: StepItem) -> list[StepItem]:
    """One pseudo decode item per verified position j: its history ends with d1..dj."""
    return [dataclasses.replace(it, history=list(it.history) + list(it.draft[:j]), draft=(),
                                token_ids=[it.token_ids[j]], start_pos=it.start_pos + j)
            for j in range(len(it.draft) + 1)]


def verify(sampler: sampling.Sampler, logits: torch.Tensor, it: StepItem) -> SampleResult:
    """logits [k+1, V] float32 of a verify item -> its SampleResult: `token` the first emitted,
    `more` the rest as (token, logprob, top)."""
    rows = _rows(it)
    if it.params.greedy:
        res = sampler.sample(logits, rows)
        for r in res:
            if r.error is not None:
                return r
        out = [res[0]]
        for j, d in enumerate(it.draft):
            if res[j].token != d:
                break
            out.append(res[j + 1])
        return _result(out)
    return _rejection(sampler, logits, it, rows)


def _result(out: list[SampleResult]) -> SampleResult:
    first = out[0]
    return SampleResult(first.token, first.logprob, first.top,
                        more=tuple((r.token, r.logprob, r.top) for r in out[1:]))


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int | None:
    """One token from an (unnormalised) distribution [V]; None when it holds no mass."""
    cum = probs.cumsum(dim=-1)
    total = float(cum[-1])
    if not (total > 0.0) or total == float("inf"):
        return None
    u = torch.rand(1, generator=gen)
    return int(torch.searchsorted(cum, u * cum[-1], right=True).clamp_max(probs.shape[0] - 1))


def _rejection(sampler: sampling.Sampler, logits: torch.Tensor, it: StepItem, rows: list[StepItem]) -> SampleResult:
    x = logits.clone()
    p = it.params
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        sampling.Sampler._penalize(x, rows)
    if p.logit_bias:
        sampling._bias(x, rows)
    logprobs = torch.log_softmax(x, dim=-1)
    probs = sampling.warped_probs(x, rows)
    gen = sampler._generator(it)
    n_top = p.top_n_tokens

    def emit(j: int, token: int) -> SampleResult:
        top = sampling.top_tokens(logprobs[j:j + 1], [n_top])[0] if n_top else ()
        return SampleResult(token, float(logprobs[j, token]), top)

    out: list[SampleResult] = []
    for j, d in enumerate(it.draft):
        pj = probs[j]
        if torch.rand(1, generator=gen).item() < float(pj[d]):
            out.append(emit(j, d))
            continue
        residual = pj.clone()
        residual[d] = 0.0
        t = _draw(residual, gen)
        out.append(emit(j, int(x[j].argmax()) if t is None else t))
        return _result(out)
    k = len(it.draft)
    t = _draw(probs[k], gen)
    out.append(emit(k, int(x[k].argmax()) if t is None else t))
    return _result(out)
