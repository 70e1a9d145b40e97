"""Sampling and log-probs from a step's logits, vectorised across rows with per-row parameters.

Order of operations (that of HF `generate`): penalties on the raw logits (repetition over
prompt + output; presence/frequency over the output, OpenAI's formula), logit_bias, the bans
(EOS and stop_token_ids before min_tokens, the last token of each bad word whose other tokens
end the output), the guided rows' grammar masks (handler/model/guided.py, one batched fill), then the reported
log-probs (`log_softmax` of those), then for sampled rows temperature -> top_k -> top_p ->
min_p -> typical_p (HF's warper order and definitions) and one uniform draw per row from that
row's own generator. A row whose parameters break the vectorised pass is retried alone; if it
still fails only that item fails (an error result), never its batch mates.
"""
from __future__ import annotations

import logging
import os

import torch

from kernels import cpu as cpu_ext

from handler.engine.types import SampleResult, StepItem

log = logging.getLogger("lmi.sampling")
NEG_INF = float("-inf")


class Sampler:
    def __init__(self, eos_token_ids=()):
        self.eos_token_ids = tuple(eos_token_ids)     # banned before a request's min_tokens
        self.generators: dict[int, torch.Generator] = {}
        self.rng = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))

    def reset(self) -> None:
        self.generators.clear()

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def _generator(self, it: StepItem) -> torch.Generator:
        if it.params.seed is None:
            return self.rng
        g = self.generators.get(it.seq_id)
        if g is None:
            # Any integer seed (OpenAI's may be negative; samples add their index) as 64 bits.
            g = self.generators[it.seq_id] = torch.Generator(device="cpu").manual_seed(
                it.params.seed % (1 << 64))
        return g

    # ---- entry point
    def sample(self, logits: torch.Tensor, items: list[StepItem]) -> list[SampleResult]:
        """logits [R, V] float32, one row per sampling item."""
        # Penalties write into the logits: keep the originals for a retry row by row.
        penalized = any(it.params.repetition_penalty != 1.0 or it.params.presence_penalty
                        or it.params.frequency_penalty or it.params.logit_bias or it.params.min_tokens
                        or it.params.bad_words_ids or it.params.thinking_budget for it in items)
        try:
            return self._sample(logits.clone() if penalized else logits, items)
        except Exception as e:
            if len(items) == 1:
                return [self._failed(items[0], e)]
        out = []
        for r, it in enumerate(items):
            try:
                out += self._sample(logits[r:r + 1].clone(), [it])
            except Exception as e:
                out.append(self._failed(it, e))
        return out

    @staticmethod
    def _failed(it: StepItem, e: Exception) -> SampleResult:
        log.warning("sampling failed for sequence %d", it.seq_id, exc_info=True)
        return SampleResult(error=(424, f"sampling failed for this request: {type(e).__name__}: {e}"))

    def _sample(self, logits: torch.Tensor, items: list[StepItem]) -> list[SampleResult]:
        self._penalize(logits, items)
        if any(it.params.logit_bias for it in items):
            _bias(logits, items)
        if any(it.params.min_tokens or it.params.bad_words_ids for it in items):
            self._ban(logits, items)
        if any(it.params.thinking_budget for it in items):
            _close_thinking(logits, items)
        if any(it.guide is not None for it in items):
            from handler.model import guided
            guided.apply(logits, [it.guide for it in items])
        counts = [it.params.top_n_tokens for it in items]
        # No top tokens wanted (the common case): the argmax and each row's log-sum-exp in one
        # read of the logits (a CPU kernel) instead of a full log_softmax plus an argmax.
        stats = None if max(counts) > 0 else cpu_ext.row_stats(logits)
        if stats is None:
            logprobs = torch.log_softmax(logits, dim=-1)
            tokens = logits.argmax(dim=-1)
        else:
            tokens, row_max, logsum = stats
        rand_rows = [r for r, it in enumerate(items) if not it.params.greedy]
        if rand_rows:
            sel = torch.tensor(rand_rows, device=logits.device)
            tokens[sel] = self._draw(logits[sel], [items[r] for r in rand_rows])
        if stats is None:
            chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            tops = top_tokens(logprobs, counts)
        else:   # log_softmax's formula: (x_t - max) - log(sum exp(x - max))
            chosen = ((logits.gather(1, tokens[:, None])[:, 0] - row_max) - logsum).tolist()
            tops = [()] * len(items)
        return [SampleResult(t, lp, top) for t, lp, top in zip(tokens.tolist(), chosen, tops)]

    @staticmethod
    def _penalize(logits: torch.Tensor, items: list[StepItem]) -> None:
        dev, vocab = logits.device, logits.shape[1]
        for r, it in enumerate(items):
            p = it.params
            if p.repetition_penalty != 1.0:   # HF's RepetitionPenaltyLogitsProcessor, prompt + output
                idx = torch.tensor(it.history, device=dev).unique()
                score = logits[r, idx]
                logits[r, idx] = torch.where(score < 0, score * p.repetition_penalty,
                                             score / p.repetition_penalty)
            out = it.history[it.num_prompt:]
            if (p.presence_penalty or p.frequency_penalty) and out:
                # OpenAI: logit[j] -= count[j] * frequency + (count[j] > 0) * presence
                counts = torch.bincount(torch.tensor(out, device=dev), minlength=vocab)[:vocab]
                logits[r] -= counts.to(logits.dtype) * p.frequency_penalty \
                    + (counts > 0).to(logits.dtype) * p.presence_penalty

    def _ban(self, logits: torch.Tensor, items: list[StepItem]) -> None:
        vocab = logits.shape[1]
        for r, it in enumerate(items):
            ids = [t for t in _bans(it, self.eos_token_ids) if t < vocab]
            if ids:
                logits[r, torch.tensor(ids, device=logits.device)] = NEG_INF

    def _draw(self, logits: torch.Tensor, items: list[StepItem]) -> torch.Tensor:
        probs = warped_probs(logits, items)
        # One uniform per row from that row's own generator: a seeded request draws the same
        # numbers whatever shares its batch. Drawn last, so a retry after a failure above
        # does not advance a generator twice.
        u = torch.cat([torch.rand(1, generator=self._generator(it)) for it in items]).to(logits.device)
        cum = probs.cumsum(dim=-1)
        pick = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0]
        pick = pick.clamp_max(logits.shape[1] - 1)
        # A temperature so small that the logits overflow leaves no distribution: take its limit.
        bad = ~torch.isfinite(cum[:, -1]) | (cum[:, -1] <= 0)
        return torch.where(bad, logits.argmax(dim=-1), pick)


