#!/bin/bash
# quiet-host rerun of issue 56's fp32 1-client cells
cd /work/main/benchmarks/results/issue56-speed
B=/tmp/base56; N=/work/main; PY=/work/main/.venv/bin/python; Q=/work/main/.cache/models/qwen2.5-coder-0.5b
export HF_HUB_OFFLINE=1 THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
echo "# $(date -u +%FT%TZ) $(uptime)"
for root in $B $N $N $B $B $N $N $B $N $B $B $N; do
  $PY step1.py $root $Q fp32 - 20 2>/dev/null | grep RESULT
done
echo "# $(date -u +%FT%TZ) $(uptime)"
cd /work/main
unset LD_PRELOAD
HF_HUB_OFFLINE=1 .venv/bin/python -m handler bench compare --preset cpu-qwen-0.5b \
  --workloads lmi --dtype fp32 --clients 1 --reps 2 --no-peak --no-progress --only paged,openvino \
  --arm before=paged@/tmp/base56 --out benchmarks/results/issue56-speed/c1-qwen-quiet
echo "# $(date -u +%FT%TZ) $(uptime)"
