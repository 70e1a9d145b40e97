#!/usr/bin/env bash
# Issue 34's CPU-peer comparison on SmolLM2-135M-Instruct (real weights), as committed here.
# Needs the peers: python -m handler bench install-peer vllm|openvino|llamacpp (make peers).
# Each run takes /tmp/bench.lock (one heavy benchmark at a time on a shared host) and notes
# the load average before and after it in load.txt.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/cpu-peers-135m
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-.cache/models/smollm2}
export HF_HUB_OFFLINE=1
note() { echo "$(date -u +%FT%TZ) $1: $(uptime)" | tee -a "$OUT/load.txt"; }

if [ "${1:-all}" = all ] || [ "$1" = fp32 ]; then
  # fp32: every cell, with the load curve at 1, 4, 16 and 50 clients (50 = the headline)
  flock /tmp/bench.lock bash -c "$(declare -f note); OUT=$OUT; note 'fp32 start'; \
    $PY -m handler bench compare --preset cpu-135m --workloads lmi --dtype fp32 --reps 2 \
      --clients 1,4,16,50 --model-dir $MODEL --no-progress \
      --only paged,paged_int8,vllm_cpu,openvino,openvino_int8,llamacpp,llamacpp_q8 \
      --out $OUT/fp32 > $OUT/fp32.log 2>&1; note 'fp32 end'"
fi
if [ "${1:-all}" = all ] || [ "$1" = bf16 ]; then
  # bf16: the cells that have a bf16 path, 50 clients
  flock /tmp/bench.lock bash -c "$(declare -f note); OUT=$OUT; note 'bf16 start'; \
    $PY -m handler bench compare --preset cpu-135m --workloads lmi --dtype bf16 --reps 2 \
      --model-dir $MODEL --no-progress \
      --only paged,vllm_cpu,openvino,openvino_int8,llamacpp,llamacpp_q8 \
      --out $OUT/bf16 > $OUT/bf16.log 2>&1; note 'bf16 end'"
fi