def _bans(it: StepItem, eos: tuple) -> list[int]:
    """Token ids this row may not sample now: EOS and the stop token ids while the output is
    shorter than min_tokens (unless a grammar decides the end), and the last token of every bad
    word whose earlier tokens end the output (vLLM's bad_words)."""
    p = it.params
    out: list[int] = []
    produced = len(it.history) - it.num_prompt
    if p.min_tokens and produced < p.min_tokens and it.guide is None:
        out += list(eos) + list(p.stop_token_ids)
    if p.bad_words_ids:
        tail = it.history[it.num_prompt:]
        for word in p.bad_words_ids:
            k = len(word) - 1
            if k == 0 or (len(tail) >= k and tuple(tail[len(tail) - k:]) == word[:-1]):
                out.append(word[-1])
    return out


def thinking_spent(it: StepItem) -> bool:
    """Whether the row's thinking is open and holds its budget's tokens (SamplingParams.thinking_budget)."""
    budget, close, opener = it.params.thinking_budget
    hist, start = it.history, it.num_prompt
    if opener is not None:
        if len(hist) <= start or hist[start] != opener:
            return False        # the answer did not open any thinking
        start += 1
    # The length first: the scan for the close token only once the budget is reached.
    return len(hist) - start >= budget and close not in hist[start:]


