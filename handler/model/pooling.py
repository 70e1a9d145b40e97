"""The runner of pooling models (option.task = text_embedding | classify | rerank): load, the packed
forward, pooling, the classification head. The engine side is handler/engine/pooling.py.

Models:
  encoders (BERT, ELECTRA, DistilBERT, RoBERTa, XLM-R, CamemBERT, ModernBERT): handler/model/encoder.py, our
    forward over packed rows; other encoders (MPNet, DeBERTa-v2, ...) transformers' forward, padded;
    a `*ForSequenceClassification` checkpoint adds its head (a cross-encoder when it has one label)
  decoders (Qwen, Llama, ...) with option.task=text_embedding: transformers' base model, one sequence
    a forward (causal attention), last-token pooling (Qwen3-Embedding's recipe), normalized
Pooling comes from sentence-transformers' files where the directory has them (modules.json: the
Pooling module's config for the mode, Dense modules (a linear layer and its activation after pooling,
as sentence-transformers applies them), a Normalize module for unit length);
without them an encoder pools [CLS] and normalizes (vLLM's default for BERT), a decoder its last token.
Linear layers are packed as the LLMs' are (handler/model/cpu.py prepack_linears; option.quantize=int8
/ int8_weight_only: handler/model/quant.py).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from handler.engine.pooling import PoolInput
from handler.model.encoder import is_encoder, load_encoder
from handler.model.runner import ModelLoadError, pick_device, pick_dtype

log = logging.getLogger("lmi.model")

MODES = ("cls", "mean", "max", "lasttoken", "mean_sqrt_len")
# int8 weights of a pooling model: symmetric codes with one scale per 32 inputs of a row. all-MiniLM-L6-v2's
# embeddings against fp32: cosine >= 0.9996 this way; one scale per row (the LLMs' int8_weight_only) 0.9985,
# W8A8 (the LLMs' int8: activations rounded per token) 0.992.
INT8_GROUP = 32


def quantize_grouped(model: torch.nn.Module, group: int = INT8_GROUP) -> int:
    """Every nn.Linear of `model` -> the grouped-weight CpuLinear (handler/model/quant_int4.py) with int8
    codes, `group` inputs a scale (a whole row where K does not divide); returns how many."""
    from handler.model.quant_int4 import Grouped, install, use_kernel

    done = 0
    for name, m in [(n, x) for n, x in model.named_modules() if type(x) is torch.nn.Linear]:
        w = m.weight.detach().float()
        N, K = w.shape
        g = group if K % group == 0 else K
        wg = w.view(N, K // g, g)
        scale = wg.abs().amax(-1) / 127.0                                   # [N, K/g]
        q = torch.where(scale[..., None] > 0, wg / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None], 0.0)
        codes = (q.round().clamp(-127, 127).to(torch.int16) + 128).to(torch.uint8).view(N, K)
        install(model, name, Grouped(codes.contiguous(), scale.contiguous(), (-128.0 * scale).contiguous(), 8, g),
                "int8_weight_only", use_kernel(m.weight.device))
        done += 1
    return done


@dataclass(frozen=True)
class PoolingSpec:
    mode: str               # one of MODES
    normalize: bool         # unit length (cosine similarity is then a dot product)
    source: str             # where it came from (the load log line)
    dense: tuple = ()       # sentence-transformers' Dense modules after pooling: their folders, in order


# A Dense module's activation_function (its class path as sentence-transformers saves it) -> ours.
DENSE_ACTIVATIONS = {"torch.nn.modules.activation.Tanh": torch.tanh, "torch.nn.modules.linear.Identity": None,
                     "torch.nn.modules.activation.ReLU": torch.relu, "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
                     "torch.nn.modules.activation.GELU": torch.nn.functional.gelu}


class Dense(torch.nn.Module):
    """One sentence-transformers Dense module: y = activation(x W^T + b) on the pooled vectors."""

    def __init__(self, folder: str):
        super().__init__()
        cfg = _json(os.path.join(folder, "config.json"))
        act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
        if act not in DENSE_ACTIVATIONS:
            raise ModelLoadError(f"{folder}/config.json: activation_function {act!r} is not supported; allowed: "
                                 f"{', '.join(DENSE_ACTIVATIONS)}")
        self.act = DENSE_ACTIVATIONS[act]
        st = os.path.join(folder, "model.safetensors")
        if os.path.isfile(st):
            from safetensors.torch import load_file
            w = load_file(st)
        elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
            w = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
        else:
            raise ModelLoadError(f"{folder}: a Dense module without model.safetensors or pytorch_model.bin")
        n_in, n_out = int(cfg["in_features"]), int(cfg["out_features"])
        weight = w.get("linear.weight")
        if weight is None or tuple(weight.shape) != (n_out, n_in):
            raise ModelLoadError(f"{folder}: linear.weight is {None if weight is None else tuple(weight.shape)}, "
                                 f"config.json says ({n_out}, {n_in})")
        self.linear = torch.nn.Linear(n_in, n_out, bias="linear.bias" in w).requires_grad_(False)
        self.linear.weight.copy_(weight)
        if self.linear.bias is not None:
            self.linear.bias.copy_(w["linear.bias"])
        self.out_features = n_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.to(self.linear.weight.dtype))
        return y if self.act is None else self.act(y)


def _json(path: str):
    with open(path) as f:
        return json.load(f)


def pooling_spec(model_dir: str, decoder: bool) -> PoolingSpec:
    """The pooling a checkpoint asks for (module doc); ModelLoadError for a module we do not run."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return PoolingSpec("lasttoken" if decoder else "cls", True, "default (no modules.json)")
    mode, normalize, dense = None, False, []
    for m in _json(modules_path):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            cfg = _json(os.path.join(model_dir, m.get("path", ""), "config.json"))
            if cfg.get("pooling_mode"):
                mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max",
                        "lasttoken": "lasttoken"}.get(cfg["pooling_mode"], cfg["pooling_mode"])
            else:
                on = [k for k in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
                      if cfg.get(f"pooling_mode_{k}")]
                if len(on) != 1:
                    raise ModelLoadError(f"{m.get('path')}/config.json asks for pooling {on or 'none'}; "
                                         f"allowed: exactly one of {', '.join(MODES)}")
                mode = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max",
                        "mean_sqrt_len_tokens": "mean_sqrt_len", "lasttoken": "lasttoken"}[on[0]]
            if mode not in MODES:
                raise ModelLoadError(f"{m.get('path')}/config.json: pooling mode {mode!r}; allowed: {', '.join(MODES)}")
        elif kind == "Dense":
            if normalize:
                raise ModelLoadError(f"modules.json: a Dense module ({m.get('path')}) after Normalize is not supported")
            dense.append(str(m.get("path", "")))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"modules.json: the sentence-transformers module {m.get('type')} ({m.get('path')}) "
                                 "is not supported here (Transformer, Pooling, Dense and Normalize are)")
    return PoolingSpec(mode or ("lasttoken" if decoder else "mean"), normalize, "modules.json", tuple(dense))


