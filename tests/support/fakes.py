"""The one fake runner (handler.engine.types.Runner without a model), for the scheduler's tests
and for an Engine behind the real HTTP app."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from handler.engine.types import SampleResult, StepItem


def history_hash(tokens) -> int:
    """A deterministic 'model' core: a function of the sequence's own tokens only, so a batch
    mate's result is known from running it alone."""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return h


@dataclass(frozen=True)
class FakeKV:
    num_blocks: int
    block_size: int


class FakeSampler:
    def __init__(self):
        self.resets = 0

    def reset(self) -> None:        # Engine.reset(), after an engine error
        self.resets += 1


class FakeRunner:
    """Writes each fed token into a fake KV pool at the slot its block table gives, then, for each
    sampling item, reads the whole context back through the block table and answers
    SampleResult(fn(context), logprob). A block shared or reused wrongly shows up as a wrong
    token read back. `hold` (set: run) lets a test keep the engine inside a step; `in_step` is
    set once a step has begun."""

    def __init__(self, block_size: int, fn: Callable[[list[int]], int] = history_hash,
                 *, tokenizer: Any = None, num_blocks: int = 512, logprob: float = 0.0):
        self.bs, self.fn, self.logprob = block_size, fn, logprob
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.kv = FakeKV(num_blocks, block_size)
        self.sampler = FakeSampler()
        self.pool: dict[int, tuple[int, int]] = {}     # slot -> (position, token)
        self.calls: list[list[StepItem]] = []
        self.released: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.in_step = threading.Event()

    def _slot(self, table, pos):
        return table[pos // self.bs] * self.bs + pos % self.bs

    def step(self, items: list[StepItem], copies=()) -> list[SampleResult]:
        self.in_step.set()
        self.hold.wait(60)
        self.calls.append(items)
        bs = self.bs
        for src, dst in copies:                        # copy-on-write of forked samples' blocks
            for k in range(bs):
                if src * bs + k in self.pool:
                    self.pool[dst * bs + k] = self.pool[src * bs + k]
        for it in items:                               # all writes first, as a packed forward does
            assert list(it.token_ids) == it.history[it.start_pos:it.start_pos + len(it.token_ids)]
            assert len(it.block_table) * bs >= it.start_pos + len(it.token_ids)
            for k, tok in enumerate(it.token_ids):
                self.pool[self._slot(it.block_table, it.start_pos + k)] = (it.start_pos + k, tok)
        out = []
        for it in items:
            end = it.start_pos + len(it.token_ids)
            assert it.sample == (end == len(it.history))
            if not it.sample:
                out.append(SampleResult())
                continue
            ctx = [self.pool[self._slot(it.block_table, p)] for p in range(end)]
            assert [p for p, _ in ctx] == list(range(end))
            out.append(SampleResult(self.fn([t for _, t in ctx]), self.logprob))
        return out

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)
