"""The model runner: the only tensor code. Packed forward over the paged KV pool + sampling.

Every strategy runs through `step(items)`: the tokens of all scheduled sequences are packed
into one row ([1, T], no padding), positions and KV slots come from each item, attention goes
through `handler.model.attention` (block tables), and only the rows that sample get logits.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from handler.config import hardware, sizing
from handler.config.numerics import Numerics
from handler.model import batch_invariant, sampling
from handler.model.attention import ATTN_NAME, StepMeta  # importing it registers the attention function
from handler.model.guided import Guides
from handler.model.quant_formats import AT_LOAD           # option.quantize values the loader handles
from handler.model.quant_int4 import QuantLoadError
from handler.model.sampling import Sampler
import kernels
from kernels.backends import CpuAttention
from kernels.pool import KVPool, allocate as pool_alloc
from kernels.step import plan_step
from handler.engine.types import SampleResult, StepItem

log = logging.getLogger("lmi.runner")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    pass


def pick_device(device: str) -> torch.device:
    """option.device -> torch.device (the rule: handler.config.sizing.resolve_device)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("option.device=cuda but no CUDA device is visible")
    return torch.device(hardware.pick_device(device))


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """option.dtype on `device` -> torch.dtype (the rule: handler.config.sizing.resolve_dtype)."""
    return DTYPES[hardware.pick_dtype(dtype, device.type)]


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
    """(layers, kv heads, head dim, max positions) from a HF config of any decoder family
    (handler.config.sizing.geometry, which `config --explain` reads too)."""
    g = sizing.geometry(config)
    return g.layers, g.kv_heads, g.head_dim, g.max_positions


# A prompt chunk after cached rows (start > 0) of at most ROWWISE_ROWS rows goes as one decode row per token
# (ModelRunner.rowwise, CPU kernels only: see pack_step); where prompts cannot take the C prompt kernel (a
# sliding window, no kernel for the dtype) also one whose rows attend to at most ROWWISE_KEYS keys in all.
ROWWISE_ROWS = 16
ROWWISE_KEYS = 16384


