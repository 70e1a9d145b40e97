"""Encoders (BERT; RoBERTa / XLM-R / CamemBERT) on our own forward over packed variable-length batches.

The weights are transformers' modules (loaded with `AutoModel`, so every checkpoint naming it reads is
read); the forward is ours: one [T, H] tensor for all of a batch's tokens (no padding), the linears
whatever pack the runner put there (handler/model/linear.py CpuLinear: fp32 panels, int8), and
bidirectional attention over the packed rows in one C call a layer (kernels/cpu_decode.c
lmi_encoder_attention: each sequence's rows see all of their sequence and nothing else, the panel GEMMs
inside, sequences longest first over the threads); where the kernels do not run (another device or
dtype, no C build) torch's scaled_dot_product_attention per sequence serves, the same values to fp32
rounding.

    x = LayerNorm(word[ids] + position[pos] + token_type[types])     pos: 0.. (BERT), pad+1.. (RoBERTa)
    per layer:  x = LN(x + o(attn(q(x), k(x), v(x))));  x = LN(x + down(act(up(x))))

ModernBERT (`ModernEncoder`) is pre-norm with rotary positions and a gated MLP; every
`global_attn_every_n_layers`-th layer attends to its whole sequence, the others to a band
(|i - j| <= local_attention / 2, as transformers' sliding mask), each layer type with its own RoPE theta:

    x = LN(tok[ids]);  per layer:  x = x + Wo(attn(rope(Wqkv(LN_a(x)))));  x = x + Wo(act(a) * g), a|g = Wi(LN_m(x))
    then LN_final (layer 0 has no attention norm)

A sequence no longer than the band (all its distances within it) is attended whole, by the C call; a
longer one under a band by torch's SDPA with the band as its mask.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_ext

log = logging.getLogger("lmi.encoder")

# model_type -> where positions start (RoBERTa's family numbers them from padding_idx + 1).
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
MODERN_TYPES = ("modernbert",)
SUPPORTED_TYPES = ("bert",) + ROBERTA_TYPES + MODERN_TYPES


class EncoderLayer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int):
        super().__init__()
        att = layer.attention
        self.qkv = _fused((att.self.query, att.self.key, att.self.value))
        self.o, self.ln1 = att.output.dense, att.output.LayerNorm
        self.up, self.act = layer.intermediate.dense, layer.intermediate.intermediate_act_fn
        self.down, self.ln2 = layer.output.dense, layer.output.LayerNorm
        self.heads = heads

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]], lists: tuple[list, list]) -> torch.Tensor:
        """x [T, H]; spans each sequence's rows; lists (starts, lengths) of the same, for the C call."""
        T, H = x.shape
        d = H // self.heads
        q, k, v = self.qkv(x).view(T, 3, self.heads, d).unbind(1)      # [T, h, d] views of one product
        out = torch.empty(T, self.heads, d, dtype=x.dtype, device=x.device)
        _attend(q, k, v, out, spans, lists, None)     # bidirectional within each sequence, nothing across
        x = self.ln1(x + self.o(out.view(T, H)))
        return self.ln2(x + self.down(self.act(self.up(x))))


def _fused(parts) -> nn.Linear:
    """BERT's query/key/value as one linear layer [3H, H] (rows q, then k, then v): one GEMM a layer
    instead of three, each output column still its own dot product over the same row (the same values)."""
    w = torch.cat([p.weight.detach() for p in parts])
    bias = parts[0].bias is not None
    m = nn.Linear(w.shape[1], w.shape[0], bias=bias, device="meta")
    m.weight = nn.Parameter(w, requires_grad=False)
    if bias:
        m.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return m


