#!/bin/bash
# The 1-client step again for fp32 and W8A16 (bench.sh's run had the coordinator's kernel tests beside
# it), 6 processes an arm, B N N B B N N B N B B N. Run alone: flock /tmp/bench.lock ./steps2.sh > steps2.log
cd "$(dirname "$0")"
B=/tmp/base56; N=/work/main; PY=/work/main/.venv/bin/python; Q=/work/main/.cache/models/qwen2.5-coder-0.5b
export HF_HUB_OFFLINE=1 THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
echo "# $(date -u +%FT%TZ) $(uptime)"
for prec in "fp32 -" "fp32 int8_weight_only"; do
  for root in $B $N $N $B $B $N $N $B $N $B $B $N; do
    $PY step1.py $root $Q $prec 20 2>/dev/null | grep RESULT
  done
done
echo "# $(date -u +%FT%TZ) $(uptime)"
