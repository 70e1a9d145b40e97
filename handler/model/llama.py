"""Our own Llama family: one explicit forward over the engine's packed step.

Families (config.json's `model_type`) and what a flag covers:
  llama, smollm (SmolLM/SmolLM2 are llama), mistral   sliding window from config
  qwen2      q/k/v bias (read from the checkpoint), sliding window per `layer_types`
  qwen3      per-head q/k RMSNorm before rotary
  granite    embedding / attention / residual multipliers, logits divided by `logits_scaling`
  phi3       fused qkv_proj and gate_up_proj (cut into q/k/v and gate/up at load)
  olmo2      no input norms: RMSNorms after attention and MLP, q/k RMSNorm over the projections
  qwen3_moe, qwen2_moe, mixtral, olmoe   mixture-of-experts MLPs (handler/model/moe.py); qwen3_moe
             has qwen3's q/k norms, qwen2_moe qwen2's biases, olmoe q/k RMSNorm over the projections
  gemma3_text  Gemma 3 (also the language model of gemma3, handler/model/vision.py): RMSNorms times
             1 + weight in fp32, a norm before and after attention and before and after the MLP (the
             post norms on the sublayer's output, before the residual add), per-head q/k norms, a
             GELU-tanh gated MLP, embeddings times sqrt(hidden) (rounded to the dtype, as
             transformers), softmax scale query_pre_attn_scalar^-0.5, sliding-window and full layers
             by `layer_types` each with its own rope (rope_parameters per layer type: local theta,
             global theta and scaling), optional attention / final logit soft-caps
  gemma2     Gemma 3's layer without q/k norms and with one rope; attention and final logit soft-caps
Anything else (or these with `option.model_impl=transformers`) is served by transformers' own
model through the attention interface (handler/model/attention.py).

The step, shapes: ids/positions [T] (packed sequences, no padding) -> embeddings [T, E] ->
per layer: norm, q/k/v [T, H|Hkv, D], rotary, paged attention over block tables (writes this
step's K/V into the pool first), o_proj, residual; norm, MLP, residual -> final norm on the kept
rows [R, E] -> head -> logits [R, V]. Weights come straight from the checkpoint's safetensors
(sharded or not; a tied head reads the embedding); with tensor parallelism each rank loads its
cut of every weight (handler.model.layers.Shard) and holds H/N query and Hkv/N KV heads.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from handler.config.numerics import Numerics
from handler.model import layers, moe
from handler.model.layers import RMSNorm, Rotary, Shard, TensorParallel, shard

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "granite", "phi3", "olmo2", "gemma2", "gemma3_text") \
    + moe.MOE_FAMILIES
GEMMA = ("gemma2", "gemma3_text")
# Language models of vision-language models (handler/model/vision.py) that are one of ours: Qwen2-VL's and
# Qwen2.5-VL's are qwen2 with M-RoPE (positions in three sections: time, height, width).
ALIASES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2"}


class Unsupported(ValueError):
    """This checkpoint is outside what our implementation covers (str: why); transformers serves it."""


@dataclass(frozen=True)
class Arch:
    """What one family's forward does differently (read from its config)."""
    family: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float
    max_positions: int
    tied: bool
    windows: tuple          # per layer: sliding window or None
    qk_norm: str | None     # None | "head" (qwen3: per head) | "full" (olmo2: over the projection)
    post_norms: bool        # olmo2: norms after attention and MLP instead of before
    fused: bool             # phi3: qkv_proj / gate_up_proj in the checkpoint
    embed_scale: float      # granite: embedding_multiplier
    residual_scale: float   # granite: residual_multiplier
    logits_divisor: float   # granite: logits_scaling
    scaling: float          # attention's softmax scale
    moe: moe.MoeSpec | None = None      # the MoE families: experts, routing, which layers are sparse
    qk_style: str = "olmo2"             # a "full" q/k norm's rounding (olmoe: "llama")
    mrope: tuple | None = None          # M-RoPE's frequency sections (Qwen2-VL): positions [3, T]
    gemma: bool = False                 # Gemma 2/3: 1 + weight norms, four norms a layer, embeddings
                                        # times embed_scale rounded to the dtype, images injected after it
    act: str = "silu"                   # the MLP's activation (Gemma: gelu_pytorch_tanh)
    attn_softcap: float | None = None   # Gemma 2: tanh(s / cap) * cap on the attention logits
    final_softcap: float | None = None  # ... and on the output logits
    rope_types: tuple | None = None     # per layer: its key of config.rope_parameters (Gemma 3), else one rope


