#!/bin/bash
# Served 1-client TPOT, Qwen2.5-Coder-0.5B fp32, ours (paged) and OpenVINO GenAI 2026.4.1, 2 repetitions, then bench floor. Run from the repo root.
cd /work/main
echo "== compare $(date -u +%H:%M:%S)"
HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python -m handler bench compare --preset cpu-qwen-0.5b   --workloads lmi --dtype fp32 --clients 1 --reps 2 --no-peak --no-progress --only paged,openvino --out benchmarks/results/issue56-speed/c1-qwen-zen4 2>&1 | tail -30
echo "== floor $(date -u +%H:%M:%S)"
HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python -m handler bench floor --model-dir .cache/models/qwen2.5-coder-0.5b   --dtype fp32 --results benchmarks/results/issue56-speed/c1-qwen-zen4/results.json --out benchmarks/results/issue56-speed/c1-qwen-zen4/floor.json 2>&1 | tail -20
echo "== end $(date -u +%H:%M:%S)"
