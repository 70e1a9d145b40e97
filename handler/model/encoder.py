"""Encoders (BERT; RoBERTa / XLM-R / CamemBERT) on our own forward over packed variable-length batches.

The weights are transformers' modules (loaded with `AutoModel`, so every checkpoint naming it reads is
read); the forward is ours: one [T, H] tensor for all of a batch's tokens (no padding), the linears
whatever pack the runner put there (handler/model/linear.py CpuLinear: fp32 panels, int8), and
bidirectional attention per sequence with torch's scaled_dot_product_attention over that sequence's rows
(a C bidirectional kernel over the packed rows is for later: the kernels/ tree is being reorganised).

    x = LayerNorm(word[ids] + position[pos] + token_type[types])     pos: 0.. (BERT), pad+1.. (RoBERTa)
    per layer:  x = LN(x + o(attn(q(x), k(x), v(x))));  x = LN(x + down(act(up(x))))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# model_type -> where positions start (RoBERTa's family numbers them from padding_idx + 1).
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
SUPPORTED_TYPES = ("bert",) + ROBERTA_TYPES


class EncoderLayer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int):
        super().__init__()
        att = layer.attention
        self.q, self.k, self.v = att.self.query, att.self.key, att.self.value
        self.o, self.ln1 = att.output.dense, att.output.LayerNorm
        self.up, self.act = layer.intermediate.dense, layer.intermediate.intermediate_act_fn
        self.down, self.ln2 = layer.output.dense, layer.output.LayerNorm
        self.heads = heads

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        T, H = x.shape
        d = H // self.heads
        q, k, v = (m(x).view(T, self.heads, d).transpose(0, 1) for m in (self.q, self.k, self.v))  # [h, T, d]
        out = torch.empty(self.heads, T, d, dtype=x.dtype, device=x.device)
        for s, e in spans:      # bidirectional within each sequence, nothing across
            out[:, s:e] = F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e])
        x = self.ln1(x + self.o(out.transpose(0, 1).reshape(T, H)))
        return self.ln2(x + self.down(self.act(self.up(x))))


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
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The classification head's logits [B, labels] on each sequence's first token."""
        first = hidden[[s for s, _ in spans]]
        if self.model_type in ROBERTA_TYPES:
            return self.head.out_proj(torch.tanh(self.head.dense(first)))
        if self.pooler is not None:
            first = torch.tanh(self.pooler(first))
        return self.head(first)


def load_encoder(model_dir: str, config, dtype: torch.dtype, classifier: bool) -> Encoder:
    """model_dir's encoder (and its sequence-classification head when `classifier`) on our forward."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    if classifier:
        hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype)
        base = getattr(hf, hf.base_model_prefix)
        head = hf.classifier
    else:
        hf = AutoModel.from_pretrained(model_dir, dtype=dtype)      # its pooler (if any) stays unused
        base, head = hf, None
    hf.eval()
    enc = Encoder(base, config, head).eval()
    enc.requires_grad_(False)
    return enc
