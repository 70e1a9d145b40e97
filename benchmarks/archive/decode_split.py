"""Where a 1-row decode step's time goes: the engine iteration split into its parts.

    python benchmarks/archive/decode_split.py --model-dir DIR [--dtype fp32] [--quantize int8] [--steps 20]
        [--prompt-tokens 60] [--out FILE.json]

One request decodes alone through the paged engine (driven in this thread, no HTTP; as
benchmarks/step_floor.py builds it); each of `--steps` iterations is timed whole and by parts,
each part's wall time summed over the steps (medians of per-step times for the totals):

  engine   one engine iteration (schedule, pack, forward, sample, detokenize, emit)
  runner   runner.step: pack + forward + sample
  forward  the model forward
  stack    the decoder layers in one C call (handler/model/cpu_stack.py's DecodeStack.run)
  head     the final norm's output through lm_head
  sample   the sampler on the logits row

engine - runner is the scheduler and emit; forward - stack - head the embedding, rotary tables,
final norm and the Python around them; runner - forward - sample the packing.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.step_floor import Timed, make_engine, prefill  # noqa: E402
from handler.engine.request import SamplingParams  # noqa: E402
from benchmarks.script_common import model_parser, write_json  # noqa: E402


def main(argv=None) -> int:
    p = model_parser(__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-tokens", type=int, default=60)
    a = p.parse_args(argv)
    engine = make_engine(a.model_dir, a.dtype, 4, 1024, quantize=a.quantize)
    engine.submit([list(range(100, 100 + a.prompt_tokens))],
                  SamplingParams(max_new_tokens=a.steps + 8, ignore_eos=True))
    sched = engine.scheduler
    prefill(engine)
    for _ in range(3):      # warm
        engine.step()
    runner = engine.runner
    model = runner.model
    parts = {"runner": Timed(runner.step), "forward": Timed(runner.forward), "sample": Timed(runner.sampler.sample),
             "head": Timed(model.lm_head.forward)}
    runner.step, runner.forward, runner.sampler.sample = parts["runner"], parts["forward"], parts["sample"]
    model.lm_head.forward = parts["head"]
    if model.decode_stack is not None:
        parts["stack"] = Timed(model.decode_stack.run)
        model.decode_stack.run = parts["stack"]
    per_step = []
    with torch.inference_mode():
        for _ in range(a.steps):
            t = time.perf_counter()
            engine.step()
            per_step.append(time.perf_counter() - t)
    res = {"model_dir": a.model_dir, "dtype": a.dtype, "quantize": a.quantize, "threads": torch.get_num_threads(),
           "engine_ms_median": round(statistics.median(per_step) * 1e3, 2),
           "engine_ms_mean": round(sum(per_step) / len(per_step) * 1e3, 2)}
    for name, t in parts.items():
        res[name + "_ms_mean"] = round(t.total / max(t.calls, 1) * 1e3, 2)
        res[name + "_calls"] = t.calls
    print(json.dumps(res, indent=1))
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
