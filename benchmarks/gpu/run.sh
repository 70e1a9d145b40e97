#!/usr/bin/env bash
# The GPU checks of benchmarks/results/gpu-*/ (first run: gpu-h100-2026-11-26/), on a lent CUDA machine, repo root:
#   bash benchmarks/gpu/run.sh PHASE [PHASE ...]   (phases below; logs and results go to $OUT)
# The lent machine has python 3.12 with torch + triton + pytest but not our other pins: the wheels
# carried in .whl/ (gitignored via .git/info/exclude) go into /tmp/site first. Fetch them here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 ... -d .whl transformers==5.23.0 flask==3.1.3 blinker itsdangerous \
#     gunicorn==27.0.1 gevent==25.9.1 greenlet zope.event zope.interface xgrammar==0.2.8 apache-tvm-ffi \
#     pydantic pydantic-core annotated-types typing-inspection typing_extensions regex jsonschema==4.26.0 \
#     jsonschema-specifications referencing rpds-py gguf==0.19.0
# (25 MB; a call carries at most 64 MiB, so the real model's 98 MB GGUF cannot travel with them).
# Phases (each under its own timeout, so one that hangs leaves the others their time):
#   setup | gputests | kernels | model | floor | bench:ONLY:REQUESTS[:WORKLOAD[:TIMEOUT_S]]
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
ROOT=$(pwd)
WORK=${GPU_WORK:-/tmp/lmi-gpu}     # kept while the machine stays warm between calls (the 7B model)
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$ROOT
py=python3
t0=$SECONDS
say() { echo "[$(( SECONDS - t0 ))s] $*" | tee -a "$OUT/env.txt"; }

setup() {
    if [[ ! -f /tmp/site/.done ]]; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && touch /tmp/site/.done || { say "setup: wheel install failed"; return 1; }
    else
        say "setup: /tmp/site already there (warm machine)"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/env.txt"
    $py - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
import platform, os, torch, transformers, triton, flask, gunicorn, xgrammar
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "triton", triton.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "cpus", os.cpu_count(), "xgrammar", xgrammar.__version__)
PY
    say "setup: done"
}

gputests() {   # the tests marked gpu (CUDA parity of every strategy, Triton kernels vs references, 4-bit)
    say "gputests: start"
    timeout ${GPUTESTS_TIMEOUT:-170} $py -m pytest -p no:cacheprovider -q -ra -m gpu -n ${GPUTESTS_N:-8} \
        --timeout 150 -k "not real_smollm2" \
        ${GPUTESTS_FILES:-tests/model/test_gpu.py tests/model/test_cuda_graphs.py tests/kernels/test_kernels.py tests/model/test_quant_int4.py} 2>&1 \
        | tee "$OUT/gpu-tests.log" | tail -40
    say "gputests: done (rc ${PIPESTATUS[0]})"
}

kernels() {    # Triton paged attention against torch SDPA, bf16
    say "kernels: start"
    timeout ${KERNELS_TIMEOUT:-70} $py benchmarks/kernel_bench.py --out "$OUT/kernel_bench.json" 2>&1 \
        | tee "$OUT/kernel_bench.md" | tail -12
    say "kernels: done"
}

model() {      # Llama-2-7B's shape (benchmarks/configs) with random bf16 weights, built on the GPU
    say "model: start"
    [[ -f $WORK/model/config.json ]] || timeout ${MODEL_TIMEOUT:-150} $py -c "
from handler.tools.bench.compare import CONFIGS, materialise_random
import os; materialise_random(os.path.join(CONFIGS, 'llama-2-7b', 'config.json'), '$WORK/model', 'bfloat16')" 2>&1 | tail -3
    du -sh "$WORK/model" | tee -a "$OUT/env.txt"
    say "model: done"
}

floor() {      # the decode step of the 7B against transformers' decode and the bare GEMMs, then its profile
    say "floor: start"
    timeout ${FLOOR_TIMEOUT:-150} $py benchmarks/step_floor.py --model-dir "$WORK/model" --dtype bf16 \
        --batch ${FLOOR_BATCH:-1,16,50} --steps 16 --reps 2 --out "$OUT/step_floor.json" 2>&1 | tail -8
    timeout ${FLOOR_TIMEOUT:-150} $py benchmarks/step_floor.py --model-dir "$WORK/model" --dtype bf16 --batch 50 \
        --steps 8 --reps 1 --profile > "$OUT/step_profile.txt" 2>&1
    say "floor: done"
}

bench() {      # bench:paged:200[:lmi[:150]] -- one server per call, so a timeout loses only that one
    IFS=: read -r _ only n wl tmo <<<"$1"
    say "bench $only n=$n: start"
    timeout "${tmo:-150}" $py -m handler bench compare --preset gpu --model-dir "$WORK/model" --out "$WORK/bench-$only" --only "$only" \
        --workloads "${wl:-lmi}" --reps 1 --requests "$n" --serial-requests "${SERIAL:-12}" --no-progress \
        --no-peak --startup-timeout 240 2>&1 | tee -a "$OUT/bench.log" | grep -E "rep [0-9]|wrote|rror|Traceback|refused|failed|Killed" | tail -8
    grep -h "CUDA graphs" "$WORK/bench-$only"/runs/*/*.log 2>/dev/null | tail -2 | cut -c1-300
    cp "$WORK/bench-$only/results.json" "$OUT/results-$only.json" 2>/dev/null
    cp "$WORK/bench-$only/results.md" "$OUT/results-$only.md" 2>/dev/null
    say "bench $only: done"
}

for phase in "$@"; do
    case $phase in
        setup|gputests|kernels|model|floor) $phase ;;
        bench:*) bench "$phase" ;;
        *) echo "unknown phase $phase"; exit 2 ;;
    esac
done
(cd "$WORK" && tar czf "$OUT/bench-logs.tgz" bench-*/runs 2>/dev/null)
say "all phases done"
