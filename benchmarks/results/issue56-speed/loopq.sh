#!/bin/bash
# The 50-client closed loop on Qwen 0.5B fp32 again, 8 processes B N N B B N N B (bench.sh's last cell
# showed 0.96x). Run alone: flock /tmp/bench.lock ./loopq.sh > loopq.log
cd "$(dirname "$0")"
B=/tmp/base56; N=/work/main; PY=/work/main/.venv/bin/python; Q=/work/main/.cache/models/qwen2.5-coder-0.5b
export HF_HUB_OFFLINE=1 THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
echo "# $(date -u +%FT%TZ) $(uptime)"
for root in $B $N $N $B $B $N $N $B; do
  $PY loop1.py $root $Q fp32 - 100 2>/dev/null | grep RESULT
done
echo "# $(date -u +%FT%TZ) $(uptime)"
