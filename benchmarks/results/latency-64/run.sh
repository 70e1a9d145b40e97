#!/bin/sh
# Issue 64, as run on 2026-11-28 (each step under the shared benchmark lock; the host's load logged in load.txt).
# /tmp/main-bd3: `git worktree add --detach /tmp/main-bd3 bd3ee64` (main at this branch's base); /work/main: main's tip.
set -e
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/latency-64
M=$PWD/.cache/models/smollm2
# 1. before (main's tip) against after (option.target_tpot_ms=100), two repetitions, order rotated
flock /tmp/bench.lock .venv/bin/python -m handler bench compare --preset cpu-135m --workloads lmi --dtype fp32 --reps 2 \
    --requests 100 --model-dir $M --no-peak --no-progress --arm before=paged@/work/main \
    --arm after=paged+option.target_tpot_ms=100 --slo-ttft-ms 2000 --slo-tpot-ms 150 --out $OUT/fp32 2> $OUT/fp32.log
# 2. the control: main at the base, main's tip, this branch without and with the target, one repetition
flock /tmp/bench.lock .venv/bin/python -m handler bench compare --preset cpu-135m --workloads lmi --dtype fp32 --reps 1 \
    --requests 100 --model-dir $M --no-peak --no-progress --arm base=paged@/tmp/main-bd3 --arm before=paged@/work/main \
    --arm ctl=paged --arm after=paged+option.target_tpot_ms=100 --slo-ttft-ms 2000 --slo-tpot-ms 150 \
    --out $OUT/fp32-control 2> $OUT/fp32-control.log
# 3. priority under a flood, without and with the TPOT target
flock /tmp/bench.lock .venv/bin/python benchmarks/priority_flood.py --model-dir $M --reps 1 --short-requests 20 \
    --long-tokens 200 --long-new 48 --out $OUT/priority.json 2> $OUT/priority.log > /dev/null
flock /tmp/bench.lock .venv/bin/python benchmarks/priority_flood.py --model-dir $M --reps 1 --short-requests 20 \
    --long-tokens 200 --long-new 48 --extra "option.target_tpot_ms=100" --out $OUT/priority-tpot100.json \
    2> $OUT/priority-tpot100.log > /dev/null
