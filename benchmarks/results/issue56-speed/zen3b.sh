#!/bin/bash
# zen3.sh's two cells under 0.98 again with more processes (GGUF step 6+6, Qwen 0.5B 50-client loop 3+3), then
# served 1-client TPOT, Qwen 0.5B fp32: ours (main), ours before the rebuild (bd3ee64), OpenVINO GenAI fp32.
# Same host as zen3.sh, nothing else running. Run alone: flock /tmp/bench.lock ./zen3b.sh > zen3b.log
cd "$(dirname "$0")"
B=${BASE:-/tmp/base56}; N=${NEW:-/work/main}
PY=${PY:-/work/main/.venv/bin/python}; Q=/work/main/.cache/models/qwen2.5-coder-0.5b
export HF_HUB_OFFLINE=1 THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
echo "# $(date -u +%FT%TZ) $(uptime) N at $(git -C $N rev-parse --short HEAD)"
for root in $B $N $N $B $B $N $N $B $N $B $B $N; do
  $PY step1.py $root $Q fp32 gguf 20 2>/dev/null | grep RESULT
done
for root in $B $N $N $B $B $N; do
  $PY loop1.py $root $Q fp32 - 100 2>/dev/null | grep RESULT | sed "s#\$# model $(basename $Q)#"
done
echo "# $(date -u +%FT%TZ) $(uptime)"
unset LD_PRELOAD
cd /work/main
.venv/bin/python -m handler bench compare --preset cpu-qwen-0.5b \
  --workloads lmi --dtype fp32 --clients 1 --reps 2 --no-peak --no-progress --only paged,openvino \
  --arm before=paged@$B --out benchmarks/results/issue56-speed/c1-qwen-zen3
echo "# $(date -u +%FT%TZ) $(uptime)"
