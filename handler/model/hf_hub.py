"""A Hugging Face Hub model id (`HF_MODEL_ID=org/name`, `option.model_id=org/name`) -> a local directory.

As LMI (srv/util/ModelStore.java: a model_id that is neither a local path nor s3:// is a hub id), the
files are fetched with huggingface_hub.snapshot_download into `$LMI_MODEL_CACHE/hub` (the hub's own
cache layout, so a second start, or HF_HUB_OFFLINE=1, uses what is there). Only what serving needs:
safetensors weights and their index, config and generation config, tokenizer files, chat template.
`option.revision` picks a branch, tag or commit; HF_TOKEN, HF_ENDPOINT (a private mirror) and
HF_HUB_OFFLINE are huggingface_hub's own variables. Every failure is one line naming the id.
"""
from __future__ import annotations

import logging
import os

from handler.config.switches import switch

log = logging.getLogger("handler.hub")

# What the server reads from a model directory (weights, config, tokenizer, template); not *.bin,
# *.pt, *.gguf, onnx or flax copies, which hub repos often carry besides.
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                  "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.json",
                  "chat_template.jinja", "preprocessor_config.json"]
class HubModelError(Exception):
    """A hub model cannot be fetched; the message is one line naming the id."""


def cache_dir() -> str:
    return os.path.join(switch("LMI_MODEL_CACHE"), "hub")


def resolve_model_dir(model_id: str, revision: str | None = None) -> str:
    """snapshot_download of the files serving needs -> the local snapshot directory."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    at = f"{model_id}@{revision}" if revision else model_id
    where = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    log.info("model %s: fetching from the hub (%s) into %s", at, where, cache_dir())
    try:
        path = snapshot_download(model_id, revision=revision, cache_dir=cache_dir(), allow_patterns=ALLOW_PATTERNS)
    except RevisionNotFoundError:
        raise HubModelError(f"option.revision={revision}: no such revision of hub model {model_id} "
                            f"at {where}") from None
    except GatedRepoError:
        raise HubModelError(f"hub model {model_id} is gated: accept its terms on the hub and set HF_TOKEN "
                            "to a token of that account") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"hub model {model_id} not found at {where} (a private repository needs "
                            "HF_TOKEN; check the id)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if switch_offline() else f"the hub at {where} cannot be reached"
        raise HubModelError(f"hub model {at}: {why} and {cache_dir()} holds no copy of it") from None
    except Exception as e:      # connection refused, TLS, a broken mirror: one line
        raise HubModelError(f"hub model {at}: cannot fetch from {where}: {type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HubModelError(f"hub model {at} has no config.json: not a Hugging Face model this server loads")
    log.info("model %s: %s", at, path)
    return path


def switch_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
