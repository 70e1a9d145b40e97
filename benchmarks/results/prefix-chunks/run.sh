#!/usr/bin/env bash
# Prompt chunks after cached rows in the C layer stack: before (BASE, a worktree of the commit before) and
# after (this checkout), the engine's closed loop (no HTTP), arms alternated B N N B, one process each.
#   flock /tmp/bench.lock benchmarks/results/prefix-chunks/run.sh   (from the repo root; BASE=/tmp/base;
#   CELLS="prefix512 preset long-target" picks cells; the default is the first two)
set -euo pipefail
ROOT=$(pwd)
BASE=${BASE:-/tmp/base}
OUT=$ROOT/benchmarks/results/prefix-chunks
PY=$ROOT/.venv/bin/python
MODEL=$ROOT/.cache/models/smollm2
CELLS=${CELLS:-prefix512 preset}
cell() {   # name, then engine-loop flags
    local name=$1; shift
    [[ " $CELLS " == *" $name "* ]] || return 0
    for arm in B N N B; do
        dir=$([[ $arm == B ]] && echo "$BASE" || echo "$ROOT")
        echo "== $name $arm $(date -u +%H:%M:%S)"
        (cd "$dir" && HF_HUB_OFFLINE=1 "$PY" -m handler bench engine-loop --model-dir "$MODEL" --dtype fp32 \
            --concurrency 50 --requests 150 --reps 2 "$@" --out "$OUT/runs/$name-$arm-$RANDOM.json") 2>&1 \
            | grep -E "^rep|error|Error" || true
    done
}
# a 512-token system prompt ahead of every prompt, prefix caching on: each prompt's rest is a chunk after 512 cached rows
cell prefix512 --shared-prefix 512 --property option.enable_prefix_caching=true
# the preset's request list, default policy: no chunks after cached rows (a control)
cell preset --preset cpu-135m
# prompts of 300-1000 tokens under a 150 ms TPOT target: their later chunks come after cached rows
cell long-target --prompt-tokens 300,600,1000 --requests 100 --property option.target_tpot_ms=150
