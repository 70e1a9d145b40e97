#!/bin/sh
# The figures of benchmarks/results/bf16-panels/ (docs/PERFORMANCE.md, "bf16 panels"), from the
# repository root; every heavy step under flock so no other agent's benchmark runs beside it.
set -e
R=benchmarks/results/bf16-panels
uptime > $R/load.txt
flock /tmp/bench.lock .venv/bin/python benchmarks/gemm_bf16_bench.py --rows 1,16,64,256,1024 --rounds 10 \
    --copies 8 --out $R/gemm.json | tee $R/gemm.txt
uptime >> $R/load.txt
# Engine alone, 135 M bf16: the three ways a bf16 model's linears can multiply, alternating.
for i in 1 2; do
  for mode in panels fp32 bf16; do
    LMI_CPU_BF16_GEMM=$mode flock /tmp/bench.lock .venv/bin/python benchmarks/engine_loop.py \
        --model-dir .cache/models/smollm2 --dtype bf16 --preset cpu-135m --reps 2 \
        --out $R/engine_loop-$mode-$i.json | sed "s/^/$mode $i: /" | tee -a $R/engine_loop.txt
    uptime >> $R/load.txt
  done
done
