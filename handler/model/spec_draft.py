"""Speculative decoding with a draft model: a second, small ModelRunner that proposes its greedy tokens.

The draft has its own paged KV pool and its own block tables (a BlockManager keyed by the target's
sequence ids). For each speculating sequence, each step:

  1. catch up: the draft keeps the tokens whose KV it holds (`held`); the longest common prefix of
     those and the sequence's tokens stays, the rest is rolled back (the rejected proposals of the
     previous step lie past the accepted prefix), and the tokens after it are fed (the whole
     prompt on first use, then the tokens accepted since) as one chunk whose last row gives d1;
  2. k - 1 greedy decode steps give d2..dk (batched across sequences: one draft forward per step).

After step 2 the draft holds tokens + d1..d(k-1). The target verifies with spec_verify.py: for a
draft model the proposal distribution q is the draft's greedy point mass, which is what its
rejection rule assumes, so sampled outputs keep the target's distribution. A sequence's draft KV
is freed when it finishes or is preempted (`release`), and when the draft's pool runs out for it
(it then decodes without proposals that step). The engine asks it between its steps (handler/engine/
loop.py Engine.step), so its forwards run in the engine thread under the step watchdog.
"""
from __future__ import annotations

import logging

from handler.engine.blocks import BlockManager
from handler.engine.request import SamplingParams
from handler.engine.types import DraftAsk, StepItem

log = logging.getLogger("lmi.spec")

_GREEDY = SamplingParams(max_new_tokens=1 << 30)


class DraftTokenizerMismatch(ValueError):
    pass


def check_same_tokenizer(target, draft) -> None:
    """Raises DraftTokenizerMismatch saying how the two tokenizers differ (vocabulary, special ids)."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if len(tv) != len(dv):
        raise DraftTokenizerMismatch(f"its vocabulary has {len(dv)} tokens, the model's {len(tv)}")
    if tv != dv:
        diff = sorted(set(tv.items()) ^ set(dv.items()))[:1]
        raise DraftTokenizerMismatch(f"its vocabulary maps tokens to other ids (e.g. {diff[0][0]!r})")
    ts, ds = sorted(getattr(target, "all_special_ids", [])), sorted(getattr(draft, "all_special_ids", []))
    if ts != ds:
        raise DraftTokenizerMismatch(f"its special token ids {ds} differ from the model's {ts}")


class DraftProposer:
    """The draft_model proposer (handler/engine/types.py's Proposer, batched and stateful):
    propose([(seq_id, tokens, k)]) -> one proposal per ask; release(seq_id); reset()."""
    method = "draft_model"

    def __init__(self, runner):
        self.runner = runner
        self.blocks = BlockManager(runner.kv.num_blocks, runner.block_size)
        self.held: dict[int, list[int]] = {}     # seq_id -> the tokens whose KV the draft holds

    def release(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        self.held.pop(seq_id, None)
        self.runner.release(seq_id)

    def reset(self) -> None:
        for sid in list(self.held):
            self.release(sid)
        self.blocks.reset()

    def _room(self, sid: int, tokens: list[int], k: int) -> int | None:
        """Roll sid's draft KV back to the common prefix with `tokens` and make room for the k - 1
        draft tokens after them; returns the number of tokens kept, None when the pool is full."""
        held = self.held.get(sid)
        if held is None:
            self.blocks.allocate(sid, [], 0, hit=[])
            held = []
        c, n = 0, min(len(held), len(tokens) - 1)     # at least the last token is fed (its row gives d1)
        while c < n and held[c] == tokens[c]:
            c += 1
        self.blocks.truncate(sid, c)
        if not self.blocks.ensure(sid, len(tokens) + k - 1):
            self.release(sid)
            return None
        self.held[sid] = tokens[:c]
        return c

    def propose(self, reqs: list[DraftAsk]) -> list[list[int]]:
        """Every ask at once: one draft forward per drafted token position."""
        out: list[list[int]] = [[] for _ in reqs]
        live: list[int] = []            # indices into reqs still drafting
        items: list[StepItem] = []
        for i, (sid, tokens, k) in enumerate(reqs):
            if k <= 0 or len(tokens) + k - 1 > self.runner.max_model_len:
                continue
            c = self._room(sid, tokens, k)
            if c is None:
                continue
            live.append(i)
            items.append(StepItem(sid, list(tokens[c:]), c, self.blocks.table(sid), True, _GREEDY, tokens))
        step = 0
        while items:
            try:
                results = self.runner.step(items)
            except Exception:      # the draft failing costs this step's proposals, not the requests
                log.warning("draft model step failed; these sequences decode without proposals", exc_info=True)
                for i in live:
                    self.release(reqs[i][0])
                    out[i] = []
                break
            step += 1
            nxt_live, nxt_items = [], []
            for i, it, res in zip(live, items, results):
                sid, tokens, k = reqs[i]
                if res.error is not None or res.token is None:
                    log.warning("draft step failed for sequence %d: %s", sid, res.error)
                    self.release(sid)
                    out[i] = []
                    continue
                out[i].append(res.token)
                self.held[sid] = list(it.history)      # what the draft's KV now covers
                if len(out[i]) < k:
                    hist = list(tokens) + out[i]
                    nxt_live.append(i)
                    nxt_items.append(StepItem(sid, [res.token], len(hist) - 1, self.blocks.table(sid), True,
                                              _GREEDY, hist))
            live, items = nxt_live, nxt_items
        return out