def pack_step(items: list[StepItem], bs: int, copies=(),
              rowwise: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, list[int]]:
    """One step as one int64 tensor (what rank 0 broadcasts to the other ranks):
    [T, S, W, R, C | ids T | positions T | KV slots T | query_start_loc S+1 | seq_lens S |
    block tables S*W | logit rows R | block copies 2C (src..., dst...)]; T tokens, S sequences,
    W table width, R logit rows, C copied blocks. Also each item's first logit row.

    `rowwise` (rows, keys): a prompt chunk of at most `rows` rows after cached rows, or whose rows attend to
    at most `keys` keys in all (n * start + n (n + 1) / 2), is packed as decode rows, as a draft is; a longer
    one keeps its sequence (the prompt kernel then reads its earlier keys from the pools). Either way the
    step keeps the shape the CPU layer stack takes in one call (decode rows, then prompts:
    kernels/step.py; `keys` is for stacks that take no prompts: their chunks otherwise run the Python
    layers, ~15 ms a step on SmolLM2's 30). Row by row, each row reads its whole context from the pool;
    as a sequence the keys are packed once for all rows' GEMMs: one layer's attention of n rows after c
    cached ones, row by row against as a sequence, 0.3-0.5x the time at n = 2, ~1x at n = 16, 1.2-1.9x
    at n = 32-128, for c from 64 to 4096 (benchmarks/results/prefix-chunks/crossover.log). The rows,
    their ids, positions and slots are the same either way."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    rows: list[int] = []        # logits kept: each sampling item's last position, and every
    first_row: list[int] = []   # position of an item that wants prompt log-probs or verifies a draft
    seq_tables: list[list[int]] = []
    for it in items:
        n, start, table = len(it.token_ids), it.start_pos, it.block_table
        ids.extend(it.token_ids)
        pos.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        first_row.append(len(rows))
        if as_rows(it, rowwise):
            # A draft's k+1 rows (or a short chunk's n) go as decode rows over the same block table,
            # row j with context start+j+1: each layer writes every row's KV before any row attends
            # (the C decode kernel, the torch math and Triton alike), so row j sees rows < j, causally,
            # and the step stays a decode step (kernels/cpu_layer.c's one-call stack).
            for j in range(n):
                qsl.append(qsl[-1] + 1)
                seq_lens.append(start + j + 1)
                seq_tables.append(table)
            if it.draft or it.prompt_logprobs:
                rows.extend(range(qsl[-1] - n, qsl[-1]))
            elif it.sample:
                rows.append(qsl[-1] - 1)
            continue
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        seq_tables.append(table)
        if it.prompt_logprobs:
            rows.extend(range(qsl[-2], qsl[-1]))
        elif it.sample:
            rows.append(qsl[-1] - 1)
    if not rows:    # nothing samples (prompt chunks only): the forward still returns one row
        rows.append(len(ids) - 1)
    width = max(-(-s // bs) for s in seq_lens)
    tables: list[int] = []
    for table in seq_tables:
        t = table[:width]
        tables.extend(t)
        tables.extend([0] * (width - len(t)))
    packed = torch.tensor([len(ids), len(seq_lens), width, len(rows), len(copies), *ids, *pos, *slots,
                           *qsl, *seq_lens, *tables, *rows, *(a for a, _ in copies),
                           *(b for _, b in copies)], dtype=torch.int64)
    return packed, first_row


def as_rows(it: StepItem, rowwise: tuple[int, int]) -> bool:
    """Whether pack_step packs `it` as one decode row per token: a draft's rows, or a prompt chunk after
    cached rows within `rowwise` (rows, keys: pack_step's)."""
    n, start = len(it.token_ids), it.start_pos
    return it.draft or (n > 1 and start > 0 and (n <= rowwise[0] or n * start + n * (n + 1) // 2 <= rowwise[1]))


def stack_order(items: list[StepItem], rowwise: tuple[int, int] = (0, 0)) -> list[int] | None:
    """The items' order with prompts and prompt chunks (several rows packed as one sequence: not
    `as_rows`) after every other item, where one comes before another item (None: already so). A step of
    decode rows then prompts is the CPU layer stack's shape (kernels/step.py); each row's values do not
    depend on where its sequence sits in the step, so the runner may pack them so (under priority
    scheduling a better class's new prompt ranks before worse classes' decode rows; a recomputed
    sequence before younger ones; a prompt's next chunk before the decode rows)."""
    whole = [len(it.token_ids) > 1 and not as_rows(it, rowwise) for it in items]
    first = next((i for i, w in enumerate(whole) if w), None)
    if first is None or all(whole[first:]):
        return None
    return [i for i, w in enumerate(whole) if not w] + [i for i, w in enumerate(whole) if w]


def _windowed(model) -> bool:
    """Whether a layer of `model` has a sliding window or an attention logit soft-cap."""
    arch = getattr(model, "arch", None)
    if arch is not None:
        return any(w is not None for w in arch.windows)
    cfg = model.config.get_text_config()
    return bool(getattr(cfg, "sliding_window", None) or getattr(cfg, "attn_logit_softcapping", None))


class ModelRunner:
    batch_invariant = False   # option.batch_invariant: see handler/model/batch_invariant.py
    graphs = None             # handler.model.cuda_graphs.DecodeGraphs once capture_cuda_graphs() ran
    # Speculative decoding's draft model (handler.model.spec_draft.DraftProposer, an engine Proposer)
    # when option.speculative_config's method is draft_model: handler.server.build_draft sets it, the
    # Engine asks it between steps.
    draft_proposer = None
    # A vision-language model's image side (handler/model/vision.py): the encoder stage and its cache,
    # and the processor HTTP threads call (the engine's MediaProcessor); None for a text-only model.
    vision = None
    media = None

    def __init__(self, model_dir: str, *, dtype: str = "auto", device: str = "auto",
                 block_size: int = 16, kv_cache_tokens: int | None = None,
                 max_running: int = 32, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, trust_remote_code: bool = False,
                 model_impl: str = "auto", quantize: str | None = None, ranks=None, fuse: bool = True,
                 cpu_kernels: str = "auto", kv_cache_dtype: str = "auto", numerics: dict | None = None,
                 arms=None, encoder_cache_mb: float = 256.0):
        """`ranks` (handler.model.distributed.Ranks): this process is one of N tensor-parallel ranks;
        the model is sharded (ours by its parallel layers, transformers' by its plan) and the KV
        pool holds this rank's heads. `model_impl` (option.model_impl): auto (ours for the Llama
        family, handler/model/llama.py; transformers' for the rest), lmi (ours or a load error),
        transformers. `quantize` (option.quantize): the linear layers quantized at load
        (handler/model/quant.py). `fuse`: our model's q/k/v and gate/up each as one layer on CPU
        (LlamaFamilyForCausalLM.fuse_projections); False where LoRA will wrap the layers. `cpu_kernels`
        (option.cpu_kernels): the instruction set of the CPU kernels (kernels/isa.py), chosen before the
        model loads (its linear layers are packed for that backend). `kv_cache_dtype`
        (option.kv_cache_dtype): `auto` (the model's dtype) or `int8` on CPU (kernels/pool.py:
        int8 rows and a scale per (token, head) row). `arms` (handler.model.cpu.Arms): the CPU paths'
        A/B arms for benchmarks and tests; None: the defaults every server runs. `encoder_cache_mb`
        (option.encoder_cache_mb): a vision-language model's cache of image embeddings."""
        from transformers import AutoConfig, AutoTokenizer

        from handler.model.cpu import DEFAULT as DEFAULT_ARMS
        self.arms = arms if arms is not None else DEFAULT_ARMS
        self.ranks = ranks
        self.encoder_cache_mb, self.trust_remote_code = encoder_cache_mb, trust_remote_code
        self.quantize = quantize
        self.numerics = Numerics(**(numerics or {}))
        self.device = ranks.device if ranks is not None else pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        why = sizing.kv_cache_dtype_refusal(kv_cache_dtype, self.device.type)
        if why:
            raise ModelLoadError(f"option.kv_cache_dtype={kv_cache_dtype} {why}")
        self.kv_cache_dtype = kv_cache_dtype
        if self.device.type == "cpu":
            self._select_cpu_kernels(cpu_kernels)
        self.attention = kernels.backend_for(self.device)   # every layer's attention (kernels/backends.py)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            if self.device.type == "cpu":   # an MoE model that cannot fit: refused before its weights load
                why = sizing.moe_refusal(config, self.dtype.itemsize, hardware.cpu_available_memory())
                if why:
                    raise ModelLoadError(why)
            self.model = self._own_model(model_dir, config, model_impl, max_model_len)
            if self.model is None:
                self.model = self._transformers_model(model_dir, trust_remote_code)
        except ModelLoadError:
            raise
        except QuantLoadError as e:     # a quantized checkpoint we cannot serve: its own line
            raise ModelLoadError(str(e)) from None
        except Exception as e:  # one clear line for the operator; details in the debug log
            log.debug("model load failed", exc_info=True)
            raise ModelLoadError(f"cannot load the model from {model_dir}: {type(e).__name__}: {e}") from None
        # The step's row bookkeeping (kernels/step.py) is built once per step where a layer reads it:
        # the CPU backends' every layer; on CUDA the layers with windows or soft-caps (kernels/torch_paged.py's).
        self.plan_steps = self.attention.needs_plan or _windowed(self.model)
        log.info("attention: %s", self.attention.describe())
        layers, kv_heads, head_dim, max_pos = model_geometry(self.model.config)
        tp = ranks.world_size if ranks is not None else 1
        kv_heads //= tp      # this rank's KV heads (config checked that the degree divides them)
        self.max_model_len = min(max_model_len or max_pos, max_pos)
        self.block_size = block_size
        if kv_cache_tokens is None:
            # Room for every running sequence at full length (CPU: within the memory available).
            kv_cache_tokens = self._default_kv_tokens(layers, kv_heads, head_dim,
                                                      max_running * self.max_model_len,
                                                      gpu_memory_utilization)
        num_blocks = -(-kv_cache_tokens // block_size)
        if ranks is not None:   # every rank's pool the same size (also: every rank has loaded)
            num_blocks = ranks.min_across(num_blocks)
        self.kv = KVLayout(layers, kv_heads, head_dim, num_blocks, block_size)
        self.kv_cache = [(self._kv_pool(), self._kv_pool()) for _ in range(layers)]
        if kv_cache_dtype == "int8" and fuse:    # (fuse is False where LoRA will wrap q/k: their deltas are not rescaled)
            n = self._rescale_keys(kv_heads, head_dim)
            if n:
                log.info("int8 KV: keys' bias channels rescaled in %d layers (queries inversely; q.k unchanged)", n)
        on_the_fly = quantize if quantize and quantize not in AT_LOAD else None  # awq/gptq/gguf: the loader's
        if on_the_fly:
            from handler.model import quant
            if quant.smooths(on_the_fly):
                self._smooth(on_the_fly)
        if fuse and self._fusable(on_the_fly):
            self.model.fuse_projections()
        if on_the_fly:
            from handler.model import quant
            quant.quantize_model(self.model, on_the_fly, head=quant.head_quantized(on_the_fly, self.numerics.quantize_head),
                                 numerics=self.numerics)
        self.eos_token_ids = self._eos_ids()
        self.sampler = Sampler(self.eos_token_ids)
        # Guided decoding (xgrammar; built on first use): handler.engine.types.Guides
        self.guides = Guides(self.tokenizer, self.model.config.get_text_config().vocab_size, self.eos_token_ids)
        self.lora = None        # handler.model.lora.LoraManager once enable_lora() ran
        log.info("model %s on %s/%s: %d layers, %d kv heads x %d%s; KV pool %d blocks x %d = %d tokens "
                 "(%s, %d bytes a token)",
                 type(self.model).__name__, self.device, str(self.dtype).removeprefix("torch."),
                 layers, kv_heads, head_dim,
                 f" (rank {ranks.rank} of {tp}: 1/{tp} of the heads)" if tp > 1 else "",
                 self.kv.num_blocks, block_size, self.kv.tokens,
                 "int8 + fp32 scale per token and head" if self.kv_cache_dtype == "int8"
                 else str(self.dtype).removeprefix("torch."), self._bytes_per_token(layers, kv_heads, head_dim))

    @staticmethod
    def _select_cpu_kernels(choice: str) -> None:
        """Build (or find cached) the chosen backend's kernels now, not in a request; one log line
        names it and why."""
        from kernels import cpu as cpu_ext
        try:
            isa, why = cpu_ext.select(choice)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        backend = cpu_ext.backend()
        if isa is None or backend is None:
            log.info("CPU kernels: none, PyTorch's operators serve (%s)", why if isa is None else
                     f"the {isa} build failed: see the warning above")
        else:
            log.info("CPU kernels: %s; %s", backend.describe(), why)

    def _own_model(self, model_dir: str, config, impl: str, max_model_len: int | None):
        """Our implementation of the model's family (handler/model/llama.py), or None where
        transformers serves it (another family, or option.model_impl=transformers)."""
        from handler.model import llama, vision
        self.own = False
        family = vision.family_of(config)
        if family is not None:      # a vision-language model: our language model, the image side beside it
            why = ("option.model_impl=transformers" if impl == "transformers" else
                   "option.tensor_parallel_degree > 1" if self.ranks is not None else None)
            if why:
                raise ModelLoadError(f"{model_dir} is a {family.name} vision-language model, served by our own "
                                     f"language model on one rank; {why} is not supported for it")
        elif impl == "transformers":
            return self._not_ours(model_dir, "option.model_impl=transformers")
        from handler.model.layers import TensorParallel
        tp = TensorParallel(self.ranks.rank, self.ranks.world_size) if self.ranks is not None else TensorParallel()
        max_pos = sizing.geometry(config).max_positions
        try:
            model = llama.load(model_dir, config if family is None else config.get_text_config(), dtype=self.dtype,
                               device=self.device, tp=tp, max_positions=min(max_model_len or max_pos, max_pos),
                               quantize=self.quantize, numerics=self.numerics,
                               names=None if family is None else vision.text_names(family))
        except llama.Unsupported as e:
            if family is not None:
                raise ModelLoadError(f"{model_dir}: the {family.name} model's language model is outside our own "
                                     f"implementation ({e})") from None
            if impl == "lmi":
                raise ModelLoadError(f"option.model_impl=lmi: {model_dir} is outside our own implementation "
                                     f"({e}); use option.model_impl=auto or transformers") from None
            log.info("model: transformers' implementation serves it (%s)", e)
            return self._not_ours(model_dir, str(e))
        from handler.model.quant_int4 import describe
        if self.quantize in AT_LOAD:
            log.info("option.quantize=%s: %s", self.quantize, describe(model))
        from transformers import GenerationConfig
        try:
            model.generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:     # no generation_config.json
            model.generation_config = GenerationConfig.from_model_config(config)
        self.own = True
        m = model.arch.moe
        if m is not None:
            log.info("model: our MoE implementation of %s (handler/model/moe.py: %d experts, top-%d, expert width "
                     "%d%s; %d of %d layers sparse)", model.arch.family, m.experts, m.top_k, m.intermediate,
                     f", a shared expert of width {m.shared}" if m.shared else "", sum(m.sparse), len(m.sparse))
        else:
            log.info("model: our %s implementation (handler/model/llama.py)", model.arch.family)
        if family is not None:
            self.vision = vision.VisionStage(model_dir, config, family, llama._safetensors(model_dir), self.dtype,
                                             self.device, int(self.encoder_cache_mb * 1e6))
            self.media = vision.Processor(model_dir, config, family, self.trust_remote_code)
        return model

    def _not_ours(self, model_dir: str, why: str) -> None:
        """transformers serves the model: a pre-quantized checkpoint is refused there (one line);
        a GGUF file is served dequantized, as before (one log line)."""
        from handler.config.quantization import checkpoint_quant, read_quantization_config
        cq = checkpoint_quant(read_quantization_config(model_dir))
        if cq is not None:
            raise ModelLoadError(f"{cq.method.upper()} checkpoints are served by our Llama-family implementation "
                                 f"only, and this model is outside it ({why}); allowed: a Llama-family model "
                                 "with option.model_impl=auto or lmi")
        if self.quantize == "gguf":
            log.info("gguf: transformers' implementation serves this model, so its GGUF weights are served "
                     "dequantized (%s)", why)
        return None

    def _transformers_model(self, model_dir: str, trust_remote_code: bool):
        from transformers import AutoModelForCausalLM

        kw = dict(dtype=self.dtype, attn_implementation=ATTN_NAME, trust_remote_code=trust_remote_code)
        if self.ranks is not None:
            self.ranks.check_supported(model_dir, trust_remote_code)
            try:
                from transformers.distributed import DistributedConfig
                kw["distributed_config"] = DistributedConfig(tp_size=self.ranks.world_size)
            except ImportError:   # transformers < 5.18 (the GPU machines' 5.17)
                kw.update(tp_plan="auto", tp_size=self.ranks.world_size)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
        except Exception as e:
            if ATTN_NAME in str(e):
                raise ModelLoadError(
                    f"cannot serve the model in {model_dir}: its architecture does not route attention "
                    f"through transformers' AttentionInterface, which the paged KV cache needs (Llama, "
                    f"Mistral, Qwen2/3, Gemma/Gemma2, Phi/Phi3, GPT-2, GPT-NeoX and OPT do)") from None
            raise
        if self.ranks is None:
            model.to(self.device)
        return model.eval()

    def _fusable(self, quantize: str | None) -> bool:
        """Fuse our model's projections where the GEMM computes each output column on its own
        (int8, our fp32 panels), so that fusing changes no value; oneDNN's blocking depends on N
        (its sums would move by an ulp) and GPUs are left as they are."""
        if not self.own or self.device.type != "cpu":
            return False
        from handler.model.cpu import panels_wanted
        return bool(quantize) or (self.dtype == torch.float32 and panels_wanted(self.arms))

    def _smooth(self, method: str) -> None:
        """option.quantize (handler/model/quant.py): our models are smoothed on the calibration
        text before their linear layers are quantized (one prefill through the pool's first
        blocks, which no sequence holds yet)."""
        from handler.model import quant
        if self.own:
            ids = self.tokenizer(quant.CALIBRATION, add_special_tokens=False)["input_ids"]
            ids = ids[: min(self.max_model_len, self.kv.tokens)]

            def calibrate():
                from handler.engine.request import SamplingParams
                table = list(range(-(-len(ids) // self.block_size)))
                item = StepItem(0, ids, 0, table, True, SamplingParams(max_new_tokens=1), ids)
                self._forward(pack_step([item], self.block_size)[0])
            n = quant.smooth(self.model, calibrate, head=quant.head_quantized(method, self.numerics.quantize_head))
            log.info("%s: %d layer groups smoothed on %d calibration tokens (SmoothQuant, alpha %.2f)",
                     method, n, len(ids), quant.SMOOTH_ALPHA)

    def _kv_pool(self) -> KVPool:
        """One layer's keys or values (kernels/pool.py), [NB, bs, Hkv, D] to every reader. On CPU a
        view of a head-major [NB, Hkv, bs, D] allocation, so that the attention's gather of a batch's
        blocks is one copy into the [B, Hkv, L, D] it multiplies (kernels/torch_paged.py); the Triton
        kernels read strides and take either. On CPU the memory is anonymous zero pages (mmap),
        committed as blocks are first written: the pool is sized from the memory available
        (handler.config.sizing), and a server that never fills it does not hold it. An int8 pool
        (CPU only: refused elsewhere) carries its row scales, laid out alike."""
        shape = (self.kv.num_blocks, self.kv.block_size, self.kv.num_kv_heads, self.kv.head_dim)
        from handler.model.cpu import head_major_kv
        dtype = torch.int8 if self.kv_cache_dtype == "int8" else self.dtype
        cpu = self.device.type == "cpu"
        return pool_alloc(shape, dtype, head_major=cpu and head_major_kv(self.arms), device=self.device, lazy=cpu)

    KEY_BIAS_LEVEL = 2.0    # a key channel pair whose bias is above this is divided down to it (int8 KV)

    @torch.no_grad()
    def _rescale_keys(self, kv_heads: int, head_dim: int) -> int:
        """For an int8 KV cache: where k_proj has a bias (Qwen2), the bias dominates a few key
        channels, so one scale per (token, head) row leaves the other channels few steps. Each
        rotary channel pair (c, c + D/2) of KV head h whose bias magnitude m is above
        KEY_BIAS_LEVEL gets its key rows (weight and bias) divided by s = m / KEY_BIAS_LEVEL and
        the matching query rows of the heads that read it multiplied by s: rotary turns a pair as a
        whole, so q.k is unchanged (up to rounding) while the stored keys lose the outliers. Only
        plain float q/k projections without q/k norms (the transform would not commute with
        those); returns how many layers changed."""
        from torch import nn
        done = 0
        for layer in getattr(getattr(self.model, "model", None), "layers", []):
            att = getattr(layer, "self_attn", None)
            q, k = getattr(att, "q_proj", None), getattr(att, "k_proj", None)
            if (type(q) is not nn.Linear or type(k) is not nn.Linear or k.bias is None
                    or getattr(att, "qk_norm", None) or getattr(att, "q_norm", None) is not None
                    or not k.weight.is_floating_point() or k.out_features != kv_heads * head_dim
                    or q.out_features % k.out_features):
                continue
            half = head_dim // 2
            b = k.bias.detach().float().view(kv_heads, head_dim)
            m = torch.sqrt(b[:, :half] ** 2 + b[:, half:] ** 2)
            s = torch.clamp(m / self.KEY_BIAS_LEVEL, min=1.0)
            s = torch.cat([s, s], -1)                                     # [Hkv, D]
            if bool((s == 1).all()):
                continue
            g = q.out_features // k.out_features
            sq = s.repeat_interleave(g, 0).reshape(-1)                    # query head j reads KV head j // g
            sk = s.reshape(-1)
            for lin, f in ((k, 1 / sk), (q, sq)):
                lin.weight.mul_(f.to(lin.weight.dtype)[:, None])
                if lin.bias is not None:
                    lin.bias.mul_(f.to(lin.bias.dtype))
            done += 1
        return done

    def _bytes_per_token(self, layers, kv_heads, head_dim) -> int:
        return sizing.bytes_per_token(layers, kv_heads, head_dim, self.dtype.itemsize, self.kv_cache_dtype)

    def _default_kv_tokens(self, layers, kv_heads, head_dim, wanted, utilization) -> int:
        """handler.config.sizing.default_kv_tokens: on a GPU the rest of `utilization` after the
        weights (and other processes), less 1 GiB for activations; on a CPU a share of the memory
        still available (cgroup limit, else MemAvailable) now that the weights are loaded; no
        more than every running sequence at full length (`wanted`) can use."""
        per_token = self._bytes_per_token(layers, kv_heads, head_dim)
        if self.device.type == "cuda":
            free, total = hardware.cuda_memory(self.device)
            return sizing.default_kv_tokens(per_token, wanted, self.block_size, "cuda", utilization,
                                            total, used=total - free)
        return sizing.default_kv_tokens(per_token, wanted, self.block_size, "cpu",
                                        available=hardware.cpu_available_memory())

    def _eos_ids(self) -> frozenset:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            v = getattr(src, "eos_token_id", None)
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return frozenset(ids)

    def enable_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        """Wrap the model's linear layers for per-row LoRA updates; returns the LoraManager."""
        from handler.model.lora import LoraManager
        if any(getattr(m, "qkv_proj", None) is not None for m in self.model.modules()):
            raise ModelLoadError("LoRA needs the checkpoint's q/k/v and gate/up layers: build the runner with "
                                 "fuse=False (handler/server.py does when option.enable_lora is set)")
        arch = getattr(self.model, "arch", None)
        if getattr(arch, "moe", None) is not None:
            raise ModelLoadError(f"option.enable_lora is not supported for mixture-of-experts models ({arch.family}: "
                                 "adapters are not applied to experts); leave it unset")
        if self.ranks is not None:
            raise ModelLoadError("option.enable_lora is not supported with option.tensor_parallel_degree "
                                 "> 1 (adapters are not sharded across ranks); use degree 1")
        self.lora = LoraManager(self.model, max_loras, max_lora_rank, max_cpu_loras)
        return self.lora

    def prepack_cpu(self, keep_weights: bool = False) -> None:
        """On CPU: the linear layers' weights in the panel kernel's or oneDNN's packed layout
        (handler/model/cpu.py). keep_weights: LoRA reads the original weights. Our model's
        ranks each pack their own shards; transformers' tensor-parallel shards (DTensors) stay."""
        if self.device.type != "cpu" or (self.ranks is not None and not self.own):
            return
        from handler.model.cpu import Bf16PanelPack, PanelPack, prepack_by_rule
        from handler.model.linear import packs
        n, mode, why = prepack_by_rule(self.model, self.dtype, keep_weights, self.arms)
        if why is not None:
            log.info("CPU: bf16 linear layers multiply in %s (%s)", {
                "fp32": "fp32 over the same bf16 values",
                "panels": "bf16 by kernels/cpu_gemm_bf16.c (vdpbf16ps panels)",
                "bf16": "bf16"}[mode], why)
        kinds = {type(p) for p in packs(self.model)}
        gemm = ("kernels/cpu_gemm_bf16.c" if Bf16PanelPack in kinds else
                "kernels/cpu_gemm.c" if PanelPack in kinds else "oneDNN")
        log.info("CPU: %d linear layers packed for %s", n, gemm)
        from handler.model.cpu import hugepage_report
        log.info("CPU: %s", hugepage_report(self.model))
        if self.own:
            self._bind_experts()
        if self.own and self.ranks is None:
            from handler.model import cpu_stack
            self.model.decode_stack, why = cpu_stack.build(self.model, self.kv_cache, lora=self.lora is not None,
                                                               arms=self.arms)
            stack = self.model.decode_stack
            # Decided here, once: a step whose plan has the stack's shape runs it whole; the log says
            # why not, per layer where a layer is the reason.
            took = ", prompts and chunks" if stack is not None and stack.prompts else ""
            log.info("CPU: a step's layers %s", f"in one C call (kernels/cpu_layer.c; decode rows{took})"
                     if stack is not None else f"in Python ({why})")
            for note in stack.notes if stack is not None else ():
                log.info("CPU: layer stack: %s", note)

    def _bind_experts(self) -> None:
        """Our MoE layers' experts, once packed: one C call per layer and step (kernels/cpu_layer.c
        lmi_moe_experts) or the Python loop over experts; decided here and logged once."""
        from handler.model import moe
        sparse = [m for m in self.model.modules() if isinstance(m, moe.SparseMoe)]
        if not sparse:
            return
        why = "the moe_kernel=0 arm (handler/model/cpu.py Arms)" if not self.arms.moe_kernel else None
        for i, m in enumerate(sparse):
            got = m.bind_kernel() if why is None else None
            if got:
                why = f"sparse layer {i}: {got}"
        if why is not None:
            for m in sparse:    # one path for every layer
                m.cpu_experts = m.cpu_router = m.cpu_shared_gate = None
        log.info("CPU: mixture-of-experts layers: %s", "each step's rows through the experts in one C call a layer "
                 "(kernels/cpu_layer.c lmi_moe_experts)" if why is None else f"experts one by one in Python ({why})")

    def capture_cuda_graphs(self, max_batch: int) -> None:
        """option.enforce_eager=false: capture the decode step for every batch size up to
        `max_batch` (handler/model/cuda_graphs.py). Call after LoRA is set up. Where the model
        cannot be captured (CPU, transformers' model, LoRA, ...) it says why on CUDA and decode
        stays eager; a failed capture does too."""
        import time
        from handler.model import cuda_graphs
        why = cuda_graphs.eligible(self.model, self.device, own=self.own, tp=self.ranks is not None,
                                   lora=self.lora is not None)
        if why is not None:
            if self.device.type == "cuda":
                log.info("CUDA graphs off: %s; decode steps run eagerly", why)
            return
        t0 = time.perf_counter()
        graphs = cuda_graphs.DecodeGraphs(self.model, self.kv_cache, max_batch,
                                          cuda_graphs.table_width(self.max_model_len, self.block_size),
                                          self.device, self.model.lm_head.out_features)
        try:
            graphs.capture()
        except Exception as e:   # eager decode still serves; the operator sees why
            log.warning("CUDA graphs: capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
            return
        self.graphs = graphs
        log.info("CUDA graphs: decode captured for %d batch sizes up to %d (contexts up to %d tokens) in %.1f s",
                 len(graphs.sizes), graphs.B, graphs.W * self.block_size, time.perf_counter() - t0)

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)

    def _verify(self, logits: torch.Tensor, it: StepItem) -> SampleResult:
        """A draft's accepted tokens and the runner's own next one; a failure fails this item alone."""
        from handler.model import spec_verify
        try:
            return spec_verify.verify(self.sampler, logits, it)
        except Exception as e:
            log.warning("verifying the draft of sequence %d failed", it.seq_id, exc_info=True)
            return SampleResult(error=(424, f"speculative verification failed: {type(e).__name__}: {e}"))

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for k_pool, v_pool in self.kv_cache:
            k_pool.copy_blocks(src, dst)
            v_pool.copy_blocks(src, dst)

    @torch.inference_mode()
    def forward(self, packed: torch.Tensor, inject=None, mrope=None, blocks=None) -> torch.Tensor:
        """One packed step (every rank runs it): block copies, then the forward; logits [R, V]
        (R >= 1: pack_step keeps the last token's row when nothing samples). In a tensor-parallel group a failure here breaks
        the group."""
        try:
            return self._forward(packed, inject, mrope, blocks)
        except Exception as e:
            if self.ranks is not None:
                self.ranks.fail(f"rank {self.ranks.rank}: forward failed: {type(e).__name__}: {e}")
            raise

    def _forward(self, packed: torch.Tensor, inject=None, mrope=None, blocks=None) -> torch.Tensor:
        """`inject`: a VLM step's image embeddings, (rows, features) (VisionStage.inject); `mrope`: its
        M-RoPE positions [3, T] when it feeds image tokens (_mrope); `blocks`: positions attending both
        ways (a bidirectional family's image runs: vision.blocks, kernels.step.Step.blocks)."""
        n_tok, n_seq, width, n_rows, n_copies = packed[:5].tolist()
        sizes = [n_tok, n_tok, n_tok, n_seq + 1, n_seq, n_seq * width, n_rows, n_copies, n_copies]
        host = packed[5:].split(sizes)
        if (self.graphs is not None and n_tok == n_seq == n_rows and not self.batch_invariant and inject is None
                and mrope is None and blocks is None
                and self.graphs.fits(n_seq, width)):
            # Decode only (one token and one logit row per sequence): replay a captured graph.
            if n_copies:
                self._copy_blocks(host[7].to(self.device), host[8].to(self.device))
            return self.graphs.run(host[0], host[1], host[2], host[4], host[5].view(n_seq, width))
        qsl_cpu, seq_lens_cpu = host[3].tolist(), host[4].tolist()
        # One host-to-device copy for the whole step (on CPU `packed` itself).
        ids, pos, slots, qsl, seq_lens, tables, keep, src, dst = \
            packed.to(self.device, non_blocking=True)[5:].split(sizes)
        if n_copies:
            self._copy_blocks(src, dst)
        block_tables = tables.view(n_seq, width)
        meta = StepMeta(
            kv_cache=self.kv_cache, backend=self.attention,
            slot_mapping=slots,
            block_tables=block_tables.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32),
            seq_lens_cpu=seq_lens_cpu, query_start_loc_cpu=qsl_cpu, blocks=blocks,
            plan=plan_step(block_tables, seq_lens, qsl, self.block_size, slot_mapping=slots,
                           seq_lens_cpu=seq_lens_cpu, query_start_loc_cpu=qsl_cpu) if self.plan_steps else None)
        if self.own:
            if inject is not None or mrope is not None:
                return self.model.step(ids, pos, keep, meta, inject, mrope)
            return self.model.step(ids, pos, keep, meta)
        out = self.model(input_ids=ids[None], position_ids=pos[None],
                         use_cache=False, logits_to_keep=keep, lmi_step=meta)
        return out.logits[0]

    def _mrope(self, packed: torch.Tensor, items: list[StepItem]) -> torch.Tensor | None:
        """An M-RoPE model (Qwen2-VL): the step's positions [3, T] when it feeds image tokens (None
        otherwise); every other row's one position (index + what the images before took) is written
        into `packed`, so decode steps stay 1-D (and CUDA graphs replay them)."""
        if not self.vision.family.mrope:
            return None
        from handler.model.vision import positions
        pos3 = positions(items, [len(it.token_ids) for it in items])
        if pos3 is None:
            return None
        t = int(packed[0])
        packed[5 + t:5 + 2 * t] = pos3[0]
        return pos3.to(self.device) if bool((pos3[0] != pos3[1]).any() or (pos3[0] != pos3[2]).any()) else None

    # ---- one step
    def step(self, items: list[StepItem], copies: list[tuple[int, int]] = ()) -> list[SampleResult]:
        """Copy the listed KV blocks (copy-on-write of forked samples), run the items; returns
        one SampleResult per item. One packed forward, or with option.batch_invariant one
        forward per token of each sequence (handler/model/batch_invariant.py)."""
        if self.batch_invariant:
            return batch_invariant.step(self._packed_step, items, copies)
        return self._packed_step(items, copies)

    @property
    def rowwise(self) -> tuple[int, int]:
        """pack_step's bounds for a prompt chunk packed as decode rows: (0, 0) off the CPU kernels, and for a
        VLM (its chunks keep their sequence, which image runs attending both ways are keyed by); the key
        bound only where prompts do not reach the C prompt kernel (the stack's `prompts`, or without a stack
        the kernel for the dtype and no sliding window)."""
        if not isinstance(self.attention, CpuAttention) or self.vision is not None:
            return 0, 0
        stack = getattr(self.model, "decode_stack", None)
        prompts = stack.prompts if stack is not None else self._prompt_kernel
        return ROWWISE_ROWS, 0 if prompts else ROWWISE_KEYS

    @functools.cached_property
    def _prompt_kernel(self) -> bool:
        from kernels import cpu as cpu_ext
        return cpu_ext.prefill_attention_available(self.dtype) and not _windowed(self.model)

    @torch.inference_mode()
    def _packed_step(self, items: list[StepItem], copies: list[tuple[int, int]] = ()) -> list[SampleResult]:
        rowwise = self.rowwise
        order = stack_order(items, rowwise) if rowwise[0] else None
        if order is not None:       # prompts and chunks last: the step keeps the C layer stack's shape
            got = self._packed_step([items[i] for i in order], copies)
            back: list = [None] * len(items)
            for j, i in enumerate(order):
                back[i] = got[j]
            return back
        packed, first_row = pack_step(items, self.block_size, copies, rowwise)
        if self.ranks is not None:   # the other ranks run the same copies + forward on their shards
            self.ranks.send_step(packed)
        # a VLM: the images these items feed, encoded (or from the encoder cache) before the prefill
        inject = mrope = blocks = None
        if self.vision is not None:
            inject = self.vision.inject(items)
            mrope = self._mrope(packed, items)
            if self.vision.family.bidirectional:     # image runs attending both ways at prefill (Gemma 3)
                from handler.model.vision import blocks as image_blocks
                blocks = image_blocks(items)
        if self.lora is not None:       # each adapter's rows get their low-rank update
            from handler.model.lora import step_context
            with step_context(self.lora.step(items)):
                logits = self.forward(packed, inject, mrope, blocks)
        else:
            logits = self.forward(packed, inject, mrope, blocks)   # [len(rows), V]
        results = [SampleResult() for _ in items]
        sample_rows, sample_items, where = [], [], []
        for k, it in enumerate(items):
            r = first_row[k]
            if it.draft:    # speculative decoding: the draft's k+1 rows (handler/model/spec_verify.py)
                results[k] = self._verify(logits[r:r + len(it.token_ids)].float(), it)
                continue
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
