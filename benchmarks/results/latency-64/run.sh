#!/bin/sh
# Issue 64: before (main's tip, served from /work/main) against after (this branch with option.target_tpot_ms=100),
# SmolLM2-135M fp32, 50 clients, fresh servers per repetition (cpu-135m runs one server at a time), order rotating;
# then the priority flood. Each under the shared benchmark lock; the host's load is logged before and after.
set -e
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/latency-64
uptime > $OUT/load.txt
HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python -m handler bench compare --preset cpu-135m --workloads lmi \
    --dtype fp32 --reps 2 --requests 100 --model-dir .cache/models/smollm2 --no-peak --no-progress \
    --arm before=paged@/work/main --arm after=paged+option.target_tpot_ms=100 --slo-ttft-ms 2000 --slo-tpot-ms 150 \
    --out $OUT/fp32 2> $OUT/fp32.log
uptime >> $OUT/load.txt
HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python benchmarks/priority_flood.py --model-dir .cache/models/smollm2 \
    --reps 1 --short-requests 20 --long-tokens 200 --long-new 48 --out $OUT/priority.json 2> $OUT/priority.log > /dev/null
uptime >> $OUT/load.txt
