"""Admission and per-step plans for the four strategies. No torch: plain ids and counts only.

One rule for every strategy (as in vLLM v1): a sequence has `num_computed` tokens in the KV
cache; each step gives it the tokens it lacks (a prompt chunk, or the last sampled token), and
it samples when it has caught up. The strategies differ only in admission and KV reservation:

  none     one sequence at a time; reserves prompt + max_new_tokens
  dynamic  request level: a batch of up to batch_size forms when that many wait or
           max_batch_delay passed since the first arrived; nobody joins until all finish
  rolling  iteration level: join/leave every step; reserves prompt + max_new_tokens at admission
  paged    iteration level: blocks on demand; preempt (recompute) the newest when they run out

Latency under load (iteration-level strategies; handler/engine/stepcost.py measures the steps):
  target_tpot_s    each step's prefill is sized so that the step, decode rows first, is expected
                   to take at most this long (prefill_token_budget stays the hard cap); a step whose
                   decode rows alone fill it admits and prefills nothing (the running batch shrinks
                   to what the target allows; with nothing decoding, prompts move by a floor)
  priority         waiting sequences are taken lowest `priority` first (vLLM's semantics), and one
                   may preempt (recompute) running sequences of a strictly higher number; while a
                   better class's prompt prefills, the worse classes' decode rows sit out (its
                   steps are as short as that prompt makes them: the better class's first token
                   comes sooner), and so do their prompts in steps the better class's fill, at most
                   SIT_OUT_STEPS steps in a row (then they move one)
  aging_s          under priority: a sequence that has waited this long for admission or its first
                   token goes ahead of every class (under a TPOT target: at least the floor of prompt
                   tokens a step, first), and is no priority preemption's victim until its next
                   token: nothing is passed over forever. Under
                   fcfs nothing is passed over (admission is in arrival order, the oldest prompt
                   keeps a share of every step), so a TPOT target is never overridden by waiting.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

# What admission raises, for `from handler.engine.scheduler import ...` (admission.py admits).
from handler.engine.admission import CapacityError, QueueFull  # noqa: F401
from handler.engine.blocks import BlockManager
from handler.engine.request import SamplingParams
from handler.engine.stepcost import StepCostModel
# The step types live in types.py; imported here also for `from handler.engine.scheduler import ...`.
from handler.engine.types import DraftAsk, Finish, SampleResult, StepItem, StepPlan

STRATEGIES = ("none", "dynamic", "rolling", "paged")


# Chunked prefill: the oldest prompt still prefilling gets at least 1/this of the step's token
# budget; the rest goes to the prompts with the fewest tokens left (Scheduler._prefill_shares).
OLDEST_PREFILL_SHARE = 4
# Speculative decoding: after m verify steps in a row that accepted nothing a sequence decodes
# min(2^m, this) - 1 steps without proposals (its proposals are wasted rows meanwhile).
MAX_SPEC_BACKOFF = 16
# Under priority scheduling, the most steps in a row a worse class's decode row sits out while a better
# class's prompt prefills (a short prompt's prefill takes 1-3 steps under a TPOT target).
SIT_OUT_STEPS = 3
# The aging bound under priority scheduling when none is given.
DEFAULT_AGING_S = 2.0
SCHEDULING_POLICIES = ("fcfs", "priority")


def min_prefill_tokens(cap: int) -> int:
    """The most prompt tokens the worse classes take beside a better class awaiting its prefill, and a
    step takes under a TPOT target that even an empty step overruns."""
    return min(cap, max(16, cap // 64))


@dataclass(frozen=True)
class SchedulerPolicy:
    """Admission and reservation rules. `strategy` fills in the behaviour fields below; nothing
    downstream tests the strategy's name."""
    strategy: str
    max_batch_size: int = 32            # batch_size (dynamic) / max_rolling_batch_size
    max_batch_delay_s: float = 0.1      # wait_for_batch only
    prefill_token_budget: int = 4096    # chunked_prefill: prompt tokens per step
    max_waiting: int = 1000             # job_queue_size
    max_model_len: int = 2048
    eos_token_ids: frozenset = frozenset()
    prefix_caching: bool = False        # asked for; kept only where blocks grow on demand
    # Behaviour (None: the strategy's value, see STRATEGY_BEHAVIOUR).
    request_level: bool | None = None   # a batch forms, then nobody joins until all finish
    one_request: bool | None = None     # request_level with one request (a client's list) a batch
    wait_for_batch: bool | None = None  # gather max_batch_size or wait max_batch_delay_s
    chunked_prefill: bool | None = None   # prompt tokens per step bounded by the budget
    reserve_full_length: bool | None = None   # reserve prompt + max_new_tokens at admission
    # (otherwise blocks grow on demand, preempting the newest sequence when they run out)
    fork_samples: bool | None = None    # samples of one prompt share its KV blocks
    max_loras: int = 0                  # distinct LoRA adapters running at once (0: no LoRA)
    spec: object = None                 # handler.engine.spec.SpecConfig: speculative decoding (None: off)
    target_tpot_s: float | None = None  # a step's expected time bounds its prefill (None: off)
    scheduling_policy: str = "fcfs"     # "fcfs" | "priority"
    aging_s: float = DEFAULT_AGING_S    # see the module's docstring

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        for k, v in STRATEGY_BEHAVIOUR[self.strategy].items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)
        # A shared prefix needs blocks that are not reserved per sequence up front.
        object.__setattr__(self, "prefix_caching", self.prefix_caching and not self.reserve_full_length)
        object.__setattr__(self, "fork_samples", self.fork_samples and not self.reserve_full_length)

    @property
    def by_priority(self) -> bool:
        """Priority classes order admission (iteration-level strategies only)."""
        return self.scheduling_policy == "priority" and not self.request_level

    @property
    def ages(self) -> bool:
        """The aging bound applies: only a policy that can pass a sequence over needs it (priority
        classes; fcfs admits in arrival order, with or without a TPOT target)."""
        return self.by_priority