def arch_of(config) -> Arch:
    """The Arch of a transformers config, or Unsupported naming what is outside our family."""
    mt = getattr(config, "model_type", None)
    mrope = None
    if mt in ALIASES:
        mrope = tuple((getattr(config, "rope_parameters", None) or {}).get("mrope_section") or ()) or None
        mt = ALIASES[mt]
    if mt not in FAMILIES:
        raise Unsupported(f"model_type {mt!r} is not one of ours ({', '.join(FAMILIES)})")
    gemma = mt in GEMMA
    act = (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)) if gemma \
        else getattr(config, "hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if gemma else "silu"):
        raise Unsupported(f"hidden_act {act!r} (ours: {'gelu_pytorch_tanh' if gemma else 'silu'})")
    if gemma and getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("use_bidirectional_attention (an encoder's attention)")
    if gemma and getattr(config, "attention_bias", False):
        raise Unsupported("attention_bias")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise Unsupported("partial rotary embeddings")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("mlp_bias")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if mt == "qwen2" and not types:
        types = ["sliding_attention" if getattr(config, "use_sliding_window", False) else "full_attention"] * n
    if mt in ("llama", "granite", "olmo2", "qwen3", "olmoe") and not types:
        window = None
    windows = tuple((window if t == "sliding_attention" else None) for t in types) if types else (window,) * n
    g = mt == "granite"
    scaling = float(config.attention_multiplier) if g else head_dim ** -0.5
    rope_types = None
    if gemma:
        scaling = float(config.query_pre_attn_scalar) ** -0.5
        params = getattr(config, "rope_parameters", None) or {}
        if mt == "gemma3_text" and all(t in params for t in set(types)):
            rope_types = tuple(types)   # {"sliding_attention": {...}, "full_attention": {...}} (transformers 5)
        elif mt == "gemma3_text":
            raise Unsupported("a Gemma 3 config without rope_parameters per layer type")
    return Arch(
        family=mt, hidden=config.hidden_size, heads=heads, kv_heads=kv, head_dim=head_dim,
        intermediate=config.intermediate_size, layers=n, vocab=config.vocab_size,
        eps=float(config.rms_norm_eps), max_positions=config.max_position_embeddings,
        tied=bool(getattr(config, "tie_word_embeddings", False)), windows=windows,
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmo2": "full", "olmoe": "full",
                 "gemma3_text": "head"}.get(mt),
        post_norms=mt == "olmo2", fused=mt == "phi3",
        embed_scale=float(config.embedding_multiplier) if g else config.hidden_size ** 0.5 if gemma else 1.0,
        residual_scale=float(config.residual_multiplier) if g else 1.0,
        logits_divisor=float(config.logits_scaling) if g else 1.0, scaling=scaling,
        moe=moe.spec_of(config, Unsupported), qk_style="llama" if mt == "olmoe" else "olmo2", mrope=mrope,
        gemma=gemma, act=act, rope_types=rope_types,
        attn_softcap=_softcap(config, "attn_logit_softcapping") if gemma else None,
        final_softcap=_softcap(config, "final_logit_softcapping") if gemma else None)


def _softcap(config, name: str) -> float | None:
    v = getattr(config, name, None)
    return float(v) if v else None


_linear, _fused = layers.linear, layers.fused


