"""Multi-LoRA: PEFT adapters on one base model, applied per row inside one packed forward.

Three tiers, as vLLM / S-LoRA:
  registry   name -> source directory (the model directory's `adapters/<name>/` at start-up, or
             registered at run time through the management routes)
  CPU cache  at most `max_cpu_loras` adapters read into memory (least recently used evicted);
             reading happens in the HTTP thread that registers or first uses an adapter, never in
             the engine thread
  slots      `max_loras` device slots per wrapped linear layer: A [S, R, in], B [S, out, R]
             (R = max_lora_rank, zero-padded); the scheduler admits at most `max_loras` distinct
             adapters at once, so one step never needs more. Filling a slot is a device copy.

The forward (Punica/S-LoRA style): every target `nn.Linear` is wrapped by `LoRALinear`, which
runs the base matmul for all T rows, then for each adapter in the step adds
`(x[rows] @ A^T) @ B^T` (B pre-scaled by alpha/r) to its rows. The runner publishes the step's
row groups in a thread-local `StepLoras` for the duration of the forward; without one (e.g.
`model.generate` on the same object) the wrapper is the base layer.

A request carries its `Adapter` object in `SamplingParams.adapter` (chosen by the protocol layer),
so removing an adapter from the registry never breaks a sequence already running with it.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

log = logging.getLogger("lmi.lora")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTERS_DIR = "adapters"       # LMI's layout: MODEL_DIR/adapters/<name>/
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# PEFT's tensor names: base_model.model.<module>.lora_A[.<adapter>].weight
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
_uids = itertools.count(1)


def fetch_s3(name: str, uri: str) -> str:
    """An adapter under s3://bucket/prefix, downloaded (as LMI does) into
    $LMI_MODEL_CACHE/adapters/<bucket>/<prefix> (files already there with the same size and ETag
    are kept); the local directory. Raises AdapterError with the one-line reason."""
    from pathlib import Path

    from handler.config.switches import switch
    from handler.model.s3 import S3ModelError, parse_s3_uri, resolve_model_dir
    try:
        bucket, prefix = parse_s3_uri(uri)
        return resolve_model_dir(uri, str(Path(switch("LMI_MODEL_CACHE"), "adapters", bucket, prefix.strip("/"))))
    except S3ModelError as e:
        raise AdapterError(f"adapter {name!r} ({uri}): {e}") from None


class AdapterError(ValueError):
    """A bad adapter: one line naming the adapter, its directory and what is wrong."""


@dataclass(eq=False)
class Adapter:
    name: str
    src: str
    rank: int
    # module name -> (A [r, in], B*scale [out, r]) on the CPU, in the model's dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # One per registration: the same when the CPU cache re-reads it (its slots and prefix-cache
    # blocks stay valid), a new one when a name is registered again.
    uid: int = field(default_factory=lambda: next(_uids))

    def __repr__(self) -> str:
        return f"Adapter({self.name!r}, rank={self.rank}, modules={len(self.weights)})"


def target_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Linear layers an adapter may target: every nn.Linear but the output head."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n: m for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, LoRALinear)) and m is not out_emb
            and not isinstance(getattr(m, "base", None), LoRALinear)}


def read_adapter(name: str, src: str, shapes: dict[str, tuple[int, int]], max_rank: int,
                 dtype: torch.dtype = torch.float32, uid: int | None = None) -> Adapter:
    """A PEFT LoRA directory -> Adapter, checked against the base model's linear layers
    (`shapes`: module name -> (in_features, out_features)). Raises AdapterError."""
    from safetensors import safe_open

    def bad(msg: str) -> AdapterError:
        return AdapterError(f"adapter {name!r} ({src}): {msg}")

    if not NAME.fullmatch(name or ""):
        raise AdapterError(f"adapter name {name!r} is not valid: use letters, digits, '.', '_' or "
                           "'-' (at most 128 characters, not starting with a punctuation mark)")
    if not os.path.isdir(src):
        raise bad("no such directory")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(src, f)):
            extra = " (adapter_model.bin is not read: save with safe_serialization)" \
                if f == WEIGHTS_FILE and os.path.isfile(os.path.join(src, "adapter_model.bin")) else ""
            raise bad(f"missing {f}; a PEFT LoRA adapter directory holds {CONFIG_FILE} and "
                      f"{WEIGHTS_FILE}{extra}")
    try:
        with open(os.path.join(src, CONFIG_FILE)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise bad(f"{CONFIG_FILE} is unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise bad(f"{CONFIG_FILE} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise bad(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise bad(f"r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    if r > max_rank:
        raise bad(f"rank r={r} is above option.max_lora_rank={max_rank}; raise option.max_lora_rank")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)")):
        if cfg.get(key):
            raise bad(f"{why} adapters are not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise bad(f"{key} is not supported (set for {sorted(cfg[key])[:3]})")
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg['bias']!r} is not supported (only bias='none')")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        patt = re.compile(targets)
        wanted = {m for m in shapes if patt.fullmatch(m)}
        if not wanted:
            raise bad(f"target_modules {targets!r} matches no linear layer of the base model")
    elif isinstance(targets, list) and targets:
        wanted = set()
        for t in targets:
            hit = {m for m in shapes if m == t or m.endswith("." + str(t))}
            if not hit:
                raise bad(f"unknown target module {t!r}: the base model's linear layers are named "
                          f"{', '.join(sorted({m.rsplit('.', 1)[-1] for m in shapes}))}")
            wanted |= hit
    else:
        raise bad(f"target_modules must be a non-empty list or a regular expression, got {targets!r}")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(os.path.join(src, WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise bad(f"unexpected tensor {key!r} in {WEIGHTS_FILE} (only lora_A/lora_B weights)")
                pairs.setdefault(m["module"], {})[m["ab"]] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as e:
        raise bad(f"{WEIGHTS_FILE} is unreadable: {type(e).__name__}: {e}") from None
    if not pairs:
        raise bad(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for module, ab in sorted(pairs.items()):
        if module not in shapes:
            raise bad(f"unknown target module {module!r}: not a linear layer of the base model "
                      "(an adapter for another base model?)")
        if set(ab) != {"A", "B"}:
            raise bad(f"{module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[module]
        rm = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out or b.shape[1] != rm:
            raise bad(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the base "
                      f"layer ({n_in} in, {n_out} out): expected [r, {n_in}] / [{n_out}, r] "
                      "(an adapter for another base model?)")
        if rm > max_rank:
            raise bad(f"{module}: rank {rm} is above option.max_lora_rank={max_rank}")
        weights[module] = (a.to(dtype).contiguous(), (b.double() * scale).to(dtype).contiguous())
    adapter = Adapter(name, os.path.abspath(src), r, weights)
    if uid is not None:
        adapter.uid = uid
    return adapter


class StepLoras:
    """One step's adapters: (slot, token rows [n] int64 on the device) per adapter in the step."""

    def __init__(self, groups: list[tuple[int, torch.Tensor]]):
        self.groups = groups


