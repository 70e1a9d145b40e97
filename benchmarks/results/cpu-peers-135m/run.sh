#!/usr/bin/env bash
# Issue 34's CPU-peer comparison on SmolLM2-135M-Instruct (real weights), as committed here.
# Needs the peers: python -m handler bench install-peer vllm|openvino|llamacpp (make peers).
# Each part takes /tmp/bench.lock (one heavy benchmark at a time on a shared host) and notes the
# load average before and after each run in $OUT/load.txt.
#   ./run.sh [all|fp32|bf16|strategies|more|bf16curve|fp32curve]   OUT=<results dir> (default: this directory)
# all = fp32 + bf16 + strategies; more = llama.cpp with split KV beside paged (fp32); bf16curve /
# fp32curve = the bf16 / fp32 and int8 cells with the load curve, llama.cpp left out (2.7x-4.8x
# behind at 50 clients and the slowest run: `fp32` has it).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-benchmarks/results/cpu-peers-135m}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-.cache/models/smollm2}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OUT PY MODEL
note() { echo "$(date -u +%FT%TZ) $1: $(uptime)" | tee -a "$OUT/load.txt"; }
export -f note
CMP="$PY -m handler bench compare --preset cpu-135m --workloads lmi --reps 2 --model-dir $MODEL --no-progress"
part() { [ "${1}" = "$PART" ] || { [ "$PART" = all ] && [ "$1" != more ] && [ "${1%curve}" = "$1" ]; }; }
PART=${1:-all}

if part fp32; then
  # fp32 and the int8 cells, with the load curve at 1, 4, 16 and 50 clients (50 = the headline);
  # llama-server with its unified KV (--kv-unified, -np 64), as the issue states it
  flock /tmp/bench.lock bash -c "note 'fp32 start'; $CMP --dtype fp32 --clients 1,4,16,50 \
      --only paged,paged_int8,vllm_cpu,openvino,openvino_int8,llamacpp,llamacpp_q8 \
      --out $OUT/fp32 > $OUT/fp32.log 2>&1; note 'fp32 end'"
fi
if part bf16; then
  # bf16: every cell with a bf16 path, 50 clients (llama-server: bf16 GGUF, bf16 KV)
  flock /tmp/bench.lock bash -c "note 'bf16 start'; $CMP --dtype bf16 \
      --only paged,vllm_cpu,openvino,llamacpp \
      --out $OUT/bf16 > $OUT/bf16.log 2>&1; note 'bf16 end'"
fi
if part strategies; then
  # our four strategies beside transformers' own two ways, fp32 (README's strategies table)
  flock /tmp/bench.lock bash -c "note 'strategies start'; $CMP --dtype fp32 --no-peak \
      --only none,dynamic,rolling,paged,hf_naive,transformers_cb \
      --out $OUT/strategies > $OUT/strategies.log 2>&1; note 'strategies end'"
fi
if part more; then
  # fp32 llama.cpp with split KV (-np 50 --no-kv-unified, 256 cells per slot) against paged
  flock /tmp/bench.lock bash -c "note 'fp32-split start'; $CMP --dtype fp32 --llamacpp-kv split \
      --only paged,llamacpp,llamacpp_q8 \
      --out $OUT/fp32-llamacpp-split > $OUT/fp32-llamacpp-split.log 2>&1; note 'fp32-split end'"
fi
if part bf16curve; then
  flock /tmp/bench.lock bash -c "note 'bf16curve start'; $CMP --dtype bf16 --clients 1,4,16,50 \
      --only paged,vllm_cpu,openvino \
      --out $OUT/bf16-curve > $OUT/bf16-curve.log 2>&1; note 'bf16curve end'"
fi
if part fp32curve; then
  flock /tmp/bench.lock bash -c "note 'fp32curve start'; $CMP --dtype fp32 --clients 1,4,16,50 \
      --only paged,paged_int8,vllm_cpu,openvino,openvino_int8 \
      --out $OUT/fp32-curve > $OUT/fp32-curve.log 2>&1; note 'fp32curve end'"
fi
