"""CUDA graphs of our model's decode step (option.enforce_eager=false, the default on CUDA).

A decode step of a 7B model is ~30 layers x ~15 kernels: launched one by one from Python, the
launches (not the GPU) set the step time at small and medium batches. Here each decode batch
size the engine can run (padded up to 1, 2, 4, 8, 16, 24, ..., the running limit) is captured
once at start-up and replayed per step: one host-to-device copy of the step's inputs, one
replay.

Shape of the inputs a graph reads (one int64 buffer, copied in one go):
    [ids B | positions B | KV slots B | seq_lens B | block tables B x W]
B: the largest captured batch, W: the table width captured (max_seq_len_to_capture / block
size). Rows past the step's n are padding: slot -1 (nothing written), context length 1 (any
valid block is read, the row is thrown away). query_start_loc of a decode batch is 0..b,
fixed at capture.

Only decode-only steps (one token per sequence, every sequence sampling) whose tables fit W
replay a graph; prefill chunks, longer contexts, copies of forked blocks and everything on CPU
run eagerly. Eligible models: ours (handler/model/llama.py) on one CUDA device, plain linear
layers (no LoRA, no quantized layers), no sliding window, a rotary table that does not grow
with the sequence. `eligible` says why not, in words for the log.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from handler.model.attention import StepMeta

log = logging.getLogger("lmi.cuda_graphs")

MAX_SEQ_LEN_TO_CAPTURE = 8192   # vLLM's default: longer contexts decode eagerly


def graph_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, then every 8 up to max_batch (max_batch itself
    included), as vLLM does: a batch of n runs the smallest size >= n."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def table_width(max_model_len: int, block_size: int, cap: int = MAX_SEQ_LEN_TO_CAPTURE) -> int:
    """Block-table columns a graph reads: enough for min(max_model_len, cap) tokens."""
    return -(-min(max_model_len, cap) // block_size)


def eligible(model, device: torch.device, *, own: bool, tp: bool, lora: bool) -> str | None:
    """None when the decode step of `model` can be captured; else why not."""
    if device.type != "cuda":
        return "not on CUDA"
    if not own:
        return "transformers' implementation of the model (only ours is captured)"
    if tp:
        return "tensor parallel"
    if lora:
        return "LoRA adapters"
    if model.rotary.kind in model.rotary.GROWING:
        return f"rotary scaling {model.rotary.kind!r} grows with the sequence"
    for layer in model.model.layers:
        if layer.self_attn.window is not None:
            return "a sliding-window layer (its attention runs the reference)"
    from handler.model.layers import RMSNorm
    for name, m in model.named_modules():
        if next(m.children(), None) is None and type(m) not in (nn.Linear, nn.Embedding, RMSNorm):
            return f"layer {name} is {type(m).__name__} (only plain linear layers are captured, not quantized ones)"
    return None


class DecodeGraphs:
    """One CUDA graph per padded decode batch size over `model.step`; `run` replays one."""

    def __init__(self, model, kv_cache, max_batch: int, width: int, device: torch.device, vocab_rows: int):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.sizes = graph_sizes(max_batch)
        self.B, self.W = self.sizes[-1], width
        n = 4 * self.B + self.B * self.W
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.h_ids, self.h_pos, self.h_slots, self.h_lens, self.h_tables = self._views(self.host)
        self.h_slots.fill_(-1)      # padding rows write nothing
        self.h_lens.fill_(1)
        self.dev.copy_(self.host)
        self.qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.keep = torch.arange(B, dtype=torch.int64, device=device)
        self.logits = torch.empty(B, vocab_rows, dtype=model.lm_head.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, seq_lens [B] each, tables [B, W]) over the input buffer's layout."""
        B = self.B
        return (*(buf[i * B:(i + 1) * B] for i in range(4)), buf[4 * B:].view(B, self.W))

    def _body(self, b: int) -> None:
        ids, pos, slots, lens, tables = (v[:b] for v in self._views(self.dev))
        meta = StepMeta(kv_cache=self.kv_cache, slot_mapping=slots, block_tables=tables.to(torch.int32),
                        seq_lens=lens.to(torch.int32), query_start_loc=self.qsl[:b + 1],
                        seq_lens_cpu=None, query_start_loc_cpu=None)
        self.logits[:b].copy_(self.model.step(ids, pos, self.keep[:b], meta))

    @torch.inference_mode()
    def capture(self) -> None:
        """Run every size once eagerly (Triton compiles a variant per specialisation of the
        batch size: 1, multiples of 16, the rest; nothing may compile inside a capture), then
        capture every size, largest first so that the smaller graphs reuse its memory pool."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in self.sizes:
                self._body(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = None
        for b in reversed(self.sizes):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._body(b)
            pool = g.pool() if pool is None else pool
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)

    def fits(self, n_seq: int, width: int) -> bool:
        return n_seq <= self.B and width <= self.W

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
            tables: torch.Tensor) -> torch.Tensor:
        """Host int64 tensors of one decode step ([n] each, tables [n, w]) -> logits [n, V], a
        view of a buffer that the next replay overwrites."""
        n, w = tables.shape
        b = next(s for s in self.sizes if s >= n)
        self.h_ids[:n] = ids
        self.h_pos[:n] = pos
        self.h_slots[:n] = slots
        self.h_slots[n:b] = -1
        self.h_lens[:n] = seq_lens
        self.h_lens[n:b] = 1
        self.h_tables[:n, :w] = tables
        end = 4 * self.B + b * self.W   # rows of the table past b are never read
        self.dev[:end].copy_(self.host[:end])
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[:n]
