"""option.task resolved against the checkpoint: what the model serves (`generate`, `text_embedding`,
`classify`, `rerank`). Plain JSON reads (config.json, sentence-transformers' modules.json); no torch.

Detection is only where it is unambiguous: an encoder's architecture or a sentence-transformers
directory is an embedder; a `*ForSequenceClassification` head is a cross-encoder (one label: `rerank`)
or a classifier; everything else generates. A decoder (Qwen, Llama) embeds only when option.task asks.
"""
from __future__ import annotations

import json
import os

POOLING_TASKS = ("text_embedding", "classify", "rerank")
# model_type values whose checkpoints are encoders (bidirectional, no generation).
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "modernbert", "electra", "mpnet",
                 "deberta", "deberta-v2", "nomic_bert", "new")


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def detect_task(model_dir: str) -> str:
    """The task a checkpoint serves by itself (module doc)."""
    cfg = _read_json(os.path.join(model_dir, "config.json")) or {}
    archs = cfg.get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in archs):
        labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
        return "rerank" if labels == 1 else "classify"
    if os.path.isfile(os.path.join(model_dir, "modules.json")):
        return "text_embedding"
    if any(str(a).endswith("ForCausalLM") or str(a).endswith("LMHeadModel") for a in archs):
        return "generate"
    if cfg.get("model_type") in ENCODER_TYPES:
        return "text_embedding"
    return "generate"


def resolve_task(task: str | None, model_dir: str | None) -> str:
    """option.task as given, else detected from model_dir (`generate` without one)."""
    if task is not None:
        return task
    return detect_task(model_dir) if model_dir and os.path.isdir(model_dir) else "generate"
