#!/bin/bash
# Issue 64 at 50 clients: today's default policy (paged), the TPOT target (tpot arm), OpenVINO GenAI fp32 and
# vLLM CPU 0.32 fp32; fresh servers per repetition, order rotated, two repetitions, one run per model.
# Run from the repo root, alone: flock /tmp/bench.lock benchmarks/results/latency-64-r7/run.sh
OUT=benchmarks/results/latency-64-r7
export HF_HUB_OFFLINE=1
.venv/bin/python -m handler bench compare --preset cpu-135m --workloads lmi --dtype fp32 --reps 2 --requests 100 \
  --no-peak --no-progress --only paged,openvino,vllm_cpu --arm tpot=paged+option.target_tpot_ms=${T135:-100} \
  --slo-ttft-ms 4000 --slo-tpot-ms 100 --out $OUT/smollm2 2> $OUT/smollm2.log
.venv/bin/python -m handler bench compare --preset cpu-qwen-0.5b --workloads lmi --dtype fp32 --reps 2 --clients 50 \
  --requests 100 --no-peak --no-progress --only paged,openvino,vllm_cpu \
  --arm tpot=paged+option.target_tpot_ms=${TQ:-250} --slo-ttft-ms 15000 --slo-tpot-ms 400 --out $OUT/qwen \
  2> $OUT/qwen.log
