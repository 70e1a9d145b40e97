"""Rank 0 of a degree-2 CPU group, as a script (the test process stays out of torch.distributed):
loads one model once, runs every strategy over it with all prompts submitted at once, prints
{strategy: [token ids per prompt]} as JSON. Used by tests/model/test_tp.py.

    python -m tests.support.tp_parity MODEL_DIR PROPS_DIR [cpu|cuda] [QUANTIZE] [KV_CACHE_DTYPE]

With QUANTIZE (option.quantize, e.g. int8) only the paged strategy runs: each rank quantizes
its own shards. KV_CACHE_DTYPE (option.kv_cache_dtype, e.g. int8): every rank's pool in it.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

from handler.config import load_config
from handler.engine.loop import ErrorEvent
from handler.server import build_runner, engine_for
from handler.engine.request import SamplingParams
from tests.support.engine import NEW, PROMPTS, STRATEGIES, run_all

NEW_TP = [min(n, 10) for n in NEW]   # few tokens: two ranks share two cores
SHARED = {"option.tensor_parallel_degree": "2", "option.kv_cache_tokens": "256", "option.block_size": "8"}


def _events(ch) -> list:
    evs = []
    while not evs or not (isinstance(evs[-1], ErrorEvent) or evs[-1].done):
        evs.append(ch.events.get(timeout=300))
    assert not isinstance(evs[-1], ErrorEvent), evs[-1]
    return evs


def _ids(ch) -> list[int]:
    return [e.id for e in _events(ch)]


def main(model_dir: str, props_dir: str, device: str = "cpu", quantize: str = "", kv_cache_dtype: str = "") -> int:
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    on_gpu = {"option.device": "cuda", "option.dtype": "fp32"} if device == "cuda" else {}
    if quantize:
        on_gpu["option.quantize"] = quantize
    if kv_cache_dtype:
        on_gpu["option.kv_cache_dtype"] = kv_cache_dtype

    def cfg_for(strategy: str):
        path = os.path.join(props_dir, f"{strategy}.properties")
        props = {**STRATEGIES[strategy], **SHARED, **on_gpu}
        with open(path, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in props.items()))
        return load_config(path, model_dir, env={}, gpu_count=None if on_gpu else 0)

    def failed(line: str) -> None:
        print(f"error: {line}", file=sys.stderr, flush=True)
        os._exit(3)

    t0 = time.monotonic()
    runner = build_runner(cfg_for("paged"), failed)
    logging.info("loaded in %.1f s", time.monotonic() - t0)
    out = {"kv_heads_per_rank": runner.kv.num_kv_heads, "kv_dtype": str(runner.kv_cache[0][0].dtype)}
    for strategy in ["paged"] if quantize else STRATEGIES:
        engine = engine_for(cfg_for(strategy), runner)
        results = run_all(engine, PROMPTS, [SamplingParams(max_new_tokens=n) for n in NEW_TP])
        out[strategy] = [ids for ids, _ in results]
        engine.shutdown()
        engine._thread.join(30)
        logging.info("%s done at %.1f s", strategy, time.monotonic() - t0)
    # n samples on paged: forks share prompt blocks, copy-on-write copies run on every rank;
    # plus prompt log-probs (rows for every prompt position).
    engine = engine_for(cfg_for("paged"), runner)
    chans = engine.submit([engine.tokenize(p) for p in PROMPTS[:2]], SamplingParams(max_new_tokens=6, n=3))
    out["n_samples"] = [[c.prompt_index, _ids(c)] for c in chans]
    ch = engine.submit([engine.tokenize(PROMPTS[0])], SamplingParams(max_new_tokens=2, decoder_input_details=True))[0]
    out["prefill"] = _events(ch)[-1].done.prefill
    out["forked_prompt_tokens"] = engine.stats()["forked_prompt_tokens"]
    engine.shutdown()
    engine._thread.join(30)
    runner.rank_group.stop()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
