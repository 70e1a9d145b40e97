#!/bin/bash
# Issue 56's speed check: the tree before the rebuild (bd3ee64, `git worktree add --detach /tmp/base56 bd3ee64`)
# against main's tip, one process per arm, arms alternated (B N N B ...), under tcmalloc as `serve` runs.
# 1. the 1-client decode step (step1.py: one sequence, the engine driven by hand, median ms of 3x20 steps),
#    Qwen2.5-Coder-0.5B fp32 / W8A16 (int8_weight_only) / GGUF (Q4_K_M-style grouped blocks);
# 2. the 50-client closed loop (loop1.py, no HTTP), SmolLM2-135M fp32 and Qwen 0.5B fp32.
# Run alone: flock /tmp/bench.lock ./bench.sh > bench.log
cd "$(dirname "$0")"
B=${BASE:-/tmp/base56}; N=${NEW:-/work/main}
PY=${PY:-/work/main/.venv/bin/python}; Q=/work/main/.cache/models/qwen2.5-coder-0.5b; S=/work/main/.cache/models/smollm2
export HF_HUB_OFFLINE=1 THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
echo "# $(date -u +%FT%TZ) $(uptime)"; ps -eo ni,pcpu,etime,cmd --sort=-pcpu | head -6 | cut -c1-120
for prec in "fp32 -" "fp32 int8_weight_only" "fp32 gguf"; do
  for root in $B $N $N $B $N $B $B $N; do
    $PY step1.py $root $Q $prec 20 2>/dev/null | grep RESULT
  done
done
for m in "$S 200" "$Q 100"; do
  set -- $m
  for root in $B $N $N $B; do
    $PY loop1.py $root $1 fp32 - $2 2>/dev/null | grep RESULT | sed "s#\$# model $(basename $1)#"
  done
done
echo "# $(date -u +%FT%TZ) $(uptime)"
