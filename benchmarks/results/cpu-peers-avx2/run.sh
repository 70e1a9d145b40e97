#!/usr/bin/env bash
# The CPU-peer comparison with our kernels' AVX2 build (option.cpu_kernels=avx2), for hosts
# without AVX-512. On an AVX-512 host every server's torch is held to AVX2 as well
# (ATEN_CPU_CAPABILITY=avx2, oneDNN by ONEDNN_MAX_CPU_ISA=AVX2); vLLM's own C++ kernels and
# OpenVINO's plugin pick their instruction set themselves and may still use AVX-512 there: the
# peers' figures are then at or above what they do on an AVX2-only host.
#   ./run.sh [all|fp32|bf16|qwen]   OUT=<results dir> (default: this directory/<host>)
# Needs the peers (make peer-vllm peer-openvino) and the models (build-demo-model --family
# smollm2 / qwen2.5-coder-0.5b).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-benchmarks/results/cpu-peers-avx2/$(hostname -s)}
PY=${PY:-.venv/bin/python}
SMOL=${SMOL:-.cache/models/smollm2}
QWEN=${QWEN:-.cache/models/qwen2.5-coder-0.5b}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 OPTION_CPU_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
note() { echo "$(date -u +%FT%TZ) $1: $(uptime)" | tee -a "$OUT/load.txt"; }
CMP="$PY -m handler bench compare --preset cpu-135m --workloads lmi --reps 1 --no-progress"
PART=${1:-all}
grep -o 'avx512[a-z_]*\|avx2\|amx[a-z_]*\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$OUT/cpu-flags.txt"
if [ "$PART" = all ] || [ "$PART" = fp32 ]; then
  note "fp32 start"
  flock /tmp/bench.lock $CMP --dtype fp32 --model-dir "$SMOL" \
      --only paged,paged_int8,vllm_cpu,openvino,openvino_int8 --out "$OUT/fp32" > "$OUT/fp32.log" 2>&1
  note "fp32 end"
fi
if [ "$PART" = all ] || [ "$PART" = bf16 ]; then
  note "bf16 start"
  flock /tmp/bench.lock $CMP --dtype bf16 --model-dir "$SMOL" \
      --only paged,vllm_cpu,openvino --out "$OUT/bf16" > "$OUT/bf16.log" 2>&1
  note "bf16 end"
fi
if [ "$PART" = all ] || [ "$PART" = qwen ]; then
  note "qwen start"
  flock /tmp/bench.lock $CMP --dtype fp32 --model-dir "$QWEN" --requests 100 \
      --only paged,paged_int8,vllm_cpu,openvino,openvino_int8 --out "$OUT/qwen-0.5b-fp32" > "$OUT/qwen-0.5b-fp32.log" 2>&1
  note "qwen end"
fi
