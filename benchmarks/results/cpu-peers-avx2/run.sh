#!/usr/bin/env bash
# The CPU-peer comparison with our kernels' AVX2 build (option.cpu_kernels=avx2), for hosts
# without AVX-512. On an AVX-512 host every server's torch is held to AVX2 as well
# (ATEN_CPU_CAPABILITY=avx2, oneDNN by ONEDNN_MAX_CPU_ISA=AVX2); vLLM's own C++ kernels and
# OpenVINO's plugin pick their instruction set themselves and may still use AVX-512 there: the
# peers' figures are then at or above what they do on an AVX2-only host. OpenVINO's cells run in a
# second invocation without ONEDNN_MAX_CPU_ISA: its CPU plugin picks AVX-512 bf16/int8 kernels from
# cpuid and its own oneDNN, held to AVX2, then fails every request ("could not create a primitive
# descriptor"); the part's results for them are under <part>-openvino/.
#   ./run.sh [all|fp32|bf16|qwen|openvino-fp32|openvino-bf16|openvino-qwen]   OUT=<results dir> (default: this directory/<host>)
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
# run NAME CELLS ARGS...: our cells and vLLM in one invocation, OpenVINO's in a second (see above)
run() {
  local name=$1 cells=$2 ours ov
  shift 2
  ours=$(echo "$cells" | tr , '\n' | grep -v '^openvino' | paste -sd, - || true)
  ov=$(echo "$cells" | tr , '\n' | grep '^openvino' | paste -sd, - || true)
  note "$name start"
  if [ -n "$ours" ]; then
    flock /tmp/bench.lock $CMP "$@" --only "$ours" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  fi
  if [ -n "$ov" ]; then
    flock /tmp/bench.lock env -u ONEDNN_MAX_CPU_ISA $CMP "$@" --only "$ov" --out "$OUT/${name%-ov}-openvino" \
        > "$OUT/${name%-ov}-openvino.log" 2>&1
  fi
  note "$name end"
}
PART=${1:-all}
grep -o 'avx512[a-z_]*\|avx2\|amx[a-z_]*\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$OUT/cpu-flags.txt"
case "$PART" in all|fp32) run fp32 paged,paged_int8,vllm_cpu,openvino,openvino_int8 --dtype fp32 --model-dir "$SMOL";; esac
case "$PART" in all|bf16) run bf16 paged,vllm_cpu,openvino --dtype bf16 --model-dir "$SMOL";; esac
case "$PART" in all|qwen) run qwen-0.5b-fp32 paged,paged_int8,paged_w8a16,vllm_cpu,openvino,openvino_int8 --dtype fp32 \
    --model-dir "$QWEN" --requests 100;; esac
# one part's OpenVINO cells alone (rerun after a failure): openvino-fp32 | openvino-bf16 | openvino-qwen
case "$PART" in
  openvino-fp32) run fp32-ov openvino,openvino_int8 --dtype fp32 --model-dir "$SMOL";;
  openvino-bf16) run bf16-ov openvino --dtype bf16 --model-dir "$SMOL";;
  openvino-qwen) run qwen-0.5b-fp32-ov openvino,openvino_int8 --dtype fp32 --model-dir "$QWEN" --requests 100;;
esac
