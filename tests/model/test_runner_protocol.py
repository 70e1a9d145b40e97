"""The real ModelRunner satisfies the engine's Runner Protocol (handler/engine/types.py), on a
tiny model."""
from __future__ import annotations

import inspect

from handler.engine.request import SamplingParams
from handler.engine.types import KVPool, Runner, SampleResult, SamplerState, StepItem
from handler.model.runner import ModelRunner


def test_model_runner_satisfies_the_runner_protocol(demo_model_dir):
    r = ModelRunner(demo_model_dir, device="cpu", dtype="fp32", block_size=4, kv_cache_tokens=64)
    assert isinstance(r, Runner)
    assert isinstance(r.kv, KVPool) and isinstance(r.kv.num_blocks, int)
    assert isinstance(r.sampler, SamplerState)
    for name in ("step", "release"):    # the Protocol's call shapes bind to the real methods
        want = inspect.signature(getattr(Runner, name)).parameters
        inspect.signature(getattr(r, name)).bind(*(None for p in want if p != "self"))
    ids = r.tokenizer("def f(x):")["input_ids"]
    item = StepItem(7, ids, 0, list(range(-(-len(ids) // 4))), True,
                    SamplingParams(max_new_tokens=1), ids, len(ids))
    (res,) = r.step([item], [])
    assert isinstance(res, SampleResult) and isinstance(res.token, int)
    r.release(7)
    r.sampler.reset()
