#!/bin/bash
# 1-client decode step (one sequence, the engine driven by hand: ../issue56-numerics-linear/step1.py), the
# landed tip before this session (bd3ee64, `git archive` into $BASE) against this stop's tip ($NEW), each
# precision's arms alternated ABBA, one process per arm. Run alone: flock /tmp/bench.lock ./bench.sh
BASE=${BASE:-/tmp/i56n/base}; NEW=${NEW:-/work/main}
PY=${PY:-/work/main/.venv/bin/python}; M=${M:-/work/main/.cache/models/qwen2.5-coder-0.5b}
STEP1=$(dirname "$0")/../issue56-numerics-linear/step1.py
export HF_HUB_OFFLINE=1 THREADS=${THREADS:-2}
uptime; ps -eo pcpu,etime,cmd --sort=-pcpu | head -4 | cut -c1-140      # what else ran
for prec in "fp32 -" "fp32 int8_weight_only" "fp32 gguf"; do
  for root in $BASE $NEW $NEW $BASE; do
    $PY $STEP1 $root $M $prec 20 2>/dev/null | grep RESULT
  done
done
uptime