_active = threading.local()


@contextmanager
def step_context(step: StepLoras | None):
    prev = getattr(_active, "step", None)
    _active.step = step
    try:
        yield
    finally:
        _active.step = prev


class LoRALinear(nn.Module):
    """A base nn.Linear plus per-slot low-rank updates for the rows of the current step."""

    def __init__(self, base: nn.Linear, slots: int, max_rank: int):
        super().__init__()
        self.base = base
        self.slots, self.max_rank = slots, max_rank
        self.lora_a: torch.Tensor | None = None     # [S, R, in], allocated on first use
        self.lora_b: torch.Tensor | None = None     # [S, out, R]
        self.filled = [False] * slots               # slot holds a non-zero update for this layer

    @property
    def weight(self):       # code that reads the base layer's attributes keeps working
        return self.base.weight

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    def load(self, slot: int, ab: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if ab is None:
            self.filled[slot] = False
            return
        w = self.base.weight    # its dtype and device (a packed or quantized layer keeps an empty one)
        if self.lora_a is None:
            self.lora_a = torch.zeros(self.slots, self.max_rank, self.in_features, dtype=w.dtype, device=w.device)
            self.lora_b = torch.zeros(self.slots, self.out_features, self.max_rank, dtype=w.dtype, device=w.device)
        a, b = ab
        scale = getattr(self.base, "input_scale", None)   # a smoothed layer sees x / s (handler/model/quant.py)
        if scale is not None:
            a = a * scale.to(a.dtype)
        r = a.shape[0]
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_a[slot, :r].copy_(a, non_blocking=True)
        self.lora_b[slot, :, :r].copy_(b, non_blocking=True)
        self.filled[slot] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = getattr(_active, "step", None)
        if step is None or self.lora_a is None:
            return y
        xf = x.reshape(-1, x.shape[-1])     # [T, in]
        yf = y.view(-1, y.shape[-1])        # [T, out]
        for slot, rows in step.groups:
            if self.filled[slot]:
                yf.index_add_(0, rows, (xf[rows] @ self.lora_a[slot].T) @ self.lora_b[slot].T)
        return y


class LoraManager:
    """The registry, the CPU cache and the device slots of one model (see the module doc)."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int):
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu = max(max_cpu_loras, max_loras)
        self.dtype = next(model.parameters()).dtype
        self.layers: dict[str, LoRALinear] = {}
        for name, lin in target_linears(model).items():
            parent, _, attr = name.rpartition(".")
            wrapped = LoRALinear(lin, max_loras, max_lora_rank)
            setattr(model.get_submodule(parent) if parent else model, attr, wrapped)
            self.layers[name] = wrapped
        self.shapes = {n: (m.in_features, m.out_features) for n, m in self.layers.items()}
        self._lock = threading.Lock()
        self.sources: dict[str, tuple[str, int]] = {}        # registered name -> (directory, uid)
        self.cache: OrderedDict[str, Adapter] = OrderedDict()  # read adapters, LRU first
        self.slot_uid: list[int | None] = [None] * max_loras   # engine thread only
        self.slot_used: list[int] = [0] * max_loras
        self._clock = itertools.count(1)

    # ---- registry (HTTP threads and start-up)
    def register(self, name: str, src: str) -> Adapter:
        """Read and check the adapter, then list it. Raises AdapterError (bad adapter) or
        KeyError (the name is taken). An s3:// src is downloaded first (fetch_s3)."""
        with self._lock:
            if name in self.sources:
                raise KeyError(name)
        if src[:5].lower() == "s3://":
            src = fetch_s3(name, src)
        adapter = read_adapter(name, src, self.shapes, self.max_rank, self.dtype)
        with self._lock:
            if name in self.sources:
                raise KeyError(name)
            self.sources[name] = (adapter.src, adapter.uid)
            self._cache_put(adapter)
        log.info("adapter %s registered from %s: rank %d, %d layers", name, adapter.src,
                 adapter.rank, len(adapter.weights))
        return adapter

    def register_dir(self, model_dir: str) -> list[str]:
        """Every MODEL_DIR/adapters/<name>/ (LMI's layout); the first bad one raises."""
        root = os.path.join(model_dir, ADAPTERS_DIR)
        if not os.path.isdir(root):
            return []
        names = sorted(n for n in os.listdir(root) if os.path.isdir(os.path.join(root, n)))
        for n in names:
            self.register(n, os.path.join(root, n))
        return names

    def unregister(self, name: str) -> bool:
        with self._lock:
            if self.sources.pop(name, None) is None:
                return False
            self.cache.pop(name, None)
        log.info("adapter %s unregistered", name)
        return True

    def list(self) -> list[dict]:
        with self._lock:
            return [{"name": n, "src": s, "pin": False} for n, (s, _) in self.sources.items()]

    def get(self, name: str) -> Adapter | None:
        """The adapter a request names (read again from its directory if the CPU cache dropped
        it); None when no such adapter is registered."""
        with self._lock:
            entry = self.sources.get(name)
            if entry is None:
                return None
            a = self.cache.get(name)
            if a is not None:
                self.cache.move_to_end(name)
                return a
        src, uid = entry
        a = read_adapter(name, src, self.shapes, self.max_rank, self.dtype, uid)
        with self._lock:
            if self.sources.get(name) != entry:     # removed or replaced meanwhile
                return self.cache.get(name) if name in self.sources else None
            return self._cache_put(a)

    def _cache_put(self, adapter: Adapter) -> Adapter:
        self.cache[adapter.name] = adapter
        self.cache.move_to_end(adapter.name)
        while len(self.cache) > self.max_cpu:
            old, _ = self.cache.popitem(last=False)
            log.info("adapter %s evicted from memory (option.max_cpu_loras=%d)", old, self.max_cpu)
        return adapter

    # ---- one step (engine thread)
    def step(self, items) -> StepLoras | None:
        """Slots for the adapters of a step's items (in pack order) and their token rows."""
        rows: dict[int, list[int]] = {}
        adapters: dict[int, Adapter] = {}
        start = 0
        for it in items:
            n = len(it.token_ids)
            a = it.params.adapter
            if a is not None:
                adapters[a.uid] = a
                rows.setdefault(a.uid, []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        if len(rows) > self.max_loras:
            raise RuntimeError(f"{len(rows)} adapters in one step; option.max_loras={self.max_loras}")
        groups = []
        dev = next(iter(self.layers.values())).base.weight.device if self.layers else None
        for uid, r in rows.items():
            slot = self._slot(adapters[uid], set(rows))
            groups.append((slot, torch.tensor(r, dtype=torch.int64, device=dev)))
        return StepLoras(groups)

    def _slot(self, adapter: Adapter, in_step: set[int]) -> int:
        tick = next(self._clock)
        if adapter.uid in self.slot_uid:
            s = self.slot_uid.index(adapter.uid)
        else:   # the least recently used slot that this step does not need
            s = min((i for i in range(self.max_loras) if self.slot_uid[i] not in in_step),
                    key=lambda i: self.slot_used[i])
            for name, layer in self.layers.items():
                layer.load(s, adapter.weights.get(name))
            self.slot_uid[s] = adapter.uid
        self.slot_used[s] = tick
        return s
