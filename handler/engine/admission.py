"""The one place a request enters the engine: its sequences counted against the engine's
capacity and each prompt checked to fit the model and the KV cache. No torch.

Capacity, in sequences: the running batch (`max_batch_size`) plus `job_queue_size` waiting. A
sequence counts from its admission until the engine ends it, so "running + waiting" needs no
snapshot of the scheduler, and a server exactly at capacity (every slot running, the queue full)
still admits the last one. Thread-safe: HTTP threads admit, the engine thread releases.
"""
from __future__ import annotations

import threading

from handler.engine.request import SamplingParams


class QueueFull(Exception):
    pass


class CapacityError(ValueError):
    """A request that can never fit in the KV cache or the model's context; `field` names the
    part of the request to change (str(e) is "field: message")."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Admission:
    def __init__(self, max_running: int, max_waiting: int, max_model_len: int, kv_tokens: int):
        self.capacity = max_running + max_waiting
        self.max_waiting = max_waiting
        self.max_model_len = max_model_len
        self.kv_tokens = kv_tokens          # token slots in the KV pool
        self.live = 0                       # sequences admitted and not yet ended
        self.rejected = 0                   # prompts refused because the queue was full
        self._lock = threading.Lock()

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """CapacityError when this prompt with params.max_new_tokens can never run."""
        cap = self.max_model_len
        # An empty prompt would be planned as a sampling item with no tokens to sample from.
        if prompt_len < 1:
            raise CapacityError("inputs", "the prompt has no tokens after tokenization")
        if prompt_len >= cap:
            raise CapacityError("inputs", f"the prompt has {prompt_len} tokens; this model allows "
                                f"at most {cap - 1} prompt tokens (max_model_len={cap})")
        need = prompt_len + params.max_new_tokens
        if need > cap:
            raise CapacityError("parameters.max_new_tokens", f"prompt ({prompt_len} tokens) + "
                                f"max_new_tokens ({params.max_new_tokens}) exceeds this model's "
                                f"{cap} tokens (max_model_len); ask for at most {cap - prompt_len}")
        room = self.kv_tokens
        if prompt_len >= room:
            raise CapacityError("inputs", f"the prompt has {prompt_len} tokens; the KV cache holds "
                                f"{room} (option.kv_cache_tokens), so at most {room - 1} prompt tokens")
        if need > room:
            raise CapacityError("parameters.max_new_tokens", f"prompt ({prompt_len} tokens) + "
                                f"max_new_tokens ({params.max_new_tokens}) needs {need} KV slots; "
                                f"the KV cache holds {room} (option.kv_cache_tokens)")

    def admit(self, prompt_lens: list[int], params: SamplingParams) -> None:
        """All of these prompts (params.num_samples sequences each) or none: CapacityError when
        one can never fit, QueueFull when there is no room for all their sequences."""
        for n in prompt_lens:
            self.check_fits(n, params)
        k = len(prompt_lens) * params.num_samples
        with self._lock:
            if self.live + k > self.capacity:
                self.rejected += len(prompt_lens)
                raise QueueFull(f"the queue is full ({self.max_waiting} requests waiting; job_queue_size)")
            self.live += k

    def release(self, n: int = 1) -> None:
        """n admitted sequences ended."""
        with self._lock:
            self.live -= n