class Attention(nn.Module):
    def __init__(self, a: Arch, i: int, biases: dict, tp: TensorParallel, dtype, device):
        super().__init__()
        self.layer_idx, self.tp = i, tp
        self.heads, self.kv_heads = a.heads // tp.size, a.kv_heads // tp.size
        self.head_dim, self.scaling, self.window = a.head_dim, a.scaling, a.windows[i]
        d, e = a.head_dim, a.hidden
        self.q_proj = _linear(e, self.heads * d, biases.get("q_proj", False), dtype, device)
        self.k_proj = _linear(e, self.kv_heads * d, biases.get("k_proj", False), dtype, device)
        self.v_proj = _linear(e, self.kv_heads * d, biases.get("v_proj", False), dtype, device)
        self.o_proj = _linear(a.heads * d // tp.size, e, biases.get("o_proj", False), dtype, device)
        self.qkv_proj = None        # fuse(): q, k and v in one layer
        self.qk_norm, self.soft_cap = a.qk_norm, a.attn_softcap
        self.rope = a.rope_types[i] if a.rope_types else None     # its rope's key (Gemma 3: by layer type)
        if a.qk_norm == "head":
            style = "gemma" if a.gemma else "llama"
            self.q_norm = RMSNorm(d, a.eps, style, dtype=dtype, device=device)
            self.k_norm = RMSNorm(d, a.eps, style, dtype=dtype, device=device)
        elif a.qk_norm == "full":   # over the whole projection (every head of every rank: _full_norm)
            self.q_norm = RMSNorm(self.heads * d, a.eps, a.qk_style, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.kv_heads * d, a.eps, a.qk_style, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        if self.qkv_proj is not None:   # [T, (H + 2 Hkv) D]: three views of one product
            q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self._full_norm(self.q_norm, q), self._full_norm(self.k_norm, k)
        q, k, v = q.view(t, -1, d), k.view(t, -1, d), v.view(t, -1, d)
        if self.qk_norm == "head":    # contiguous: the norm kernels' rows (kernels/cpu_layer.c norms them alike)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        k_cache, v_cache = step.kv_cache[self.layer_idx]
        # rotary, the KV write and attention: the backend chosen at load (kernels/backends.py)
        out = step.backend.forward(q, k, v, k_cache, v_cache, step, self.scaling, cos=cos, sin=sin,
                                   window=self.window, soft_cap=self.soft_cap)
        return self.tp.reduce(self.o_proj(out.reshape(t, -1)))     # row-parallel: partial sums

    def _full_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """An RMSNorm over the whole projection [T, H*D]; with tensor parallelism each rank holds
        [T, H*D/N] and its slice of the weight, and the squares' sums are all-reduced."""
        if self.tp.size == 1:
            return norm(x.contiguous())     # as the per-head norms (forward)
        h = x.float()
        ss = self.tp.reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(ss / (h.shape[-1] * self.tp.size) + norm.eps)
        return norm.weight * h.to(x.dtype) if norm.style == "llama" else (norm.weight * h).to(x.dtype)

    def fuse(self) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_split = [p.out_features for p in parts]
        self.qkv_proj = _fused(parts)
        del self.q_proj, self.k_proj, self.v_proj


class MLP(layers.GatedMlp):
    """The dense MLP: gate/up column-parallel, down row-parallel, its partial sums all-reduced."""

    def __init__(self, a: Arch, tp: TensorParallel, dtype, device):
        super().__init__(a.hidden, a.intermediate // tp.size, dtype, device, a.act)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.reduce(super().forward(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: Arch, i: int, biases: dict, tp: TensorParallel, dtype, device):
        super().__init__()
        self.self_attn = Attention(a, i, biases, tp, dtype, device)
        if a.moe is not None and a.moe.sparse[i]:
            self.mlp = moe.SparseMoe(a.hidden, a.moe, tp, dtype, device)
        else:
            self.mlp = MLP(a, tp, dtype, device)
        self.post_norms, self.residual_scale, self.gemma = a.post_norms, a.residual_scale, a.gemma
        style = "olmo2" if a.post_norms else "gemma" if a.gemma else "llama"
        if a.gemma:     # before and after each sublayer
            self.input_layernorm = RMSNorm(a.hidden, a.eps, style, dtype=dtype, device=device)
            self.pre_feedforward_layernorm = RMSNorm(a.hidden, a.eps, style, dtype=dtype, device=device)
            self.post_feedforward_layernorm = RMSNorm(a.hidden, a.eps, style, dtype=dtype, device=device)
        elif a.post_norms:
            self.post_feedforward_layernorm = RMSNorm(a.hidden, a.eps, style, dtype=dtype, device=device)
        else:
            self.input_layernorm = RMSNorm(a.hidden, a.eps, style, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(a.hidden, a.eps, style, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, cos, sin, step) -> torch.Tensor:
        if self.gemma:
            h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, step))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.post_norms:     # OLMo-2
            h = h + self.post_attention_layernorm(self.self_attn(h, cos, sin, step))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        x = self.self_attn(self.input_layernorm(h), cos, sin, step)
        h = h + x * self.residual_scale if self.residual_scale != 1.0 else h + x
        x = self.mlp(self.post_attention_layernorm(h))
        return h + x * self.residual_scale if self.residual_scale != 1.0 else h + x


class Body(nn.Module):
    """`model.*` of the checkpoint: embeddings, layers, final norm."""

    def __init__(self, a: Arch, biases: dict, tp: TensorParallel, dtype, device):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab, a.hidden, dtype=dtype, device=device).requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(a, i, biases, tp, dtype, device) for i in range(a.layers))
        self.norm = RMSNorm(a.hidden, a.eps, "olmo2" if a.post_norms else "gemma" if a.gemma else "llama",
                            dtype=dtype, device=device)


