#!/bin/bash
# Issue 56's speed cells on an AVX2-only host (AMD EPYC Zen 3, 2 vCPUs): the tree before the rebuild (bd3ee64,
# `git worktree add --detach /tmp/base56 bd3ee64`) against main (N), one process per arm, arms alternated,
# tcmalloc preloaded as `serve` runs; step1.py / loop1.py as in bench.sh. Run alone:
#   flock /tmp/bench.lock ./zen3.sh > zen3.log
cd "$(dirname "$0")"
B=${BASE:-/tmp/base56}; N=${NEW:-/work/main}
PY=${PY:-/work/main/.venv/bin/python}; Q=/work/main/.cache/models/qwen2.5-coder-0.5b; S=/work/main/.cache/models/smollm2
export HF_HUB_OFFLINE=1 THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
echo "# $(date -u +%FT%TZ) $(uptime) N at $(git -C $N rev-parse --short HEAD)"; grep -m1 "model name" /proc/cpuinfo
for prec in "fp32 -" "fp32 int8_weight_only" "fp32 gguf"; do
  for root in $B $N $N $B $B $N $N $B; do
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
