"""Encoders (BERT, ELECTRA, DistilBERT; RoBERTa / XLM-R / CamemBERT; ModernBERT) on our own forward over
packed variable-length batches; any other encoder transformers knows (MPNet, DeBERTa-v2, ...) on
transformers' own forward over padded batches (`HFEncoder`), the same packed contract.

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

import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn

from handler.config.task import ENCODER_TYPES
from kernels import cpu as cpu_ext

log = logging.getLogger("lmi.encoder")

# model_type -> where positions start (RoBERTa's family numbers them from padding_idx + 1).
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
MODERN_TYPES = ("modernbert",)
BERT_TYPES = ("bert", "electra", "distilbert")
SUPPORTED_TYPES = BERT_TYPES + ROBERTA_TYPES + MODERN_TYPES


class EncoderLayer(nn.Module):
    """A post-norm layer: (query, key, value) linears `qkv`, the attention output `o`, its LayerNorm
    `ln1`, the MLP `up` / `act` / `down` and its LayerNorm `ln2` (module doc)."""

    def __init__(self, qkv, o, ln1, up, act, down, ln2, heads: int):
        super().__init__()
        self.qkv = _fused(qkv)
        self.o, self.ln1, self.up, self.act, self.down, self.ln2 = o, ln1, up, act, down, ln2
        self.heads = heads

    @classmethod
    def of(cls, layer: nn.Module, heads: int) -> "EncoderLayer":
        """A BertLayer-shaped module (BERT, RoBERTa, XLM-R, ELECTRA) or DistilBERT's TransformerBlock."""
        if hasattr(layer, "sa_layer_norm"):     # DistilBERT
            a, f = layer.attention, layer.ffn
            return cls((a.q_lin, a.k_lin, a.v_lin), a.out_lin, layer.sa_layer_norm, f.lin1, f.activation, f.lin2,
                       layer.output_layer_norm, heads)
        att = layer.attention
        return cls((att.self.query, att.self.key, att.self.value), att.output.dense, att.output.LayerNorm,
                   layer.intermediate.dense, layer.intermediate.intermediate_act_fn, layer.output.dense,
                   layer.output.LayerNorm, heads)

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
    """The encoder stack of an HF BertModel / RobertaModel / ElectraModel / DistilBertModel (`base`), with
    an optional sequence-classification head (`head`: the HF *ForSequenceClassification model's;
    DistilBERT's is (pre_classifier, classifier))."""

    def __init__(self, base: nn.Module, config, head=None):
        super().__init__()
        emb = base.embeddings
        self.word, self.position = emb.word_embeddings, emb.position_embeddings
        self.token_type = getattr(emb, "token_type_embeddings", None)
        self.ln = emb.LayerNorm
        self.project = getattr(base, "embeddings_project", None)    # ELECTRA: embedding_size -> hidden_size
        blocks = base.transformer.layer if config.model_type == "distilbert" else base.encoder.layer
        heads = config.n_heads if config.model_type == "distilbert" else config.num_attention_heads
        self.layers = nn.ModuleList(EncoderLayer.of(layer, heads) for layer in blocks)
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
        if self.project is not None:
            x = self.project(x)
        lists = ([s for s, _ in spans], [e - s for s, e in spans])
        for layer in self.layers:
            x = layer(x, spans, lists)
        return x

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The classification head's logits [B, labels] on each sequence's first token."""
        first = hidden[[s for s, _ in spans]]
        if self.model_type in ROBERTA_TYPES:
            return self.head.out_proj(torch.tanh(self.head.dense(first)))
        if self.model_type == "electra":    # ElectraClassificationHead: gelu where BERT's pooler has tanh
            return self.head.out_proj(self.head.activation(self.head.dense(first)))
        if self.model_type == "distilbert":
            pre, classifier = self.head
            return classifier(torch.relu(pre(first)))
        if self.pooler is not None:
            first = torch.tanh(self.pooler(first))
        return self.head(first)


def is_encoder(config) -> bool:
    """Whether `config` is a bidirectional encoder: a model_type the task detection knows as one
    (handler/config/task.py ENCODER_TYPES: ours, MPNet, DeBERTa, the remote-code nomic-bert and gte), or one
    transformers has a masked-LM head for. Anything else is a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return config.model_type in ENCODER_TYPES or config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