STRATEGY_BEHAVIOUR = {
    "none": dict(request_level=True, one_request=True, wait_for_batch=False, chunked_prefill=False,
                 reserve_full_length=True, fork_samples=False),
    "dynamic": dict(request_level=True, one_request=False, wait_for_batch=True, chunked_prefill=False,
                    reserve_full_length=True, fork_samples=False),
    "rolling": dict(request_level=False, one_request=False, wait_for_batch=False, chunked_prefill=True,
                    reserve_full_length=True, fork_samples=False),
    "paged": dict(request_level=False, one_request=False, wait_for_batch=False, chunked_prefill=True,
                  reserve_full_length=False, fork_samples=True),
}


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    tokens: list[int] = field(default_factory=list)   # prompt + output; grows as we decode
    num_computed: int = 0
    finish_reason: str | None = None
    admitted: int = -1          # admission order, for preemption victims
    preemptions: int = 0
    cached_tokens: int = 0      # prompt tokens served from the prefix cache
    group: int | None = None    # the prompts of one client-side list share a group
    first_scheduled: float | None = None   # time of the first admission (queue time ends)
    sample_index: int = 0       # which of its prompt's params.num_samples sequences
    fork_of: int | None = None  # sample 0's seq_id: this sample may share its prompt blocks
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt tokens 1.. (details)
    cum_logprob: float = 0.0    # sum of the sampled tokens' log-probs (best_of)
    # Guided decoding: this sequence's GuideState (types.py), advanced by every token it accepts.
    # Its state is that of `tokens`, which a preemption keeps: a recompute needs no rewind.
    guide: object = None
    # Speculative decoding: verify steps in a row that accepted nothing, and decode steps left
    # without a proposal (backing off exponentially: a sequence that is not copying costs no
    # verify rows until it may be again).
    spec_misses: int = 0
    spec_skip: int = 0
    # Latency policies: since when it waits (arrival, or its last preemption), and whether it got
    # in by the aging bound (then no priority preemption picks it before its next token).
    waiting_since: float | None = None
    aged_in: bool = False
    sat_out: int = 0            # steps in a row its decode row sat out (Scheduler._sit_out)
    # Images (types.ImageRef, by offset): their placeholder tokens are keyed by the image's hash in the
    # prefix cache (cache_keys), and each step's item carries those it feeds.
    media: tuple = ()
    _prompt_keys: list | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        if self.waiting_since is None:
            self.waiting_since = self.arrival

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def cache_keys(self) -> list:
        """The tokens as the prefix cache sees them: an image's placeholder tokens are (its hash, k),
        so two images behind the same placeholder ids never share a KV block."""
        if not self.media:
            return self.tokens
        if self._prompt_keys is None:
            keys = list(self.prompt_ids)
            for m in self.media:
                k = 0
                for start, n in m.spans:
                    keys[start:start + n] = [(m.key, k + i) for i in range(n)]
                    k += n
            self._prompt_keys = keys
        return self._prompt_keys + self.tokens[len(self.prompt_ids):]

    def chunk_end(self, start: int, n: int) -> int:
        """n, the prompt tokens a chunk from `start` feeds, moved so that it ends no run of a `whole`
        image inside: to the run's first token, or (a chunk that starts at or in the run) past its last."""
        end = start + n
        for m in self.media:
            if m.whole:
                for a, length in m.spans:
                    if a < end < a + length:    # runs never overlap: at most one holds the end
                        return (a if a > start else a + length) - start
        return n

    def media_in(self, start: int, end: int) -> tuple:
        """The images whose placeholder tokens lie (partly) in positions start..end-1."""
        return tuple(m for m in self.media if m.overlaps(start, end)) if self.media else ()

    @property
    def adapter_key(self):
        """The LoRA adapter's key (None: the base model): its prefix-cache chain root."""
        a = self.params.adapter
        return None if a is None else ("lora", a.uid)