def _attend(q, k, v, out, spans, lists, window: int | None) -> None:
    """out [T, h, d] = bidirectional attention of each sequence's rows (q/k/v [T, h, d]); `window`: only
    keys within that distance (ModernBERT's local layers), None: all of the sequence."""
    d = q.shape[-1]
    starts, lens = lists
    banded = [window is not None and n - 1 > window for n in lens]      # some distance outside the band
    whole = [i for i, b in enumerate(banded) if not b]
    done = bool(whole) and q.device.type == "cpu" and cpu_ext.encoder_attention(
        q, k, v, [starts[i] for i in whole], [lens[i] for i in whole], d ** -0.5, out)
    qt, kt, vt, ot = (t.transpose(0, 1) for t in (q, k, v, out))                    # [h, T, d]
    for i, (s, e) in enumerate(spans):
        if done and not banded[i]:
            continue
        mask = None
        if banded[i]:
            pos = torch.arange(e - s, device=q.device)
            mask = (pos[:, None] - pos[None, :]).abs() <= window
        ot[:, s:e] = F.scaled_dot_product_attention(qt[:, s:e], kt[:, s:e], vt[:, s:e], attn_mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' apply_rotary_pos_emb (rotate_half): x [T, h, d], cos/sin [T, 1, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class ModernLayer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, window: int | None):
        super().__init__()
        self.attn_norm, self.qkv, self.o = layer.attn_norm, layer.attn.Wqkv, layer.attn.Wo
        self.mlp_norm, self.wi, self.act, self.wo = layer.mlp_norm, layer.mlp.Wi, layer.mlp.act, layer.mlp.Wo
        self.heads, self.window, self.kind = heads, window, layer.attention_type

    def forward(self, x, rope, spans, lists):
        T, H = x.shape
        d = H // self.heads
        cos, sin = rope[self.kind]
        q, k, v = self.qkv(self.attn_norm(x)).view(T, 3, self.heads, d).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty(T, self.heads, d, dtype=x.dtype, device=x.device)
        _attend(q, k, v.contiguous(), out, spans, lists, self.window)
        x = x + self.o(out.view(T, H))
        a, g = self.wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.wo(self.act(a) * g)


class ModernEncoder(nn.Module):
    """An HF ModernBertModel (`base`) on the packed forward, with its sequence-classification head
    (`head`: the HF ModernBertForSequenceClassification's (prediction head, classifier))."""

    def __init__(self, base: nn.Module, config, head: nn.Module | None = None):
        super().__init__()
        self.word, self.ln, self.final = base.embeddings.tok_embeddings, base.embeddings.norm, base.final_norm
        self.rotary = base.rotary_emb
        self.kinds = sorted(set(config.layer_types))
        self.layers = nn.ModuleList(
            ModernLayer(layer, config.num_attention_heads,
                        config.sliding_window if layer.attention_type == "sliding_attention" else None)
            for layer in base.layers)
        self.max_positions = config.max_position_embeddings
        self.model_type = config.model_type
        self.pred, self.classifier = head if head is not None else (None, None)
        self.pooling = getattr(config, "classifier_pooling", "cls")

    def forward(self, ids: torch.Tensor, types: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """ids: [T] for all sequences packed (types: unused, one segment); spans -> hidden states [T, H]."""
        pos = torch.cat([torch.arange(e - s) for s, e in spans]).to(ids.device)
        x = self.ln(self.word(ids))
        rope = {}
        for kind in self.kinds:     # per layer type: its own theta (transformers' rotary module, its values)
            cos, sin = self.rotary(x[None], pos[None], kind)
            rope[kind] = (cos[0, :, None, :], sin[0, :, None, :])
        lists = ([s for s, _ in spans], [e - s for s, e in spans])
        for layer in self.layers:
            x = layer(x, rope, spans, lists)
        return self.final(x)

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The classification head's logits [B, labels]: the first token or the mean (classifier_pooling)."""
        if self.pooling == "mean":
            pooled = torch.stack([hidden[s:e].mean(0) for s, e in spans])
        else:
            pooled = hidden[[s for s, _ in spans]]
        return self.classifier(self.pred(pooled))


class Encoder(nn.Module):
    """The encoder stack of an HF BertModel / RobertaModel (`base`), with an optional sequence-
    classification head (`head`: the HF *ForSequenceClassification model's)."""

    def __init__(self, base: nn.Module, config, head: nn.Module | None = None):
        super().__init__()
        emb = base.embeddings
        self.word, self.position = emb.word_embeddings, emb.position_embeddings
        self.token_type = getattr(emb, "token_type_embeddings", None)
        self.ln = emb.LayerNorm
        self.layers = nn.ModuleList(EncoderLayer(layer, config.num_attention_heads) for layer in base.encoder.layer)
        self.pos_offset = config.pad_token_id + 1 if config.model_type in ROBERTA_TYPES else 0
        self.max_positions = config.max_position_embeddings - self.pos_offset
        self.model_type = config.model_type
        # Sequence classification: BERT's pooler (dense + tanh on [CLS]) + classifier; RoBERTa's
        # classifier is dense + tanh + out_proj on <s>.
        self.pooler = base.pooler.dense if head is not None and getattr(base, "pooler", None) is not None else None
        self.head = head

    def forward(self, ids: torch.Tensor, types: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """ids, types: [T] for all sequences packed; spans: each sequence's rows -> hidden states [T, H]."""
        pos = torch.cat([torch.arange(e - s) for s, e in spans]).to(ids.device) + self.pos_offset
        x = self.word(ids) + self.position(pos)
        if self.token_type is not None:     # RoBERTa's one segment: a pair's second text is segment 0 too
            x = x + self.token_type(types if self.token_type.num_embeddings > 1 else torch.zeros_like(types))
        x = self.ln(x)
        lists = ([s for s, _ in spans], [e - s for s, e in spans])
        for layer in self.layers:
            x = layer(x, spans, lists)
        return x

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The classification head's logits [B, labels] on each sequence's first token."""
        first = hidden[[s for s, _ in spans]]
        if self.model_type in ROBERTA_TYPES:
            return self.head.out_proj(torch.tanh(self.head.dense(first)))
        if self.pooler is not None:
            first = torch.tanh(self.pooler(first))
        return self.head(first)


def load_encoder(model_dir: str, config, dtype: torch.dtype, classifier: bool) -> nn.Module:
    """model_dir's encoder (and its sequence-classification head when `classifier`) on our forward."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    modern = config.model_type in MODERN_TYPES
    if classifier:
        hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype)
        base = getattr(hf, hf.base_model_prefix)
        head = (hf.head, hf.classifier) if modern else hf.classifier    # ModernBERT: prediction head, classifier
    else:
        hf = AutoModel.from_pretrained(model_dir, dtype=dtype)      # its pooler (if any) stays unused
        base, head = hf, None
    hf.eval()
    enc = (ModernEncoder if modern else Encoder)(base, config, head).eval()
    enc.requires_grad_(False)
    log.info("encoder attention: %s", "one C call a layer over the packed sequences (lmi_encoder_attention)"
             if cpu_ext.prefill_attention_available(dtype) else f"torch SDPA per sequence (no C kernel for {dtype})")
    return enc