def _close_thinking(logits: torch.Tensor, items: list[StepItem]) -> None:
    """A spent thinking budget: the close token only (its logit kept, every other one -inf)."""
    for r, it in enumerate(items):
        if it.params.thinking_budget and thinking_spent(it):
            close = it.params.thinking_budget[1]
            keep = logits[r, close].clone()
            logits[r] = NEG_INF
            logits[r, close] = keep


def _bias(logits: torch.Tensor, items: list[StepItem]) -> None:
    """OpenAI's logit_bias, every row's at once (ids beyond the vocabulary are ignored)."""
    vocab = logits.shape[1]
    rows, ids, vals = [], [], []
    for r, it in enumerate(items):
        for tid, b in it.params.logit_bias:
            if tid < vocab:
                rows.append(r)
                ids.append(tid)
                vals.append(b)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                          torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)


def warped_probs(logits: torch.Tensor, items: list[StepItem]) -> torch.Tensor:
    """Sampling distribution per row: temperature, top_k, top_p, min_p, typical_p as HF defines
    them (each keeps at least one token)."""
    dev, vocab = logits.device, logits.shape[1]
    params = [it.params for it in items]
    x = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]   # clamped to the vocabulary
    if min(ks) < vocab:
        k = torch.tensor(ks, device=dev)
        kth = x.topk(max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_x, order = x.sort(dim=-1, stable=True)        # ascending, as HF's TopPLogitsWarper;
        # stable: tied logits keep token order, so a tie cannot flip what is cut
        remove = sorted_x.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
        remove[:, -1] = False
        x = x.masked_fill(remove.scatter(1, order, remove), NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), NEG_INF)
    typ = [r for r, p in enumerate(params) if p.typical_p < 1.0]
    if typ:
        sel = torch.tensor(typ, device=dev)
        mass = torch.tensor([params[r].typical_p for r in typ], device=dev)
        x[sel] = _typical(x[sel], mass)
    return x.softmax(dim=-1)


def _typical(x: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """HF's TypicalLogitsWarper with a per-row mass."""
    normalized = torch.log_softmax(x, dim=-1)
    ent = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
    shifted = (-normalized - ent).abs()
    sorted_scores, order = shifted.sort(dim=-1, stable=True)
    cum = x.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cum < mass[:, None]).sum(dim=1).clamp_(max=x.shape[1] - 1)
    remove = sorted_scores > sorted_scores.gather(1, last[:, None])
    remove[:, :1] = False
    return x.masked_fill(remove.scatter(1, order, remove), NEG_INF)


def top_tokens(logprobs: torch.Tensor, counts: list[int]) -> list[tuple]:
    """Per row, the counts[r] most likely (id, logprob), most likely first."""
    n = min(max(counts, default=0), logprobs.shape[1])
    if n <= 0:
        return [()] * len(counts)
    vals, idx = logprobs.topk(n, dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    return [tuple(zip(idx[r][:c], vals[r][:c])) for r, c in enumerate(counts)]


def prompt_logprobs(logits: torch.Tensor, it: StepItem) -> tuple:
    """logits [n, V] for the item's positions start_pos .. start_pos+n-1: the log-prob of each
    following prompt token (the one at position p+1), as far as it is known. With
    params.prompt_top_n set, each is (log-prob, rank, ((id, log-prob), ...) top alternatives)."""
    s, n = it.start_pos, len(it.token_ids)
    targets = it.history[s + 1:s + n + 1]
    top = it.params.prompt_top_n
    out: list = []
    for a in range(0, len(targets), 256):         # bounded memory: [256, V] at a time
        rows = torch.log_softmax(logits[a:a + 256][:len(targets) - a].float(), dim=-1)
        tgt = torch.tensor(targets[a:a + 256], device=rows.device)
        lps = rows.gather(1, tgt[:, None])[:, 0]
        if top is None:
            out += lps.tolist()
            continue
        ranks = ((rows > lps[:, None]).sum(dim=-1) + 1).tolist()
        alts = top_tokens(rows, [top] * rows.shape[0])
        out += list(zip(lps.tolist(), ranks, alts))
    return tuple(out)
