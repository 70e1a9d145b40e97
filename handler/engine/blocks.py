"""KV block bookkeeping: free list, reference counts, block tables, prefix hashes. No torch.

A block holds `block_size` token slots of every layer's KV. A sequence's block table maps its
position p to slot `table[p // block_size] * block_size + p % block_size`.
Full blocks can be registered under a chained hash of (parent hash, token ids) and shared by
later sequences with the same prefix; unreferenced cached blocks stay reusable until evicted
least-recently-used. A chain may start from a `root` (the LoRA adapter's key): sequences with
different roots never share a block, since the same tokens give other KV under another adapter.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.hit_tokens = 0                              # prefix-cache hits, in tokens (a metric)
        self.reset()

    def reset(self) -> None:
        """Every block free and uncached, no tables (the hit counter stays)."""
        num_blocks = self.num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple | None] = [None] * num_blocks   # of a registered block
        self.cached: dict[int, int] = {}                 # hash -> block id
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, LRU first
        self.tables: dict[int, list[int]] = {}
        self.hashes: dict[int, list[int]] = {}           # seq -> chained hashes of its full blocks
        self.roots: dict[int, object] = {}               # seq -> its chain's root (None: base model)

    # ---- queries
    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.evictable)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def table(self, seq_id: int) -> list[int]:
        return self.tables[seq_id]

    def allocated_tokens(self, tables: dict[int, list[int]] | None = None) -> int:
        # Distinct blocks: a prefix block shared by several sequences is one block of the pool.
        # `tables`: a snapshot, for readers on another thread.
        tables = self.tables if tables is None else tables
        return len({b for t in tables.values() for b in t}) * self.block_size

    # ---- prefix matching
    @staticmethod
    def _chain(parent: int | None, tokens) -> int:
        return hash((parent, tuple(tokens)))

    def match(self, token_ids: list[int], root=None) -> list[int]:
        """Cached blocks covering a prefix of token_ids (at least one token is left to compute)
        in the chain that starts at `root`. A hit is checked against the block's tokens, not only
        its hash."""
        if not self.prefix_caching:
            return []
        bs, out, parent = self.block_size, [], root
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self._chain(parent, chunk)
            b = self.cached.get(h)
            if b is None or self.block_tokens[b] != chunk:
                break
            out.append(b)
            parent = h
        return out

    # ---- allocation
    def _take(self) -> int:
        if self.free_plain:
            return self.free_plain.pop()
        b, _ = self.evictable.popitem(last=False)        # evict the least recently used
        del self.cached[self.block_hash[b]]
        self.block_hash[b] = self.block_tokens[b] = None
        return b

    def can_allocate(self, token_ids: list[int], reserve_tokens: int, watermark: int = 0,
                     hit: list[int] | None = None) -> bool:
        """`hit`: match(token_ids) if the caller has it ([] to bypass the prefix cache)."""
        hit = self.match(token_ids) if hit is None else hit
        revived = sum(1 for b in hit if self.ref[b] == 0)
        need = self.blocks_for(max(reserve_tokens, len(token_ids))) - len(hit)
        return need + watermark <= self.num_free - revived

    def allocate(self, seq_id: int, token_ids: list[int], reserve_tokens: int,
                 hit: list[int] | None = None, root=None) -> int | None:
        """Give seq_id a table covering reserve_tokens; returns the number of prefix-cached
        tokens (already computed), or None when the blocks are not there. `root`: the chain's
        root for this sequence's blocks (match(token_ids, root) is the `hit` to pass)."""
        assert seq_id not in self.tables, f"sequence {seq_id} already has blocks"
        hit = self.match(token_ids, root) if hit is None else hit
        if not self.can_allocate(token_ids, reserve_tokens, hit=hit):
            return None
        for b in hit:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
        table = list(hit)
        for _ in range(self.blocks_for(max(reserve_tokens, len(token_ids))) - len(hit)):
            b = self._take()
            self.ref[b] = 1
            table.append(b)
        self.tables[seq_id] = table
        self.hashes[seq_id] = [self.block_hash[b] for b in hit]
        self.roots[seq_id] = root
        self.hit_tokens += len(hit) * self.block_size
        return len(hit) * self.block_size

    def ensure(self, seq_id: int, n_tokens: int) -> bool:
        """Grow seq_id's table to cover n_tokens; False (and no change) if blocks run out."""
        table = self.tables[seq_id]
        extra = self.blocks_for(n_tokens) - len(table)
        if extra <= 0:
            return True
        if extra > self.num_free:
            return False
        for _ in range(extra):
            b = self._take()
            self.ref[b] = 1
            table.append(b)
        return True

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Shrink seq_id's table to the blocks covering n_tokens (speculative decoding: the slots
        of rejected draft tokens past the end). Only blocks past every registered (full, computed)
        block go, so a released block never holds a prefix-cache entry."""
        table = self.tables[seq_id]
        keep = max(self.blocks_for(n_tokens), len(self.hashes.get(seq_id, ())))
        while len(table) > keep:
            b = table.pop()
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free_plain.append(b)

    def commit(self, seq_id: int, token_ids: list[int], n_computed: int) -> None:
        """Register the blocks of seq_id that are now full of computed tokens in the prefix cache."""
        if not self.prefix_caching:
            return
        hashes, table, bs = self.hashes[seq_id], self.tables[seq_id], self.block_size
        while len(hashes) < n_computed // bs:
            i = len(hashes)
            h = self._chain(hashes[-1] if hashes else self.roots.get(seq_id),
                            token_ids[i * bs:(i + 1) * bs])
            hashes.append(h)
            b = table[i]
            if h not in self.cached and self.block_hash[b] is None:
                self.cached[h] = b
                self.block_hash[b] = h
                self.block_tokens[b] = tuple(token_ids[i * bs:(i + 1) * bs])

    def fork(self, parent: int, child: int, n_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` the parent's KV for positions < n_tokens: full blocks shared (reference
        counted), a partly filled last block copied, since the child writes into it next
        (copy-on-write). Returns the (src, dst) block copies the runner makes before the next
        forward, or None (and no change) when no block is free for the copy."""
        assert child not in self.tables, f"sequence {child} already has blocks"
        bs, src = self.block_size, self.tables[parent][:self.blocks_for(n_tokens)]
        full = n_tokens // bs
        copies = []
        if len(src) > full:
            if not self.num_free:
                return None
            b = self._take()       # never one of src: those are referenced by the parent
            self.ref[b] = 1
            copies.append((src[full], b))
        for b in src[:full]:
            self.ref[b] += 1
        self.tables[child] = src[:full] + [dst for _, dst in copies]
        self.hashes[child] = list(self.hashes[parent][:full])
        self.roots[child] = self.roots.get(parent)
        return copies

    def free(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id, None)
        self.hashes.pop(seq_id, None)
        self.roots.pop(seq_id, None)
        if table is None:
            return
        # Tail blocks first so that a shared prefix's head is evicted last.
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free_plain.append(b)

    def check_invariants(self) -> None:
        held = {}
        for t in self.tables.values():
            for b in t:
                held[b] = held.get(b, 0) + 1
        assert all(self.ref[b] == held.get(b, 0) for b in range(self.num_blocks)), "ref counts"
        free = set(self.free_plain) | set(self.evictable)
        assert len(free) == self.num_free, "a block is listed free twice"
        assert all(self.ref[b] == 0 for b in free), "a free block is referenced"
        assert len(free) + len(held) == self.num_blocks, "a block is lost"
        assert all(self.block_hash[b] == h for h, b in self.cached.items()), "hash map"
