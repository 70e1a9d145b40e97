#!/bin/bash
# Issue 64 again on a quiet host with the mended scheduler (31d62bf): 50 clients, fp32, default policy (paged),
# the TPOT target (tpot arm), OpenVINO GenAI and vLLM CPU; fresh servers per repetition, order rotated, two
# repetitions; then the priority flood. Run from the repo root, alone:
#   flock /tmp/bench.lock benchmarks/results/latency-64-r3/run.sh
OUT=benchmarks/results/latency-64-r3
M=.cache/models/smollm2
export HF_HUB_OFFLINE=1
uptime > $OUT/load.txt
.venv/bin/python -m handler bench compare --preset cpu-135m --workloads lmi --dtype fp32 --reps 2 --requests 100 \
  --no-peak --no-progress --only paged,openvino,vllm_cpu --arm tpot=paged+option.target_tpot_ms=${T135:-90} \
  --slo-ttft-ms 4000 --slo-tpot-ms 100 --out $OUT/smollm2 2> $OUT/smollm2.log
uptime >> $OUT/load.txt
.venv/bin/python -m handler bench compare --preset cpu-qwen-0.5b --workloads lmi --dtype fp32 --reps 2 --clients 50 \
  --requests 100 --no-peak --no-progress --only paged,openvino,vllm_cpu \
  --arm tpot=paged+option.target_tpot_ms=${TQ:-330} --slo-ttft-ms 15000 --slo-tpot-ms 400 --out $OUT/qwen \
  2> $OUT/qwen.log
uptime >> $OUT/load.txt
.venv/bin/python benchmarks/priority_flood.py --model-dir $M --reps 1 --short-requests 20 \
  --long-tokens 200 --long-new 48 --out $OUT/priority.json 2> $OUT/priority.log > /dev/null
uptime >> $OUT/load.txt