def declared_max_length(model_dir: str) -> int | None:
    """sentence-transformers' max_seq_length (what the model was trained to), if the directory says."""
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(path):
        n = _json(path).get("max_seq_length")
        return int(n) if isinstance(n, int) and n > 0 else None
    return None


def pool(hidden: torch.Tensor, spans: list[tuple[int, int]], mode: str) -> torch.Tensor:
    """[T, H] packed hidden states -> [B, H], one row per span."""
    rows = []
    for s, e in spans:
        h = hidden[s:e]
        if mode == "cls":
            rows.append(h[0])
        elif mode == "lasttoken":
            rows.append(h[-1])
        elif mode == "max":
            rows.append(h.max(dim=0).values)
        elif mode == "mean":
            rows.append(h.mean(dim=0))
        else:   # mean_sqrt_len
            rows.append(h.sum(dim=0) / (e - s) ** 0.5)
    return torch.stack(rows)


class PoolingRunner:
    """handler/engine/pooling.py's PoolRunner: `pool(inputs, kind)` -> one list of floats each."""

    def __init__(self, model_dir: str, task: str, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, quantize: str | None = None, trust_remote_code: bool = False,
                 normalize: bool | None = None):
        from transformers import AutoConfig, AutoTokenizer

        self.task = task
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except Exception as e:
            raise ModelLoadError(f"cannot read the model in {model_dir}: {type(e).__name__}: {e}") from None
        archs = config.architectures or []
        classifier = any(a.endswith("ForSequenceClassification") for a in archs)
        self.encoder = is_encoder(config)
        if task in ("classify", "rerank") and not (classifier and self.encoder):
            raise ModelLoadError(f"option.task={task} needs a sequence-classification encoder "
                                 f"(BertForSequenceClassification, XLMRobertaForSequenceClassification, ...); "
                                 f"{model_dir} is {', '.join(archs) or config.model_type}")
        self.spec = pooling_spec(model_dir, decoder=not self.encoder)
        if normalize is not None and normalize != self.spec.normalize:
            self.spec = PoolingSpec(self.spec.mode, normalize, f"{self.spec.source}; option.normalize={str(normalize).lower()}",
                                    self.spec.dense)
        self.num_labels = int(getattr(config, "num_labels", 0) or 0) if classifier else 0
        self.id2label = {int(k): v for k, v in (getattr(config, "id2label", None) or {}).items()} if classifier else {}
        with torch.device("cpu"):
            if self.encoder:
                self.model = load_encoder(model_dir, config, self.dtype, classifier, trust_remote_code)
                limit = self.model.max_positions
            else:
                from transformers import AutoModel
                self.model = AutoModel.from_pretrained(model_dir, dtype=self.dtype,
                                                       trust_remote_code=trust_remote_code).eval()
                limit = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.model.to(self.device)
        declared = declared_max_length(model_dir)
        self.max_model_len = min(x for x in (limit, declared, max_model_len) if x)
        self.quantized = self._pack_linears(quantize)
        # after the packing: the Dense heads stay fp32 nn.Linear (a few thousand weights, once per input)
        self.dense = [Dense(os.path.join(model_dir, p)) for p in self.spec.dense]
        self.hidden_size = self.dense[-1].out_features if self.dense else int(config.hidden_size)
        log.info("pooling model: %s (%s), task %s, pooling %s%s%s (%s), max %d tokens, linears %s",
                 config.model_type, ", ".join(archs), task, self.spec.mode,
                 "".join(f" + Dense {d.linear.in_features}->{d.out_features}" for d in self.dense),
                 " + normalize" if self.spec.normalize else "", self.spec.source, self.max_model_len,
                 self.quantized or "packed")

    def _pack_linears(self, quantize: str | None) -> str | None:
        """option.quantize=int8 / int8_weight_only: int8 weights in groups of INT8_GROUP inputs (the
        LLMs' grouped-weight kernel, kernels/cpu_gemm_q4.c); else the CPU panels where they serve."""
        if self.device.type != "cpu":
            return None
        if quantize in ("int8", "int8_weight_only"):
            n = quantize_grouped(self.model)
            log.info("%s: %d linear layers as int8 weights in groups of %d (fp32 activations)", quantize, n,
                     INT8_GROUP)
            return f"{quantize} (weights in groups of {INT8_GROUP})"
        if quantize not in (None, "none"):
            raise ModelLoadError(f"option.quantize={quantize} is not supported for pooling models; allowed: "
                                 "int8, int8_weight_only")
        from handler.model.cpu import can_prepack, prepack_linears
        if can_prepack(self.dtype):
            prepack_linears(self.model)
        return None

    @torch.inference_mode()
    def pool(self, inputs: list[PoolInput], kind: str) -> list[list[float]]:
        """One forward for the batch: `embed` pooled vectors, `classify` the head's logits (fp32 lists)."""
        spans, s = [], 0
        for x in inputs:
            spans.append((s, s + len(x.ids)))
            s += len(x.ids)
        if self.encoder:
            ids = torch.tensor([t for x in inputs for t in x.ids], dtype=torch.long, device=self.device)
            types = torch.tensor([t for x in inputs for t in (x.type_ids or [0] * len(x.ids))],
                                 dtype=torch.long, device=self.device)
            hidden = self.model(ids, types, spans)
            if kind == "classify":
                return self.model.classify(hidden, spans).float().tolist()
        else:   # causal attention: one sequence a forward, unpadded
            hidden = torch.cat([self.model(input_ids=torch.tensor([x.ids], device=self.device)).last_hidden_state[0]
                                for x in inputs])
        out = pool(hidden, spans, self.spec.mode).float()
        for d in self.dense:
            out = d(out).float()
        if self.spec.normalize:
            out = torch.nn.functional.normalize(out, p=2, dim=-1)
        return out.tolist()
