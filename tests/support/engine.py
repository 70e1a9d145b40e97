"""The engine in-process for tests: prompts, one property set per strategy, build/run/drain helpers."""
from __future__ import annotations

import os

from handler.config import load_config
from handler.engine.loop import ErrorEvent
from handler.server import build_engine


PROMPTS = [
    "def main(argv):\n    parser = argparse.ArgumentParser()\n",
    "x = 1",
    "import collections\nimport functools\nimport itertools\nimport operator\n" * 3,
    "while True:",
    "# -*- coding: utf-8 -*-\n\"\"\"Utilities for strings.\"\"\"\n",
    "if __name__ == '__main__':\n    main()",
]


NEW = [20, 7, 31, 3, 14, 25]


STRATEGIES = {
    "none": {"option.rolling_batch": "disable"},   # one at a time: LMI 0.27+ defaults to auto (option.lmi_compat)
    "dynamic": {"batch_size": "4", "max_batch_delay": "20"},
    "rolling": {"option.rolling_batch": "auto", "option.paged_attention": "false",
                "option.max_rolling_batch_size": "4", "option.max_rolling_batch_prefill_tokens": "40",
                "option.kv_cache_tokens": "512"},
    "paged": {"option.rolling_batch": "auto", "option.paged_attention": "true",
              "option.max_rolling_batch_size": "6", "option.max_rolling_batch_prefill_tokens": "40",
              "option.kv_cache_tokens": "256", "option.block_size": "8"},
}


def make_engine(model_dir, tmp_path, props: dict, arms=None):
    """A started engine over serving.properties `props`; `arms`: the runner's CPU A/B arms
    (handler/model/cpu.py Arms; None: a server's)."""
    path = os.path.join(str(tmp_path), "serving.properties")
    with open(path, "w") as f:
        f.write("\n".join(f"{k}={v}" for k, v in props.items()) + "\n")
    return build_engine(load_config(path, model_dir, env={}), arms=arms)


def run_all(engine, prompts, params_list):
    """Submit everything at once; returns per prompt (token ids, DoneEvent)."""
    chans = [engine.submit([engine.tokenize(p)], params)[0] for p, params in zip(prompts, params_list)]
    out = []
    for ch in chans:
        ids = []
        while True:
            ev = ch.events.get(timeout=300)
            assert not isinstance(ev, ErrorEvent), ev
            ids.append(ev.id)
            if ev.done:
                out.append((ids, ev.done))
                break
    return out


def assert_drained(engine):
    import time
    for _ in range(100):       # the engine thread frees blocks right after the last event
        if engine.blocks.num_free == engine.blocks.num_blocks:
            break
        time.sleep(0.02)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    engine.blocks.check_invariants()


def driven_by_hand(engine):
    """Stop the engine's thread: the test runs its iterations itself."""
    return engine.run_by_hand()


def _drained(q) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out
