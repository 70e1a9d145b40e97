#!/bin/sh
# The figures of benchmarks/results/bf16-panels/ (docs/PERFORMANCE.md, "bf16 panels"), from the
# repository root: `flock /tmp/bench.lock benchmarks/results/bf16-panels/run.sh` (the whole set
# under one lock, so no other agent's benchmark runs in between). OMP_PROC_BIND=true for every
# process (this VM's one-vCPU mode, docs/PERFORMANCE.md).
set -e
R=benchmarks/results/bf16-panels
export OMP_PROC_BIND=true
export LD_PRELOAD=$(.venv/bin/python -c "from handler.model.cpu import find_tcmalloc; print(find_tcmalloc() or '')")
echo "start $(uptime)" > $R/load.txt
# Engine alone, 135 M bf16, the ways a bf16 model's linears can multiply, alternating:
#   copy: fp32 panels over an fp32 copy (the previous default here), regs: the bf16 panels widened
#   in registers (LMI_CPU_BF16_GEMM=fp32 now), panels: vdpbf16ps, bf16: oneDNN's bf16.
for i in 1 2; do
  for arm in copy regs panels bf16; do
    case $arm in
      copy) mode=fp32; extra=--fp32-copy ;;
      regs) mode=fp32; extra= ;;
      *) mode=$arm; extra= ;;
    esac
    LMI_CPU_BF16_GEMM=$mode .venv/bin/python $R/arm.py $extra \
        --model-dir .cache/models/smollm2 --dtype bf16 --preset cpu-135m --reps 1 \
        --out $R/engine_loop-$arm-$i.json | sed "s/^/$arm $i: /" | tee -a $R/engine_loop.txt
    echo "$arm $i $(uptime)" >> $R/load.txt
  done
done
.venv/bin/python benchmarks/archive/gemm_bf16_bench.py --rows 1,16,64,256,1024 --rounds 7 --copies 8 \
    --out $R/gemm.json | tee $R/gemm.txt
echo "end $(uptime)" >> $R/load.txt
