"""A step's row bookkeeping: built once per step (handler/model/runner.py) and read by every layer.

A packed step holds S sequences; sequence s owns query rows qsl[s] .. qsl[s+1]-1 at positions
lens[s]-n_s .. lens[s]-1 of its context. The layers' attention needs the same facts each time:
which sequences decode one row, their block tables cut to the longest and their lengths (the
decode kernel's int32 inputs), which prompts are whole (their context is this step's rows), the
KV slots as int64, and whether the step has the one-call layer stack's shape (decode rows first,
then prompts or prompt chunks, a chunk's earlier keys read from the pools through its block table).
`plan_step` works them out from the host-side lists, once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class Step:
    """A step's inputs to the layers' attention (the runner's StepMeta adds the pools and the backend)."""
    slot_mapping: torch.Tensor | None       # [T] int64
    block_tables: torch.Tensor              # [S, max_blocks] int32
    seq_lens: torch.Tensor                  # [S] int32: context length incl. this step's tokens
    query_start_loc: torch.Tensor           # [S+1] int32
    seq_lens_cpu: list[int] | None = None
    query_start_loc_cpu: list[int] | None = None
    plan: StepPlan | None = None            # plan_step's, built once per step
    # Sequence index -> [(first, end)] context positions whose rows attend to each other both ways (on
    # top of causal; Gemma 3's image runs at prefill: handler/model/vision.py), each run in this step's rows
    # or before them; None: causal only.
    blocks: dict[int, list[tuple[int, int]]] | None = None


@dataclass(frozen=True)
class StepPlan:
    lens: list[int]                     # [S] context length incl. this step's rows
    qsl: list[int]                      # [S+1] row offsets
    tables: torch.Tensor                # [S, W] int64 block tables
    slots: torch.Tensor | None          # [T] int64 KV slots (< 0: not written; None: not given)
    dec: list[int]                      # sequences feeding one row (decode rows), in order
    all_decode: bool                    # every sequence one row: T == S, row s is sequence s
    dec_rows: torch.Tensor | None       # [B] int64 their rows (None without decode rows)
    dec_tables: torch.Tensor | None     # [B, W'] int32 their tables, cut to the longest context
    dec_lens: torch.Tensor | None       # [B] int32 their context lengths
    chunks: list[int]                   # sequences feeding several rows
    whole: list[int]                    # ... of them, those whose whole context is this step's rows
    partial: list[int]                  # ... the others (a chunk after cached or earlier rows)
    prompts: torch.Tensor | None        # [3, P] int64 (first rows, lengths, order costliest first) of the
                                        # prompts and chunks when the step is decode rows then those only
                                        # (the layer stack's shape: then P are `chunks`); None for any other step
    prompt_ctx: torch.Tensor | None = None      # [C] int64 positions before each of `chunks`' rows (None: all whole)
    prompt_tables: torch.Tensor | None = None   # [C, W] int32 their block tables (with prompt_ctx)

    @property
    def stack_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' tables and lengths as the layer stack takes them (empty without any)."""
        return (self.dec_tables, self.dec_lens) if self.dec else (_NO_TABLES, _NO_LENS)


_NO_TABLES, _NO_LENS = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)


def _as_list(x, cpu_list) -> list[int]:
    if cpu_list is not None:
        return [int(v) for v in cpu_list]
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


def prompt_table(starts: list[int], lens: list[int], before: list[int] | None = None) -> torch.Tensor:
    """Prompts as the prompt-attention kernel and the layer stack take them: int64 [3, P] of first
    rows, lengths, and their order costliest first (the largest start first on the pool): a prompt's
    rows times the keys they read, `before` (positions before each one's rows) included."""
    b = before or [0] * len(lens)
    order = sorted(range(len(lens)), key=lambda i: -lens[i] * (2 * b[i] + lens[i]))
    return torch.tensor([list(starts), list(lens), order], dtype=torch.int64).view(3, len(lens))


def plan_step(block_tables, seq_lens, query_start_loc, block_size: int, *, slot_mapping=None,
              rows: int | None = None, seq_lens_cpu: list[int] | None = None,
              query_start_loc_cpu: list[int] | None = None, device=None) -> StepPlan:
    """The StepPlan of one step of `rows` query rows (default: one per slot, else the last row
    offset). `seq_lens_cpu` / `query_start_loc_cpu` (host lists, optional) spare reading the
    tensors back; `block_size` is the pools'; `slot_mapping` (optional) the step's KV slots.
    ValueError where a sequence's rows do not fit its context."""
    lens = _as_list(seq_lens, seq_lens_cpu)
    qsl = _as_list(query_start_loc, query_start_loc_cpu)
    if device is None:
        device = next((x.device for x in (slot_mapping, block_tables) if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
    tables = block_tables.to(device=device, dtype=torch.long) if isinstance(block_tables, torch.Tensor) \
        else torch.tensor(block_tables, dtype=torch.long, device=device)
    slots = None
    if slot_mapping is not None:
        slots = slot_mapping.to(device=device, dtype=torch.int64).contiguous() \
            if isinstance(slot_mapping, torch.Tensor) else torch.tensor(slot_mapping, dtype=torch.int64, device=device)
    t = rows if rows is not None else slots.shape[0] if slots is not None else (qsl[-1] if qsl else 0)
    nq = [qsl[s + 1] - qsl[s] for s in range(len(lens))]
    for s, (n, ctx) in enumerate(zip(nq, lens)):
        if not 0 <= n <= ctx:
            raise ValueError(f"sequence {s}: {n} query rows do not fit its context length {ctx}")
    dec = [s for s in range(len(lens)) if nq[s] == 1]
    chunks = [s for s in range(len(lens)) if nq[s] > 1]
    whole = [s for s in chunks if nq[s] == lens[s]]
    partial = [s for s in chunks if nq[s] != lens[s]]
    dec_rows = dec_tables = dec_lens = None
    if dec:
        nblk = -(-max(lens[s] for s in dec) // block_size)
        dec_rows = torch.tensor([qsl[s] for s in dec], device=device)
        dec_tables = tables[torch.tensor(dec, device=device), :nblk].to(torch.int32).contiguous()
        dec_lens = torch.tensor([lens[s] for s in dec], dtype=torch.int32, device=device)
    # the chunks' earlier positions, read from the pools by the prompt kernel, and their tables: once a step
    before = [lens[s] - nq[s] for s in chunks]
    prompt_ctx = prompt_tables = None
    if any(before):
        prompt_ctx = torch.tensor(before, dtype=torch.int64)
        prompt_tables = tables[chunks, :-(-max(lens[s] for s in chunks) // block_size)].to(torch.int32).contiguous()
    prompts = None
    b = len(dec)
    if lens and qsl[0] == 0 and qsl[-1] == t and dec == list(range(b)) and all(n >= 2 for n in nq[b:]):
        prompts = prompt_table(qsl[b:-1], nq[b:], before)     # its prompts are `chunks`, in order
    return StepPlan(lens=lens, qsl=qsl, tables=tables, slots=slots, dec=dec,
                    all_decode=len(dec) == len(lens) == t and bool(qsl) and qsl[0] == 0,
                    dec_rows=dec_rows, dec_tables=dec_tables, dec_lens=dec_lens, chunks=chunks, whole=whole,
                    partial=partial, prompts=prompts, prompt_ctx=prompt_ctx, prompt_tables=prompt_tables)
