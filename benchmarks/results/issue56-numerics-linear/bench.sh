#!/bin/bash
# 1-client decode step, main's tip (bd3ee64, /tmp/i56n/base) against i56n (/work/wt56n), arms interleaved per round
PY=/work/wt56n/.venv/bin/python
M=/work/wt56n/.cache/models/qwen2.5-coder-0.5b
export HF_HUB_OFFLINE=1 THREADS=1
uptime; ps -eo pcpu,etime,cmd --sort=-pcpu | head -6 | cut -c1-160   # what else ran
for round in 1 2; do
  for prec in "fp32 -" "fp32 int8_weight_only" "fp32 gguf"; do
    for root in $( [ $((round % 2)) = 1 ] && echo "/tmp/i56n/base /work/wt56n" || echo "/work/wt56n /tmp/i56n/base" ); do
      $PY /tmp/i56n/step1.py $root $M $prec 30 2>/dev/null | grep RESULT | sed "s/^/round $round /"
    done
  done
done
uptime; ps -eo pcpu,etime,cmd --sort=-pcpu | head -6 | cut -c1-160
