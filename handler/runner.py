"""The model runner: the only tensor code. Packed forward over the paged KV pool + sampling.

Every strategy runs through `step(items)`: the tokens of all scheduled sequences are packed
into one row ([1, T], no padding), positions and KV slots come from each item, attention goes
through `handler.attention` (block tables), and only the rows that sample get logits.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from . import sampling
from .attention import ATTN_NAME, StepMeta  # importing it registers the attention function
from .sampling import Sampler
from .scheduler import SampleResult, StepItem

log = logging.getLogger("lmi.runner")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    pass


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("option.device=cuda but no CUDA device is visible")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return DTYPES[dtype]


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


def model_geometry(config) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, max positions) from a HF config of any decoder family."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer")
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head")
    kv = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    max_pos = (getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
               or 2048)
    return layers, kv, head_dim, max_pos


class ModelRunner:
    def __init__(self, model_dir: str, *, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_running: int = 32, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=self.dtype, attn_implementation=ATTN_NAME,
                trust_remote_code=trust_remote_code).to(self.device).eval()
        except Exception as e:  # one clear line for the operator; details in the debug log
            log.debug("model load failed", exc_info=True)
            if ATTN_NAME in str(e):
                raise ModelLoadError(
                    f"cannot serve the model in {model_dir}: its architecture does not route attention "
                    f"through transformers' AttentionInterface, which the paged KV cache needs (Llama, "
                    f"Mistral, Qwen2/3, Gemma/Gemma2, Phi/Phi3, GPT-2, GPT-NeoX and OPT do)") from None
            raise ModelLoadError(f"cannot load the model from {model_dir}: {type(e).__name__}: {e}") from None
        layers, kv_heads, head_dim, max_pos = model_geometry(self.model.config)
        self.max_model_len = min(max_model_len or max_pos, max_pos)
        self.block_size = block_size
        if kv_cache_tokens is None:
            # Room for every running sequence at full length (CPU: within a 4 GiB budget).
            kv_cache_tokens = self._default_kv_tokens(layers, kv_heads, head_dim,
                                                      max_running * self.max_model_len,
                                                      gpu_memory_utilization)
        self.kv = KVLayout(layers, kv_heads, head_dim, -(-kv_cache_tokens // block_size), block_size)
        shape = (self.kv.num_blocks, block_size, kv_heads, head_dim)
        self.kv_cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                          torch.zeros(shape, dtype=self.dtype, device=self.device))
                         for _ in range(layers)]
        self.eos_token_ids = self._eos_ids()
        self.sampler = Sampler()
        log.info("model %s on %s/%s: %d layers, %d kv heads x %d; KV pool %d blocks x %d = %d tokens",
                 type(self.model).__name__, self.device, str(self.dtype).removeprefix("torch."),
                 layers, kv_heads, head_dim, self.kv.num_blocks, block_size, self.kv.tokens)

    def _bytes_per_token(self, layers, kv_heads, head_dim) -> int:
        return 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=self.dtype).element_size()

    def _default_kv_tokens(self, layers, kv_heads, head_dim, wanted, utilization) -> int:
        per_token = self._bytes_per_token(layers, kv_heads, head_dim)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations: the rest of `utilization` after the weights.
            budget = int(total * utilization) - (total - free) - (1 << 30)
            return max(self.block_size, budget // per_token)
        return max(self.block_size, min(wanted, (4 << 30) // per_token))

    def _eos_ids(self) -> frozenset:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return frozenset(ids)

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for k_cache, v_cache in self.kv_cache:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    # ---- one step
    @torch.inference_mode()
    def step(self, items: list[StepItem], copies: list[tuple[int, int]] = ()) -> list[SampleResult]:
        """Copy the listed KV blocks (copy-on-write of forked samples), run one packed forward;
        returns one SampleResult per item."""
        if copies:
            self._copy_blocks(copies)
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        rows: list[int] = []        # logits kept: each sampling item's last position, and every
        first_row: list[int] = []   # position of an item that wants prompt log-probs
        for it in items:
            n, start, table = len(it.token_ids), it.start_pos, it.block_table
            ids.extend(it.token_ids)
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            first_row.append(len(rows))
            if it.prompt_logprobs:
                rows.extend(range(qsl[-2], qsl[-1]))
            elif it.sample:
                rows.append(qsl[-1] - 1)
        width = max(-(-s // bs) for s in seq_lens)
        tables = [it.block_table[:width] + [0] * (width - min(width, len(it.block_table)))
                  for it in items]
        dev = self.device
        meta = StepMeta(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens_cpu=seq_lens, query_start_loc_cpu=qsl)
        keep = torch.tensor(rows or [len(ids) - 1], dtype=torch.int64, device=dev)
        out = self.model(input_ids=torch.tensor([ids], device=dev),
                         position_ids=torch.tensor([pos], device=dev),
                         use_cache=False, logits_to_keep=keep, lmi_step=meta)
        logits = out.logits[0]      # [len(rows), V]
        results = [SampleResult() for _ in items]
        sample_rows, sample_items, where = [], [], []
        for k, it in enumerate(items):
            r = first_row[k]
            if it.prompt_logprobs:
                try:
                    results[k] = SampleResult(prompt_logprobs=sampling.prompt_logprobs(
                        logits[r:r + len(it.token_ids)], it))
                except Exception as e:      # this item alone fails
                    log.warning("prompt log-probs failed for sequence %d", it.seq_id, exc_info=True)
                    results[k] = SampleResult(error=(424, f"prompt log-probs failed: {type(e).__name__}: {e}"))
                    continue
                r += len(it.token_ids) - 1
            if it.sample:
                sample_rows.append(r)
                sample_items.append(it)
                where.append(k)
        if sample_rows:
            sampled = self.sampler.sample(logits[sample_rows].float(), sample_items)
            for k, res in zip(where, sampled):
                pl = results[k].prompt_logprobs
                results[k] = dataclasses.replace(res, prompt_logprobs=pl) if pl else res
        return results