class Scheduler:
    def __init__(self, policy: SchedulerPolicy, blocks: BlockManager):
        self.policy = policy
        self.blocks = blocks
        self.reset()
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "preemptions": 0,
                      "cached_prompt_tokens": 0, "admitted": 0, "forked_prompt_tokens": 0}
        # Preemptions by cause: KV blocks ran out, or a higher priority needed the room.
        self.preemption_causes = {"kv_cache": 0, "priority": 0}
        # Step time ~ decode rows and prefill tokens (Engine.step feeds it: observe_step).
        self.cost = StepCostModel()
        # Speculative decoding (handler/engine/spec.py; the drafts come from the engine's proposer):
        # per method the verify items run, tokens proposed, tokens accepted (emitted = accepted + one
        # per verify).
        self.spec_stats: dict[str, dict[str, int]] = {}
        if policy.spec is not None:
            self.spec_stats[policy.spec.method] = {"verifies": 0, "proposed": 0, "accepted": 0}

    def reset(self) -> None:
        """Forget every sequence and block (after an engine error); the statistics stay."""
        self.blocks.reset()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self._order = itertools.count()
        self._copies: list[tuple[int, int]] = []     # copy-on-write of forked samples' blocks
        self._preempted: list[int] = []     # this step's victims (schedule)
        self._budget = self.policy.prefill_token_budget     # this step's prompt tokens (schedule)
        self._held = 0      # steps in a row the worse classes' prompts sat out (_prefill_shares)
        self._admitted = False      # admit() ran for the step schedule() plans next
        self._now = 0.0

    # ---- intake
    def max_len(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.policy.max_model_len)

    def add(self, seq: Sequence) -> None:
        """A sequence admitted by the engine's Admission (counted and checked to fit there)."""
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def finish(self, seq_id: int, reason: str) -> Sequence | None:
        """End a sequence (done, cancelled or failed) and return its blocks."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return None
        seq.finish_reason = seq.finish_reason or reason
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.free(seq_id)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning
    def next_wakeup(self, now: float) -> float | None:
        """Seconds until admission could change without new arrivals (dynamic's delay)."""
        if self.policy.wait_for_batch and self.waiting and not self.running:
            return max(0.0, self.waiting[0].arrival + self.policy.max_batch_delay_s - now)
        return None

    def _reserve(self, seq: Sequence) -> int:
        return self.max_len(seq) if self.policy.reserve_full_length else len(seq.tokens)

    # ---- samples of one prompt (n / best_of): prefill once, then fork
    def _fork_source(self, seq: Sequence) -> Sequence | None:
        """The running sample 0 whose prompt KV `seq` can share: it has computed all but the
        last prompt token, which the fork recomputes to get its own logits (as vLLM v1's
        parallel sampling does through prefix-cache hits)."""
        if seq.fork_of is None or seq.num_output or not self.policy.fork_samples:
            return None
        parent = self.seqs.get(seq.fork_of)
        if parent is None or parent not in self.running \
                or parent.num_computed < len(parent.prompt_ids) - 1:
            return None
        return parent

    def _awaits_fork(self, seq: Sequence) -> bool:
        """A sample whose sample 0 is running but still prefilling: wait rather than prefill."""
        if seq.fork_of is None or seq.num_output or not self.policy.fork_samples:
            return False
        parent = self.seqs.get(seq.fork_of)
        return parent is not None and parent in self.running \
            and parent.num_computed < len(parent.prompt_ids) - 1

    def _fork(self, seq: Sequence, parent: Sequence) -> bool:
        n = len(seq.prompt_ids) - 1
        copies = self.blocks.fork(parent.seq_id, seq.seq_id, n)
        if copies is None:
            return False
        self._copies += copies
        seq.num_computed = n
        seq.prompt_logprobs = list(parent.prompt_logprobs)
        self.stats["forked_prompt_tokens"] += n
        return True

    def _fork_waiting(self, parent: Sequence) -> None:
        """Right after sample 0's prefill: admit its waiting samples onto its blocks."""
        for q in [q for q in self.waiting if q.fork_of == parent.seq_id]:
            if len(self.running) >= self.policy.max_batch_size or not self._admit(q):
                return

    def _adapter_fits(self, seq: Sequence) -> bool:
        """At most policy.max_loras distinct adapters run at once (one step's device slots)."""
        key = seq.adapter_key
        if key is None:
            return True
        running = {q.adapter_key for q in self.running} - {None}
        return key in running or len(running) < self.policy.max_loras

    def _admit(self, seq: Sequence) -> bool:
        if not self._adapter_fits(seq):
            return False
        parent = self._fork_source(seq)
        if parent is not None:
            if not self._fork(seq, parent):
                return False
        else:
            # Paged keeps a few blocks spare (5% of the pool, at most one per running sequence)
            # so that an admission does not force a preemption on the very next step.
            watermark = 0
            if not self.policy.reserve_full_length:
                watermark = min(len(self.running), max(1, self.blocks.num_blocks // 20))
            # Prompt log-probs need every prompt position computed: no prefix-cache hit.
            keys = seq.cache_keys()
            hit = [] if seq.params.decoder_input_details else \
                self.blocks.match(keys, seq.adapter_key)
            if not self.blocks.can_allocate(keys, self._reserve(seq), watermark, hit):
                return False
            cached = self.blocks.allocate(seq.seq_id, keys, self._reserve(seq), hit,
                                          seq.adapter_key)
            seq.num_computed = cached
            seq.cached_tokens += cached
            self.stats["cached_prompt_tokens"] += cached
        seq.admitted = next(self._order)
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()
        self.stats["admitted"] += 1
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    def _admission(self, now: float) -> None:
        p = self.policy
        if p.request_level:
            if self.running or not self.waiting:
                return
            if p.one_request:   # one request at a time; a client's list (or n samples) is one
                head = self.waiting[0].group
                cap = 1 if head is None else sum(1 for _ in itertools.takewhile(
                    lambda q: q.group == head, self.waiting))
            else:
                cap = p.max_batch_size
            if p.wait_for_batch and len(self.waiting) < cap and \
                    now < self.waiting[0].arrival + p.max_batch_delay_s:
                return
            while self.waiting and len(self.running) < cap and self._admit(self.waiting[0]):
                pass
            return
        # A prompt still prefilling holds at most the oldest's floor of the budget against newcomers
        # (_prefill_shares): a 30k-token prompt does not keep short ones out until it is done.
        floor = max(1, self._budget // OLDEST_PREFILL_SHARE)
        budget = self._budget - sum(min(len(q.tokens) - q.num_computed, floor) for q in self.running
                                    if len(q.tokens) - q.num_computed > 1)
        for head in self._waiting_order(now):
            # An aged head that cannot get in now (no room, no victim: it outranks nobody) keeps its
            # place at the front, and the heads behind it may still preempt into the batch: under a
            # flood of aged low-priority requests, a high-priority arrival is not held behind them.
            aged = self._aged(head, now)
            jumps = self._outranks(head)
            if (len(self.running) >= p.max_batch_size or budget <= 0) and not jumps:
                if aged:
                    continue
                break
            if self._awaits_fork(head):
                break
            while not (len(self.running) < p.max_batch_size and self._admit(head)):
                victim = self._priority_victim(head) if jumps else None
                if victim is None:
                    break
                self._preempt(victim, "priority")
            if head not in self.running:
                if aged:
                    continue
                break
            head.aged_in = aged
            budget -= len(head.tokens) - head.num_computed

    # ---- latency policies (target_tpot_s, priority, aging_s)
    def _aged(self, seq: Sequence, now: float) -> bool:
        """Waiting (for admission or its prompt) for aging_s or more: it goes ahead of everything."""
        return self.policy.ages and now - seq.waiting_since >= self.policy.aging_s

    def _rank(self, seq: Sequence) -> tuple:
        """Plan order, best first: the victim of a KV shortage is the last (so never planned)."""
        return (seq.priority, seq.admitted) if self.policy.by_priority else (seq.admitted,)

    def _outranks(self, seq: Sequence) -> bool:
        """Priority scheduling: some running sequence is of a strictly higher number."""
        return self.policy.by_priority and any(q.priority > seq.priority for q in self.running)

    def _priority_victim(self, seq: Sequence) -> Sequence | None:
        """The running sequence `seq` may preempt: the highest number above its own, newest first;
        never one that got in by the aging bound and has not had its next token yet."""
        cands = [q for q in self.running if q.priority > seq.priority and not q.aged_in]
        return max(cands, key=self._rank) if cands else None

    def _waiting_order(self, now: float) -> list[Sequence]:
        """The waiting sequences in the order admission takes them: the queue's order (arrival;
        preempted ones first), the aged ahead and, under priority scheduling, lower numbers ahead."""
        if not self.policy.ages:
            return list(self.waiting)
        by_priority = self.policy.by_priority
        return sorted(self.waiting, key=lambda q: (not self._aged(q, now), q.priority if by_priority else 0))

    def _step_budget(self, now: float) -> int:
        """This step's prompt tokens: option.max_rolling_batch_prefill_tokens, or under target_tpot_s
        what the measured step cost leaves beside the decode rows; when an outranking sequence awaits
        its prefill, what it leaves beside the rows of that class and better (the worse classes' decode
        rows sit out, their prompts take the floor beside it: _prefill_shares), at least the floor;
        at least the floor when an aged one does (it goes first, so it moves every step without
        making the steps long: a flood of aged requests does not undo the target)."""
        p = self.policy
        cap = p.prefill_token_budget
        if p.target_tpot_s is None or p.request_level:
            return cap
        pending = [*self.waiting, *(q for q in self.running if len(q.tokens) - q.num_computed > 1)]
        worst = max((q.priority for q in self.running), default=None) if p.by_priority else None
        # An outranking prompt: its steps sized to the target beside the rows that run with it (the worse
        # classes' decode rows sit out: _sit_out), so that several urgent prompts get their first tokens
        # over a few short steps rather than all after one long one.
        best = min(q.priority for q in pending) if worst is not None and any(
            q.priority < worst for q in pending) else None
        rows = sum(1 for q in self.running
                   if len(q.tokens) - q.num_computed == 1 and (best is None or q.priority <= best))
        b = self.cost.prefill_budget(rows, p.target_tpot_s)
        if b is None:
            return cap
        if best is not None or (b == 0 and rows == 0) or any(self._aged(q, now) for q in pending):
            # An outranking prompt, an empty step that overruns the target, or one waited past the aging
            # bound: prompts still move, by at least the floor (else nothing decodes, nothing finishes,
            # nothing is admitted).
            return max(min(b, cap), min_prefill_tokens(cap))
        # 0 where the decode rows alone fill the target: nobody is admitted until running ones
        # finish (the running batch shrinks to what the target allows) or, under priority, one has aged.
        return min(b, cap)

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """A step's measured time, for the cost model (the engine calls it after runner.step)."""
        rows = sum(1 for it in plan.items if len(it.token_ids) == 1)
        self.cost.observe(rows, sum(len(it.token_ids) for it in plan.items) - rows, seconds)

    def _preempt(self, victim: Sequence, cause: str = "kv_cache") -> None:
        self.running.remove(victim)
        self.blocks.free(victim.seq_id)
        victim.num_computed = 0
        victim.preemptions += 1
        victim.waiting_since = self._now
        victim.aged_in = False
        self.stats["preemptions"] += 1
        self.preemption_causes[cause] += 1
        self._preempted.append(victim.seq_id)
        self.waiting.appendleft(victim)

    def _prefill_shares(self, now: float) -> dict[int, int]:
        """Prompt tokens each running sequence still prefilling gets this step, within the budget:
        the aged first (together at most the floor); then the oldest (the best class's, under priority scheduling) at least
        1/OLDEST_PREFILL_SHARE of it (short prompts arriving all the time cannot starve a long one);
        then the fewest remaining first, by class under priority scheduling (a short prompt beside
        a 30k one is prefilled at once, so its first token waits one step, not the long prefill)."""
        budget = self._budget
        rem = {q.seq_id: len(q.tokens) - q.num_computed for q in self.running
               if len(q.tokens) - q.num_computed > 1}
        if not rem or budget <= 0:
            return {}
        pending = [q for q in self.running if q.seq_id in rem]
        shares: dict[int, int] = {}
        left = budget

        def give(q: Sequence, most: int) -> None:
            nonlocal left
            more = min(rem[q.seq_id] - shares.get(q.seq_id, 0), most, left)
            if more > 0:
                shares[q.seq_id] = shares.get(q.seq_id, 0) + more
                left -= more

        by_priority = self.policy.by_priority
        best = min(q.priority for q in pending) if by_priority else 0
        # Under priority: in a step the best class's prompts fill, the worse classes' (aged or not) sit
        # out, at most SIT_OUT_STEPS steps in a row (as their decode rows: _sit_out); then they move.
        hold = (by_priority and any(q.priority != best for q in pending) and self._held < SIT_OUT_STEPS
                and sum(n for sid, n in rem.items() if self.seqs[sid].priority == best) >= budget)
        self._held = self._held + 1 if hold else 0
        # The aged first, together at most the floor: each moves every step (but for `hold`), and a
        # flood of aged prompts cannot make the step long (the better classes' prompts and the target
        # keep theirs).
        aged_room = min_prefill_tokens(budget)
        for q in sorted((q for q in pending if self._aged(q, now) and not (hold and q.priority != best)),
                        key=lambda q: q.waiting_since):
            before = left
            give(q, aged_room)
            aged_room -= before - left
        give(min(pending, key=self._rank), max(1, budget // OLDEST_PREFILL_SHARE))
        capped = False
        for q in sorted(pending, key=lambda q: (q.priority if by_priority else 0, rem[q.seq_id], q.admitted)):
            if by_priority and q.priority != best and not capped:
                # The first of the worse classes (sorted after the best): while a better class awaits
                # its prefill, they take at most the floor beside it, the aged and the oldest's share
                # included, so the step stays about as short as the better class's prompts make it.
                capped = True
                left = min(left, (0 if hold else min_prefill_tokens(budget)) - sum(
                    n for sid, n in shares.items() if self.seqs[sid].priority != best))
            if left <= 0:
                break
            give(q, left)
        return shares

    def _spec_on(self) -> bool:
        """Speculation is configured and fewer than disable_by_batch_size sequences run."""
        spec = self.policy.spec
        return spec is not None and (spec.disable_by_batch_size is None
                                     or len(self.running) < spec.disable_by_batch_size)

    def admit(self, now: float) -> None:
        """A step's first half: admission (and priority preemption) at `now`. The engine calls it,
        then draft_asks() (which sees the step's batch), then schedule(), which plans without
        admitting again; schedule() alone does all of it."""
        self._preempted, self._now = [], now
        self._budget = self._step_budget(now)
        self._admission(now)
        self._admitted = True

    def draft_asks(self) -> list[DraftAsk]:
        """The sequences that decode this step and may speculate, best rank first, with k (the
        engine's proposer answers them after admit(); schedule() takes the ids). Asking counts
        against a sequence's back-off (spec_skip), as its step does."""
        if not self._spec_on():
            return []
        asks = []
        for q in sorted(self.running, key=self._rank):
            k = self._draft_len(q, len(q.tokens) - q.num_computed)
            if k > 0:
                asks.append((q.seq_id, q.tokens, k))
        return asks

    def schedule(self, now: float, drafts: dict[int, list[int]] | None = None) -> StepPlan:
        """This step's plan. `drafts`: seq_id -> proposed token ids (the proposer's answers to
        draft_asks()); a draft is kept only for a sequence that decodes one row this step, while
        speculation is on, and (growing blocks) when its slots fit."""
        if not self._admitted:
            self.admit(now)
        self._admitted = False
        unlimited = not self.policy.chunked_prefill
        shares = {} if unlimited else self._prefill_shares(now)
        items: list[StepItem] = []
        drafts = drafts if drafts and self._spec_on() else {}
        order = sorted(self.running, key=self._rank)
        sit_out = self._sit_out() if self.policy.by_priority else ()
        want: dict[int, int] = {}       # seq_id -> tokens fed this step
        for seq in order:
            n = len(seq.tokens) - seq.num_computed
            if n == 1 and seq.seq_id in sit_out:
                continue
            if n > 1 and not unlimited:          # prefill chunk: its share of the token budget
                n = shares.get(seq.seq_id, 0)
                if n > 0 and seq.media:
                    n = seq.chunk_end(seq.num_computed, n)
            if n > 0:
                want[seq.seq_id] = n
        for seq in order:
            if seq not in self.running or seq.seq_id not in want:    # preempted below as a victim
                continue
            n = want[seq.seq_id]
            draft = list(drafts[seq.seq_id])[:self._draft_room(seq, n)] if seq.seq_id in drafts else []
            if draft and not self.policy.reserve_full_length \
                    and not self.blocks.ensure(seq.seq_id, seq.num_computed + n + len(draft)):
                draft = []      # no room for the draft's slots: decode one token (preempting as usual)
            if not self.policy.reserve_full_length:
                while not self.blocks.ensure(seq.seq_id, seq.num_computed + n):
                    victim = max(self.running, key=self._rank)
                    self._preempt(victim, "kv_cache")
                    if victim is seq:
                        break
                if seq not in self.running:
                    continue
            items.append(StepItem(
                seq.seq_id, seq.tokens[seq.num_computed:seq.num_computed + n] + draft, seq.num_computed,
                self.blocks.table(seq.seq_id), seq.num_computed + n == len(seq.tokens),
                seq.params, seq.tokens, len(seq.prompt_ids),
                seq.params.decoder_input_details
                and len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1, seq.guide, tuple(draft),
                seq.media_in(seq.num_computed, seq.num_computed + n), seq.media))
        # Items are planned best rank first (oldest first; by class under priority scheduling) and a
        # victim is the last by rank, so no planned item is ever preempted after the fact.
        plan = StepPlan(items, self._preempted)
        if items:
            plan.copies, self._copies = self._copies, []
        return plan

    def _sit_out(self) -> set[int]:
        """Under priority scheduling, while a better class's prompt prefills: the seq_ids of the worse
        classes' decode rows that sit out this step (module doc). A row that sat out SIT_OUT_STEPS steps
        in a row decodes in this one, so every running sequence decodes at least once in
        SIT_OUT_STEPS + 1 steps."""
        best = min((q.priority for q in self.running if len(q.tokens) - q.num_computed > 1), default=None)
        out = set()
        for q in self.running:
            if (best is not None and q.priority > best and q.sat_out < SIT_OUT_STEPS
                    and len(q.tokens) - q.num_computed == 1):
                q.sat_out += 1
                out.add(q.seq_id)
            else:
                q.sat_out = 0
        return out

    def _draft_len(self, seq: Sequence, n: int) -> int:
        """k, the tokens to propose for a sequence that decodes this step (n == 1 and it samples), or 0
        (counting down its back-off)."""
        if self._draft_room(seq, n) == 0:
            return 0
        if seq.spec_skip > 0:
            seq.spec_skip -= 1
            return 0
        return self._draft_room(seq, n)

    def _draft_room(self, seq: Sequence, n: int) -> int:
        """The most draft tokens a sequence feeding n tokens may carry: 0 unless it decodes (n == 1
        and it samples) unguided, without prompt log-probs; else bounded so that the accepted tokens
        plus the runner's own stay within max_new_tokens and the model's length (and, under
        reserve_full_length, within the reserved slots)."""
        if n != 1 or seq.num_computed + 1 != len(seq.tokens) or seq.num_output == 0 \
                or seq.guide is not None or seq.params.decoder_input_details:
            return 0
        k = min(self.policy.spec.k, seq.params.max_new_tokens - seq.num_output - 1,
                self.policy.max_model_len - len(seq.tokens) - 1)
        if seq.params.eos_after is not None:
            k = min(k, seq.params.eos_after - seq.num_output - 1)
        return max(k, 0)

    def update(self, plan: StepPlan, results: list[SampleResult]) -> list[tuple[Sequence, SampleResult]]:
        """Apply a step's results: one SampleResult per item, in order (Runner.step). Returns
        (sequence, result) for those that got a token or failed; finishes those that hit length
        or EOS, or whose item failed."""
        if len(results) != len(plan.items):
            raise ValueError(f"the runner answered {len(results)} results for {len(plan.items)} items")
        self.stats["steps"] += 1
        got: list[tuple[Sequence, SampleResult]] = []
        for item, res in zip(plan.items, results):
            seq = self.seqs.get(item.seq_id)
            if seq is None or seq not in self.running:   # aborted while the step ran
                continue
            if res.error is not None:
                seq.finish_reason = Finish.FAILED
                got.append((seq, res))
                continue
            n = len(item.token_ids) - len(item.draft)
            self.stats["decode_tokens" if n == 1 and item.sample and seq.num_output else
                       "prefill_tokens"] += n
            if item.draft:
                # The accepted draft tokens' KV is computed too; the rejected ones' is past the end.
                accepted = len(res.more) if res.token is not None else 0
                n += accepted
                st = self.spec_stats[self.policy.spec.method]
                st["verifies"] += 1
                st["proposed"] += len(item.draft)
                st["accepted"] += accepted
                seq.spec_misses = 0 if accepted else seq.spec_misses + 1
                seq.spec_skip = min(2 ** seq.spec_misses, MAX_SPEC_BACKOFF) - 1 if seq.spec_misses else 0
            seq.num_computed += n
            if not item.draft:
                self.blocks.commit(seq.seq_id, seq.cache_keys(), seq.num_computed)
            for k, lp in enumerate(res.prompt_logprobs):    # chunks arrive in order
                if item.start_pos + k == len(seq.prompt_logprobs) < len(seq.prompt_ids) - 1:
                    seq.prompt_logprobs.append(lp)
            if res.token is None:
                continue
            for r in self._each_token(res):
                if not self._append(seq, r, got):
                    break
            if item.draft:
                # Tokens after a finish are dropped: what is computed is at most what is kept.
                seq.num_computed = min(seq.num_computed, len(seq.tokens))
                if not self.policy.reserve_full_length:
                    self.blocks.truncate(seq.seq_id, len(seq.tokens))
                self.blocks.commit(seq.seq_id, seq.cache_keys(), seq.num_computed)
        return got

    @staticmethod
    def _each_token(res: SampleResult):
        """A result's tokens, one SampleResult each (a verified draft answers several)."""
        if not res.more:
            yield res
            return
        yield SampleResult(res.token, res.logprob, res.top)
        for token, logprob, top in res.more:
            yield SampleResult(token, logprob, top)

    def _append(self, seq: Sequence, res: SampleResult, got: list) -> bool:
        """One sampled token onto `seq` (with its length / EOS / grammar checks); False once the
        sequence is finished (the tokens after that are dropped)."""
        token = res.token
        if seq.guide is not None and not seq.guide.accept(token):
            # The sampler masks what the grammar disallows; only a bug gets here.
            seq.finish_reason = Finish.FAILED
            got.append((seq, SampleResult(error=(500, f"guided decoding: the grammar rejected "
                                                      f"sampled token {token}"))))
            return False
        seq.tokens.append(token)
        seq.cum_logprob += res.logprob
        # The aging bound guaranteed progress; past a token a priority preemption may take it again
        # (each round it gets in by aging, it gains a token: it is slowed, never starved).
        seq.aged_in = False
        got.append((seq, res))
        if seq.num_output == 1 and seq.sample_index == 0 and self.policy.fork_samples:
            self._fork_waiting(seq)
        p = seq.params
        if token in self.policy.eos_token_ids and not p.ignore_eos:
            seq.finish_reason = Finish.EOS
        elif p.eos_after is not None and seq.num_output >= p.eos_after:
            seq.finish_reason = Finish.EOS
        elif seq.num_output >= p.max_new_tokens or len(seq.tokens) >= self.policy.max_model_len:
            seq.finish_reason = Finish.LENGTH
        elif seq.guide is not None and seq.guide.is_terminated():   # its stop token, under ignore_eos
            seq.finish_reason = Finish.EOS
        return not seq.finished

    # ---- observability
    def kv_usage(self) -> dict:
        # Written slots per physical block, so that a shared prefix block counts once.
        # /metrics calls this from an HTTP thread: read snapshots (list()/dict() copy atomically).
        bs, filled = self.blocks.block_size, {}
        running, tables = list(self.running), dict(self.blocks.tables)
        for s in running:
            for i, b in enumerate(tables.get(s.seq_id, ())[:-(-s.num_computed // bs)]):
                filled[b] = max(filled.get(b, 0), min(bs, s.num_computed - i * bs))
        stored = sum(filled.values())
        allocated = self.blocks.allocated_tokens(tables)
        return {"kv_tokens_stored": stored, "kv_tokens_allocated": allocated,
                "kv_tokens_total": self.blocks.num_blocks * self.blocks.block_size,
                "kv_utilization": stored / allocated if allocated else 0.0}
