"""An engine in this process, driven by hand through its public `Engine.step()` (no HTTP, no engine
thread): what `bench engine-loop` and the step benchmarks in benchmarks/ time."""
from __future__ import annotations

import os
import tempfile


def make_engine(model_dir: str, dtype: str, batch: int, kv_tokens: int, prefill_tokens: int = 8192,
                quantize: str | None = None, arms=None, properties: dict | None = None):
    """A paged engine (running limit `batch`, `kv_tokens` of KV, `prefill_tokens` a step) with its
    thread stopped: the caller runs `engine.step()`. `arms`: the runner's CPU A/B arms
    (handler/model/cpu.py Arms; None: a server's defaults); `properties`: more serving.properties
    keys (a scheduling policy: option.target_tpot_ms, ...). The CPU kernels' build is
    LMI_CPU_KERNELS as a server reads it."""
    from handler.config import load_config
    from handler.server import build_engine
    props = {"option.rolling_batch": "auto", "option.paged_attention": "true",
             "option.max_rolling_batch_size": batch, "option.max_rolling_batch_prefill_tokens": prefill_tokens,
             "option.kv_cache_tokens": kv_tokens, "option.dtype": dtype,
             "option.cpu_kernels": os.environ.get("LMI_CPU_KERNELS", "auto")}
    if quantize:
        props["option.quantize"] = quantize
    props.update(properties or {})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "serving.properties")
        with open(path, "w") as f:
            f.write("\n".join(f"{k}={v}" for k, v in props.items()) + "\n")
        engine = build_engine(load_config(path, model_dir, env={}), arms=arms)
    return engine.run_by_hand()


def prefill(engine) -> None:
    """Step an engine driven by hand until every sequence submitted has its first token."""
    sched = engine.scheduler
    engine.step()       # takes in what was submitted
    while any(s.num_output == 0 for s in sched.running) or sched.waiting:
        engine.step()