class LlamaFamilyForCausalLM(nn.Module):
    """Our model; module names follow the checkpoint's (`model.layers.3.self_attn.q_proj`), so LoRA
    adapters and the CPU GEMM packing find their layers by the names transformers gives them."""

    def __init__(self, config, arch: Arch, biases: dict, tp: TensorParallel, dtype, device, max_positions: int,
                 rotary_device=None):
        super().__init__()
        self.config, self.arch, self.tp = config, arch, tp
        self.model = Body(arch, biases, tp, dtype, device)
        self.lm_head = _linear(arch.hidden, arch.vocab, False, dtype, device)
        if arch.tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        if arch.rope_types:     # Gemma 3: one rope per layer type (local and global theta, the global's scaling)
            self.rotaries = {t: Rotary(config, arch.head_dim, max_positions, dtype, rotary_device or device,
                                       layer_type=t) for t in dict.fromkeys(arch.rope_types)}
            self.rotary = self.rotaries[arch.rope_types[0]]
        else:
            self.rotary = Rotary(config, arch.head_dim, max_positions, dtype, rotary_device or device)
            self.rotaries = None
        # Gemma: transformers multiplies by the scale rounded to the weights' dtype
        self.embed_scale = float(torch.tensor(arch.embed_scale, dtype=dtype)) if arch.gemma else arch.embed_scale
        self.generation_config = None
        self.decode_stack = None    # CPU: handler.model.cpu_stack.DecodeStack, set by the runner

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Per layer, q/k/v as one linear layer and gate/up as another: one GEMM (and, quantized,
        one rounding of the shared input row) instead of three and two. Each output column is
        still its own dot product over the same input, so the per-column kernels (our panels,
        int8) give the unfused values bit for bit. Not for LoRA, whose adapters target the
        checkpoint's layer names; run after smoothing (handler/model/quant.py), which scales q/k/v
        and gate/up by their producers. Layers a loader already quantized (awq, gptq, gguf) stay
        as they are."""
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            if all(type(p) is nn.Linear for p in (a.q_proj, a.k_proj, a.v_proj)):
                a.fuse()
            m.fuse()     # the dense MLP's or each expert's gate/up (moe.SparseMoe), where plain nn.Linear

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, step, inject=None,
             mrope: torch.Tensor | None = None) -> torch.Tensor:
        """ids/pos [T] -> logits [R, V] of the kept rows (see the module doc). `inject`: (rows [K],
        embeddings [K, E]) written over those rows' token embeddings (a VLM's image tokens:
        handler/model/vision.py), before the embedding multiplier as transformers' VLMs do (Gemma 3's:
        after it, and its image token may lie past the vocabulary: those rows embed token 0 first).
        `mrope`: M-RoPE positions [3, T] (time, height, width) instead of `pos`, for a step that feeds
        image tokens."""
        a = self.arch
        if inject is not None and a.gemma:
            ids = ids.masked_fill(ids >= a.vocab, 0)
        h = self.model.embed_tokens(ids)
        if inject is not None and not a.gemma:
            h.index_copy_(0, inject[0], inject[1].to(h.dtype))
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        if inject is not None and a.gemma:
            h.index_copy_(0, inject[0], inject[1].to(h.dtype))
        # (cos, sin) [T, D] by rope key: one rope (key None), or Gemma 3's per layer type (Attention.rope)
        if mrope is not None:
            ropes = {None: self.rotary.mrope(mrope, a.mrope)}
        elif self.rotaries is not None:
            ropes = {t: r(pos, step.seq_lens_cpu, step.query_start_loc_cpu) for t, r in self.rotaries.items()}
        else:
            ropes = {None: self.rotary(pos, step.seq_lens_cpu, step.query_start_loc_cpu)}
        one = ropes.get(None)     # the C stack takes one rope (it refuses the Gemma families at load)
        if one is None or self.decode_stack is None or not self.decode_stack.run(h, *one, step):
            for layer in self.model.layers:
                h = layer(h, *ropes[layer.self_attn.rope], step)
        logits = self.lm_head(self.model.norm(h[keep]))
        if a.logits_divisor != 1.0:
            logits = logits / a.logits_divisor
        if a.final_softcap is not None:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits


# ---------------------------------------------------------------------------- loading
_PROJ = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "gate_proj": "column", "up_proj": "column",
         "o_proj": "row", "down_proj": "row"}


def _safetensors(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(model_dir, v) for v in json.load(f)["weight_map"].values()})
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def _checkpoint_names(files: list[str], rename=None) -> set[str]:
    from safetensors import safe_open
    names = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.update(f.keys() if rename is None else (n for n in map(rename, f.keys()) if n is not None))
    return names


def _spec(name: str) -> Shard:
    """How tensor `name` (ours, after fused weights are split) is cut across ranks."""
    leaf = name.split(".")[-2] if name.endswith((".weight", ".bias")) else ""
    return Shard(_PROJ.get(leaf))


def load(model_dir: str, config, *, dtype: torch.dtype, device: torch.device,
         tp: TensorParallel = TensorParallel(), max_positions: int | None = None,
         quantize: str | None = None, numerics: Numerics = Numerics(), names=None) -> LlamaFamilyForCausalLM:
    """Build our model for `config` and fill it from the checkpoint's safetensors. Raises
    Unsupported (transformers serves the model instead) or ValueError (a bad checkpoint).
    `quantize` (option.quantize): AWQ/GPTQ checkpoints and GGUF files are read into grouped
    layers (handler/model/quant_formats.py), packed as `numerics` says (handler/config/numerics.py);
    `none` dequantizes them. `names`: a checkpoint name -> ours, or None for a tensor that is not the
    language model's (a vision-language model's image side: handler/model/vision.py)."""
    from safetensors import safe_open
    from handler.model import quant_formats, quant_int4

    a = arch_of(config)
    widths = (a.intermediate,) + ((a.moe.intermediate, a.moe.shared) if a.moe is not None else ())
    if a.heads % tp.size or a.kv_heads % tp.size or any(w % tp.size for w in widths):
        raise Unsupported(f"{tp.size} ranks do not divide the heads / MLP width")
    files = _safetensors(model_dir)
    if not files:
        raise Unsupported("no .safetensors weights in the model directory")
    rename = names
    names = _checkpoint_names(files, rename)
    biases = {}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        biases[proj] = f"model.layers.0.self_attn.{proj}.bias" in names
    if a.fused and "model.layers.0.self_attn.qkv_proj.bias" in names:
        biases.update(q_proj=True, k_proj=True, v_proj=True)
    if any(".mlp." in n and n.endswith(".bias") for n in names):
        raise Unsupported("MLP biases")
    # Built on the meta device (no random init of weights about to be overwritten), then given memory.
    model = LlamaFamilyForCausalLM(config, a, biases, tp, dtype, torch.device("meta"),
                                   max_positions or a.max_positions, rotary_device=device)
    model.to_empty(device=device)
    if a.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    qload = quant_formats.CheckpointLoader.for_dir(model_dir, quantize)    # AWQ / GPTQ, else None
    if qload is not None and rename is not None:
        raise Unsupported("an AWQ / GPTQ vision-language checkpoint")
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim

    experts_seen: dict[int, set[int]] = {}

    def spec_of(name: str) -> Shard:
        if a.qk_norm == "full" and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            return Shard("column")      # olmo2 / olmoe: each rank normalises its heads' slice (_full_norm)
        return _spec(name)

    def put(name: str, t: torch.Tensor, spec: Shard):
        p = params.get(name)
        where = moe.expert_index(name) if a.moe is not None else None
        if where is not None:
            experts_seen.setdefault(where[0], set()).add(where[1])
            if where[1] >= a.moe.experts:
                raise ValueError(f"the checkpoint has expert {where[1]} in layer {where[0]}; config.json's experts "
                                 f"count (num_experts / num_local_experts) is {a.moe.experts}")
        if p is None:
            if a.moe is not None:
                moe.check_dense(name, a.moe)
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
        t = shard(t, spec, tp)
        if tuple(t.shape) != tuple(p.shape):
            if a.moe is not None and name.endswith(".mlp.gate.weight"):
                raise ValueError(f"tensor {name}: the router has {t.shape[0]} experts; config.json's experts count "
                                 f"(num_experts / num_local_experts) is {a.moe.experts}")
            raise ValueError(f"tensor {name}: checkpoint shape {list(t.shape)} does not fit {list(p.shape)} "
                             f"(config.json and the weights disagree)")
        with torch.no_grad():
            p.copy_(t.to(dtype))
        filled.add(name)

    for path in files:
        with safe_open(path, framework="pt") as f:
            for stored in f.keys():
                key = stored if rename is None else rename(stored)
                if key is None or key.endswith("rotary_emb.inv_freq") or (qload is not None and qload.take(key, f)):
                    continue
                t = f.get_tensor(stored)
                if a.moe is not None:
                    key = moe.our_name(key)
                    parts = moe.split_fused(key, t, a.moe)
                    if parts is not None:       # fused 3-D experts: per expert
                        for name, part in parts:
                            put(name, part, _spec(name))
                        continue
                if a.fused and ".qkv_proj." in key:
                    parts = t.split([q, kv, kv], 0)
                    for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                        put(key.replace("qkv_proj", proj), part, Shard("column"))
                elif a.fused and ".gate_up_proj." in key:
                    for proj, part in zip(("gate_proj", "up_proj"), t.chunk(2, 0)):
                        put(key.replace("gate_up_proj", proj), part, Shard("column"))
                elif key == "lm_head.weight" and a.tied:
                    continue
                else:
                    put(key, t, spec_of(key))
    if a.moe is not None:
        moe.check_experts(experts_seen, a.moe)
    if qload is not None:
        filled |= qload.install(model, tp, a, _spec, numerics)
    missing = sorted(n for n in params if n not in filled and not (a.tied and n == "lm_head.weight"))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if quantize == "gguf":
        quant_formats.install_gguf(model, model_dir, tp, a, _spec, numerics)
    elif quantize == "none":
        quant_int4.dequantize_model(model, dtype)
    for m in model.modules():   # each norm's CPU kernel, chosen once its weight has its memory
        if isinstance(m, RMSNorm):
            m.bind_kernel()
    model.eval()
    return model
