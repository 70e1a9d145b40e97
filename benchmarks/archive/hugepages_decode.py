"""A 1-row decode step through the paged engine with the packed weights in huge pages or not
(LMI_CPU_HUGEPAGES=auto against 0), arms alternating.

    python benchmarks/archive/hugepages_decode.py --model-dir DIR [--quantize int8_weight_only] [--rounds 3]
        [--steps 30] [--out FILE.json]

Each round runs benchmarks/archive/decode_split.py once per arm, each in its own process (the switch is
read when the weights are packed at load), the arms' order flipping every round. Reported per arm:
each round's engine iteration median (ms/step) and the stack's and head's means (the streamed
GEMMs), their medians over the rounds, and off/on per round.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.script_common import model_parser, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {"huge": "auto", "4k": "0"}
KEYS = ("engine_ms_median", "stack_ms_mean", "head_ms_mean")


def one(model_dir: str, dtype: str, quantize: str | None, steps: int, setting: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "split.json")
        cmd = [sys.executable, os.path.join(HERE, "decode_split.py"), "--model-dir", model_dir, "--dtype", dtype,
               "--steps", str(steps), "--out", out]
        if quantize:
            cmd += ["--quantize", quantize]
        env = {**os.environ, "LMI_CPU_HUGEPAGES": setting}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    p = model_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args(argv)
    per = {arm: {k: [] for k in KEYS} for arm in ARMS}
    for r in range(a.rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            res = one(a.model_dir, a.dtype, a.quantize, a.steps, ARMS[arm])
            for k in KEYS:
                per[arm][k].append(res.get(k))
            print(f"round {r} {arm}: " + ", ".join(f"{k} {res.get(k)}" for k in KEYS), flush=True)
    summary = {arm: {k: statistics.median(v) for k, v in d.items() if None not in v} for arm, d in per.items()}
    ratio = [off / on for on, off in zip(per["huge"]["engine_ms_median"], per["4k"]["engine_ms_median"])]
    res = {"model_dir": a.model_dir, "dtype": a.dtype, "quantize": a.quantize, "steps": a.steps,
           "rounds": per, "median": summary, "engine_4k_over_huge_per_round": [round(x, 4) for x in ratio]}
    print(json.dumps({"median": summary, "engine_4k_over_huge_per_round": res["engine_4k_over_huge_per_round"]},
                     indent=1))
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
