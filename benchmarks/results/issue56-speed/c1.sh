#!/bin/bash
# Served 1-client TPOT, Qwen2.5-Coder-0.5B fp32: ours (main's tip), ours before the rebuild (bd3ee64) and
# OpenVINO GenAI 2026.4.1 fp32, fresh servers, order rotated, two repetitions. Run from the repo root.
HF_HUB_OFFLINE=1 flock /tmp/bench.lock .venv/bin/python -m handler bench compare --preset cpu-qwen-0.5b \
  --workloads lmi --dtype fp32 --clients 1 --reps 2 --no-peak --no-progress --only paged,openvino \
  --arm before=paged@/tmp/base56 --out benchmarks/results/issue56-speed/${C1OUT:-c1-qwen}
