"""BlockManager: allocation, growth, freeing, prefix caching and LRU eviction (no torch)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from handler.engine.blocks import BlockManager


def test_no_torch_imported():
    code = ("import sys, handler.engine.blocks, handler.engine.scheduler; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_ensure_free():
    bm = BlockManager(8, 4)
    assert bm.allocate(1, list(range(5)), reserve_tokens=5) == 0   # no prefix caching: no hit
    assert len(bm.table(1)) == 2 and bm.num_free == 6
    assert bm.allocate(2, [7] * 3, reserve_tokens=9) == 0          # reservation beyond the prompt
    assert len(bm.table(2)) == 3 and bm.num_free == 3
    assert not set(bm.table(1)) & set(bm.table(2))
    assert bm.ensure(1, 8) and len(bm.table(1)) == 2               # still inside block 2
    assert bm.ensure(1, 9) and len(bm.table(1)) == 3 and bm.num_free == 2
    assert bm.allocated_tokens() == 6 * 4
    bm.check_invariants()
    assert not bm.ensure(1, 9 + 3 * 4)                             # needs 3 more, 2 free
    assert len(bm.table(1)) == 3 and bm.num_free == 2               # ... and nothing changed
    bm.free(1)
    bm.free(1)                                                     # a second free is a no-op
    bm.free(2)
    assert bm.num_free == 8 and bm.tables == {}
    bm.check_invariants()


def test_allocate_fails_cleanly_when_full():
    bm = BlockManager(4, 4)
    assert bm.allocate(1, [1] * 9, 9) == 0                         # 3 blocks
    assert not bm.can_allocate([2] * 5, 5)
    assert bm.allocate(2, [2] * 5, 5) is None                      # needs 2, 1 free
    assert 2 not in bm.tables and bm.num_free == 1
    assert bm.can_allocate([2] * 4, 4) and not bm.can_allocate([2] * 4, 4, watermark=1)
    bm.check_invariants()


def _cached_bm(num_blocks=16, bs=4):
    return BlockManager(num_blocks, bs, enable_prefix_caching=True)


def test_prefix_hit_shares_full_blocks():
    bm = _cached_bm()
    a = list(range(1, 11))                                         # 10 tokens: 2 full blocks + 2
    assert bm.allocate(1, a, 10) == 0
    bm.commit(1, a, 10)
    b = a[:8] + [99, 98]
    assert bm.allocate(2, b, 10) == 8                              # hit reported in tokens
    ta, tb = bm.table(1), bm.table(2)
    assert tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [bm.ref[x] for x in ta] == [2, 2, 1]
    assert bm.hit_tokens == 8
    bm.check_invariants()
    # A diverging first block shares nothing, even if later blocks agree.
    assert bm.allocate(3, [0] + a[1:], 10) == 0
    assert not set(bm.table(3)) & set(ta)
    for s in (1, 2, 3):
        bm.free(s)
    assert bm.num_free == 16
    bm.check_invariants()


def test_prefix_hit_leaves_at_least_one_token():
    bm = _cached_bm()
    a = list(range(1, 9))                                          # exactly 2 blocks
    bm.allocate(1, a, 8)
    bm.commit(1, a, 8)
    assert len(bm.cached) == 2
    # The same prompt again: only (8-1)//4 = 1 block may hit, the last block is recomputed.
    assert bm.allocate(2, list(a), 8) == 4
    assert bm.table(2)[0] == bm.table(1)[0] and bm.table(2)[1] != bm.table(1)[1]
    # A one-block prompt never hits.
    assert bm.allocate(3, a[:4], 4) == 0
    assert bm.table(3)[0] not in bm.table(1)
    bm.check_invariants()


def test_commit_registers_only_full_computed_blocks():
    bm = _cached_bm()
    a = list(range(1, 13))
    bm.allocate(1, a, 12)
    bm.commit(1, a, 3)                                             # block 0 not yet full
    assert bm.cached == {}
    assert bm.allocate(2, a, 12) == 0
    bm.free(2)
    bm.commit(1, a, 7)                                             # block 0 full, block 1 not
    assert list(bm.cached.values()) == [bm.table(1)[0]]
    assert bm.allocate(3, a, 12) == 4
    bm.commit(1, a, 12)                                            # all three full
    assert len(bm.cached) == 3
    assert bm.allocate(4, a, 12) == 8                              # still one token left to compute
    bm.check_invariants()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, 2)
    a = [1, 2, 3, 4, 5]
    bm.allocate(1, a, 5)
    bm.commit(1, a, 5)
    assert bm.cached == {}
    assert bm.allocate(2, a, 5) == 0
    assert not set(bm.table(1)) & set(bm.table(2))


def test_freed_cached_blocks_stay_reusable():
    bm = _cached_bm(num_blocks=4, bs=2)
    a = [1, 2, 3, 4, 5]
    bm.allocate(1, a, 5)
    bm.commit(1, a, 5)
    first_two = bm.table(1)[:2]
    bm.free(1)
    assert bm.num_free == 4                                        # cached blocks count as free
    assert set(bm.evictable) == set(first_two)
    assert bm.allocate(2, a[:4] + [9], 5) == 4                     # revived from the LRU list
    assert bm.table(2)[:2] == first_two and not bm.evictable
    bm.check_invariants()


def test_eviction_is_least_recently_used_first():
    bm = _cached_bm(num_blocks=6, bs=2)
    p, q = [1, 2, 3], [5, 6, 7]
    for sid, toks in ((1, p), (2, q)):
        bm.allocate(sid, toks, 3)
        bm.commit(sid, toks, 3)
    p_block, q_block = bm.table(1)[0], bm.table(2)[0]
    bm.free(1)
    bm.free(2)
    # Touch p again: it becomes the most recently used, q the least.
    assert bm.allocate(3, p[:2] + [8], 3) == 2
    bm.free(3)
    assert list(bm.evictable) == [q_block, p_block]
    # Pressure: 4 plain free blocks + 1 eviction.
    assert bm.allocate(4, list(range(100, 110)), 10) == 0
    assert q_block in bm.table(4) and p_block not in bm.table(4)
    assert bm.block_hash[q_block] is None and len(bm.cached) == 1  # the evicted hash is gone
    bm.free(4)
    assert bm.allocate(5, q[:2] + [9], 3) == 0                     # q's prefix misses now
    assert bm.allocate(6, p[:2] + [9], 3) == 2                     # p's still hits
    bm.check_invariants()
    bm.free(5)
    bm.free(6)
    assert bm.num_free == 6


def test_free_puts_tail_before_head_in_lru():
    bm = _cached_bm(num_blocks=8, bs=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    bm.allocate(1, a, 7)
    bm.commit(1, a, 7)
    t = bm.table(1)
    bm.free(1)
    assert list(bm.evictable) == [t[2], t[1], t[0]]                # the shared head goes last


def test_can_allocate_counts_revived_blocks_as_taken():
    bm = _cached_bm(num_blocks=3, bs=2)
    a = [1, 2, 3, 4, 5]
    bm.allocate(1, a, 5)
    bm.commit(1, a, 5)
    bm.free(1)                                                     # 2 cached + 1 plain free
    # A 2-block hit and 2 new blocks: only 1 free block besides the revived ones.
    assert not bm.can_allocate(a[:4] + [6, 7, 8], 7)
    assert bm.allocate(2, a[:4] + [6, 7, 8], 7) is None
    assert bm.can_allocate(a[:4] + [6], 5)
    bm.check_invariants()


# ---------------------------------------------------------------- property-based
class BlockMachine(RuleBasedStateMachine):
    """Random allocate/grow/compute/free. A fake KV store (slot -> (position, token)) is written
    whenever a sequence computes tokens; every sequence must always read back its own tokens at
    its computed positions, i.e. no block is handed to two sequences unless it holds the same
    tokens for both (a shared, cached prefix)."""

    @initialize(caching=st.booleans(), num_blocks=st.integers(1, 12), bs=st.integers(1, 4))
    def setup(self, caching, num_blocks, bs):
        self.bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
        self.kv: dict[int, tuple[int, int]] = {}
        self.seqs: dict[int, dict] = {}          # seq -> {"tokens", "computed"}
        self.next_id = 0

    def _slot(self, sid, pos):
        bs = self.bm.block_size
        return self.bm.table(sid)[pos // bs] * bs + pos % bs

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14), extra=st.integers(0, 6))
    def allocate(self, tokens, extra):
        sid, self.next_id = self.next_id, self.next_id + 1
        free_before = self.bm.num_free
        fits = self.bm.can_allocate(tokens, len(tokens) + extra)
        hit = self.bm.allocate(sid, tokens, len(tokens) + extra)
        assert (hit is not None) == fits
        if hit is None:
            assert self.bm.num_free == free_before and sid not in self.bm.tables
            return
        bs = self.bm.block_size
        assert hit % bs == 0 and hit <= len(tokens) - 1
        assert len(self.bm.table(sid)) == self.bm.blocks_for(len(tokens) + extra)
        if not self.bm.prefix_caching:
            assert hit == 0
        for pos in range(hit):                   # a prefix hit must hold exactly our tokens
            assert self.kv.get(self._slot(sid, pos)) == (pos, tokens[pos])
        self.seqs[sid] = {"tokens": list(tokens), "computed": hit}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def grow(self, data, new):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        before = list(self.bm.table(sid))
        if self.bm.ensure(sid, len(s["tokens"]) + len(new)):
            s["tokens"] += new
            assert len(self.bm.table(sid)) >= self.bm.blocks_for(len(s["tokens"]))
            assert self.bm.table(sid)[:len(before)] == before
        else:
            assert self.bm.table(sid) == before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        end = data.draw(st.integers(s["computed"], len(s["tokens"])))
        for pos in range(s["computed"], end):
            self.kv[self._slot(sid, pos)] = (pos, s["tokens"][pos])
        s["computed"] = end
        self.bm.commit(sid, s["tokens"], end)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=5))
    def fork(self, data, new):
        """A sample forks from another's computed tokens; partly filled blocks are copied."""
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        p = self.seqs[parent]
        n = data.draw(st.integers(0, p["computed"]))
        sid, self.next_id = self.next_id, self.next_id + 1
        free_before = self.bm.num_free
        copies = self.bm.fork(parent, sid, n)
        if copies is None:
            assert n % self.bm.block_size and free_before == 0 and sid not in self.bm.tables
            return
        assert len(copies) == (1 if n % self.bm.block_size else 0)
        assert self.bm.num_free == free_before - len(copies)
        for src, dst in copies:                  # what the runner does before the next forward
            for k in range(self.bm.block_size):
                if src * self.bm.block_size + k in self.kv:
                    self.kv[dst * self.bm.block_size + k] = self.kv[src * self.bm.block_size + k]
        self.seqs[sid] = {"tokens": p["tokens"][:n], "computed": n}
        if new and self.bm.ensure(sid, n + len(new)):
            self.seqs[sid]["tokens"] += new

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        del self.seqs[sid]
        self.bm.free(sid)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        bs = self.bm.block_size
        owner: dict[int, tuple[int, int]] = {}
        for sid, s in self.seqs.items():
            table = self.bm.table(sid)
            assert len(set(table)) == len(table)
            for pos in range(s["computed"]):
                assert self.kv.get(self._slot(sid, pos)) == (pos, s["tokens"][pos])
            for i, b in enumerate(table):
                if self.bm.block_hash[b] is not None:   # registered: full and computed for us too
                    assert s["computed"] >= (i + 1) * bs
                if b in owner:                   # shared: same index, same full-block prefix
                    other, j = owner[b]
                    assert i == j
                    prefix = (i + 1) * bs
                    assert s["computed"] >= prefix and self.seqs[other]["computed"] >= prefix
                    assert s["tokens"][:prefix] == self.seqs[other]["tokens"][:prefix]
                owner[b] = (sid, i)
        for h, b in self.bm.cached.items():      # a registered block is full of computed tokens
            assert all(b * bs + k in self.kv for k in range(bs))

    def teardown(self):
        if hasattr(self, "bm"):
            for sid in list(self.seqs):
                self.bm.free(sid)
            self.bm.check_invariants()
            assert self.bm.num_free == self.bm.num_blocks and not self.bm.tables


BlockMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_block_machine = BlockMachine.TestCase