class HFEncoder(nn.Module):
    """Any other encoder (MPNet, DeBERTa-v2, ...) on transformers' own forward: the batch padded to its
    longest sequence (the attention mask hides the padding, which sits after each sequence), its rows
    packed back [T, H]; a classifier's logits come from the same forward (`classify` after it)."""

    def __init__(self, model: nn.Module, config, classifier: bool):
        super().__init__()
        self.model, self.classifier, self.model_type = model, classifier, config.model_type
        params = inspect.signature(model.forward).parameters
        self.types = "token_type_ids" in params and int(getattr(config, "type_vocab_size", 0) or 0) > 1
        self.pad = int(getattr(config, "pad_token_id", 0) or 0)
        # MPNet numbers positions from padding_idx + 1, as RoBERTa does
        offset = self.pad + 1 if config.model_type == "mpnet" else 0
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30) - offset
        self._logits = None

    def forward(self, ids: torch.Tensor, types: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        b, width = len(spans), max(e - s for s, e in spans)
        x = torch.full((b, width), self.pad, dtype=torch.long, device=ids.device)
        mask = torch.zeros(b, width, dtype=torch.long, device=ids.device)
        tt = torch.zeros(b, width, dtype=torch.long, device=ids.device)
        for i, (s, e) in enumerate(spans):
            x[i, :e - s], mask[i, :e - s], tt[i, :e - s] = ids[s:e], 1, types[s:e]
        kw = {"token_type_ids": tt} if self.types else {}
        out = self.model(input_ids=x, attention_mask=mask, output_hidden_states=self.classifier, **kw)
        if self.classifier:
            self._logits, hidden = out.logits, out.hidden_states[-1]
        else:
            hidden = out.last_hidden_state
        rows = torch.cat([torch.arange(e - s, device=ids.device) + i * width for i, (s, e) in enumerate(spans)])
        return hidden.reshape(b * width, -1)[rows]

    def classify(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The logits [B, labels] of the forward that gave `hidden`."""
        logits, self._logits = self._logits, None
        return logits


def load_encoder(model_dir: str, config, dtype: torch.dtype, classifier: bool,
                 trust_remote_code: bool = False) -> nn.Module:
    """model_dir's encoder (and its sequence-classification head when `classifier`): ours for
    SUPPORTED_TYPES, else transformers' (HFEncoder)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    if config.model_type not in SUPPORTED_TYPES:
        cls = AutoModelForSequenceClassification if classifier else AutoModel
        hf = cls.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code).eval()
        hf.requires_grad_(False)
        log.info("encoder %s: transformers' forward over padded batches (ours covers %s)", config.model_type,
                 ", ".join(SUPPORTED_TYPES))
        return HFEncoder(hf, config, classifier)
    modern = config.model_type in MODERN_TYPES
    if classifier:
        hf = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype)
        base = getattr(hf, hf.base_model_prefix)
        # ModernBERT: prediction head, classifier; DistilBERT: pre-classifier, classifier
        head = ((hf.head, hf.classifier) if modern else (hf.pre_classifier, hf.classifier)
                if config.model_type == "distilbert" else hf.classifier)
    else:
        hf = AutoModel.from_pretrained(model_dir, dtype=dtype)      # its pooler (if any) stays unused
        base, head = hf, None
    hf.eval()
    enc = (ModernEncoder if modern else Encoder)(base, config, head).eval()
    enc.requires_grad_(False)
    log.info("encoder attention: %s", "one C call a layer over the packed sequences (lmi_encoder_attention)"
             if cpu_ext.encoder_attention_available(dtype) else f"torch SDPA per sequence (no C kernel for {dtype})")
    return enc
