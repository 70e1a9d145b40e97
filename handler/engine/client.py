"""What the HTTP layer may ask of the engine: `EngineClient`, a narrow facade over an `Engine`.

The engine thread owns the scheduler, the block manager and the runner; HTTP threads (routes,
the /metrics collector) go through this class only, so that none of them reads those objects'
attributes. It holds no state of its own and may be made for any engine at any time (including
a stand-in with only the attributes a test needs: everything is read when asked for).

No torch and no Flask here: it is imported by the HTTP process's routes and metrics.
"""
from __future__ import annotations

import sys

# What submit raises, for callers that import from here only.
from handler.engine.scheduler import CapacityError, QueueFull

__all__ = ["AdapterExists", "AdapterInvalid", "CapacityError", "EngineClient", "LoraDisabled", "PoolingClient",
           "QueueFull", "client_for"]


class AdapterExists(KeyError):
    """register_adapter: the name is already registered."""


class AdapterInvalid(ValueError):
    """register_adapter: the adapter's directory is not a servable LoRA adapter."""


class LoraDisabled(Exception):
    """An adapter operation on a server without option.enable_lora."""


def _adapter_error():
    """handler.model.lora.AdapterError, looked up rather than imported (that module imports
    torch; it is loaded whenever a LoRA manager exists); () catches nothing."""
    return getattr(sys.modules.get("handler.model.lora"), "AdapterError", ())


class EngineClient:
    """Submit / abort, the tokenizer, the longest sequence that fits, the statistics for /metrics,
    health, and the LoRA adapter registry: what the HTTP layer calls, nothing more."""

    pooling = False     # PoolingClient: an embedding / classification model (no generation)
    task = "generate"

    def __init__(self, engine):
        self._engine = engine

    # ---- requests
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def media(self):
        """The model's MediaProcessor (types.py) when it takes images, else None."""
        return getattr(getattr(self._engine, "runner", None), "media", None)

    def submit(self, prompts_ids: list[list[int]], params, stream: bool = True, media=None):
        """Engine.submit: one Channel per sequence, prompt-major (`media`: per prompt its
        ImageRefs). Raises QueueFull or CapacityError (handler.engine.scheduler)."""
        if media:
            return self._engine.submit(prompts_ids, params, stream=stream, media=media)
        return self._engine.submit(prompts_ids, params, stream=stream)

    def abort(self, seq_id: int) -> None:
        self._engine.abort(seq_id)

    # ---- health
    @property
    def healthy(self) -> bool:
        """False when the engine thread died, a step passed its watchdog bound, or a rank failed."""
        check = getattr(self._engine, "check_health", None)
        return bool(check() if check is not None else self._engine.healthy)

    @property
    def error(self) -> str | None:
        return getattr(self._engine, "error", None)

    # ---- limits
    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + generated tokens) the model takes."""
        return self._engine.scheduler.policy.max_model_len

    @property
    def max_sequence_len(self) -> int:
        """The longest sequence that can run: the model's length or the KV cache pool's token
        slots, the smaller."""
        blocks = self._engine.blocks
        return min(self.max_model_len, blocks.num_blocks * blocks.block_size)

    # ---- statistics (/metrics, at scrape time)
    def stats(self) -> dict:
        """Engine.stats() plus the derived KV figures /metrics exports (kv_cache_usage: slots
        allocated / slots in the pool; prefix_cache_occupancy: share of blocks holding a prefix)."""
        eng = self._engine
        stats = eng.stats()
        blocks = eng.blocks
        total = stats.get("kv_tokens_total") or 0
        stats.setdefault("kv_cache_usage", stats["kv_tokens_allocated"] / total if total else 0.0)
        stats.setdefault("prefix_cache_occupancy", len(blocks.cached) / max(1, blocks.num_blocks))
        return stats

    def adapter_counters(self) -> dict[str, dict[str, int]]:
        """LoRA adapter name -> {"requests", "generated_tokens"} (a copy)."""
        return dict(getattr(self._engine, "adapter_counters", {}))

    # ---- LoRA adapters
    def _lora(self):
        return getattr(getattr(self._engine, "runner", None), "lora", None)

    @property
    def lora_enabled(self) -> bool:
        return self._lora() is not None

    def _require_lora(self):
        lora = self._lora()
        if lora is None:
            raise LoraDisabled("LoRA adapters are not enabled on this server "
                               "(set option.enable_lora=true)")
        return lora

    def adapter(self, name: str):
        """The registered adapter `name` (an Adapter, for SamplingParams.adapter), or None.
        Raises LoraDisabled, or ValueError when its files changed since it was registered."""
        return self._require_lora().get(name)

    def adapters(self) -> list[dict]:
        """The registered adapters ({"name", "src", "pin"} each); [] without LoRA."""
        lora = self._lora()
        return lora.list() if lora is not None else []

    def adapter_names(self) -> list[str]:
        return [a["name"] for a in self.adapters()]

    def register_adapter(self, name: str, src: str) -> None:
        """Raises LoraDisabled, AdapterExists (the name is taken) or AdapterInvalid."""
        lora = self._require_lora()
        try:
            lora.register(name, src)
        except KeyError:
            raise AdapterExists(name) from None
        except _adapter_error() as e:
            raise AdapterInvalid(str(e)) from None

    def unregister_adapter(self, name: str) -> bool:
        """False when no such adapter is registered. Raises LoraDisabled."""
        return self._require_lora().unregister(name)


class PoolingClient(EngineClient):
    """The facade over a pooling engine (handler/engine/pooling.py): the same health, limits and
    statistics, and `pool` instead of `submit` (which refuses: a pooling model generates nothing)."""

    pooling = True

    @property
    def task(self) -> str:
        return self._engine.task

    @property
    def hidden_size(self) -> int | None:
        return self._engine.hidden_size

    @property
    def id2label(self) -> dict:
        return self._engine.id2label

    def pool(self, inputs, kind: str):
        """PoolingEngine.submit: one PoolJob. Raises QueueFull or CapacityError."""
        return self._engine.submit(inputs, kind)

    def submit(self, prompts_ids, params, stream: bool = True):
        raise TypeError("a pooling model generates nothing")

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def max_sequence_len(self) -> int:
        return self._engine.max_model_len

    def stats(self) -> dict:
        return self._engine.stats()

    def adapter_counters(self) -> dict:
        return {}

    def _lora(self):
        return None


def client_for(engine) -> EngineClient:
    """The facade that fits the engine: PoolingClient over a pooling engine, else EngineClient."""
    return PoolingClient(engine) if getattr(engine, "pooling", False) else EngineClient(engine)
