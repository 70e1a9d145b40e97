#!/bin/bash
PY=/work/wt56n/.venv/bin/python; M=/work/wt56n/.cache/models/qwen2.5-coder-0.5b
export HF_HUB_OFFLINE=1 THREADS=1
uptime
for spec in "fp32 - base" "fp32 - wt" "fp32 int8_weight_only base" "fp32 int8_weight_only wt" "fp32 gguf base" "fp32 gguf wt" \
            "fp32 gguf wt" "fp32 gguf base" "fp32 int8_weight_only wt" "fp32 int8_weight_only base" "fp32 - wt" "fp32 - base"; do
  set -- $spec; root=$([ $3 = base ] && echo /tmp/i56n/base || echo /work/wt56n)
  $PY /tmp/i56n/step1.py $root $M $1 $2 10 2>&1 | grep -E "RESULT|Error" | tail -1
done
uptime
