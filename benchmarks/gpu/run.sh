#!/usr/bin/env bash
# The GPU checks of benchmarks/results/gpu-*/, run on a lent CUDA machine from the repo root:
#   bash benchmarks/gpu/run.sh PHASE [PHASE ...]   (phases below; logs and results go to $OUT)
# The machine has torch + triton but not our other pins: wheels carried in .whl/ are installed
# into /tmp/site first (pip download --python-version 3.12 --only-binary=:all: --platform manylinux...:
# transformers, flask, gunicorn, gevent and its deps, gguf; tokenizers 0.23.2 there is new enough).
# Not yet run on a GPU: no session so far was lent one (issue 36).
# Phases: setup | smol | gputests | kernels | bench:ONLY:REQUESTS[:WORKLOADS] | suite
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
ROOT=$(pwd)
WORK=${GPU_WORK:-/tmp/lmi-gpu}     # kept while the machine stays warm between calls
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
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$OUT/env.txt"
    $py - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
import platform, torch, transformers, triton, os
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "triton", triton.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
      "cpus", os.cpu_count())
PY
}

smol() {   # SmolLM2-135M-Instruct's GGUF travels xz-compressed in two halves, one per call
    mkdir -p "$WORK/smol"
    cp -n .smol/smol.xz.part* "$WORK/smol/" 2>/dev/null
    ls "$WORK/smol" | tee -a "$OUT/env.txt"
    if [[ -f $WORK/smol/smol.xz.part00 && -f $WORK/smol/smol.xz.part01 && ! -f $WORK/smol/model.gguf ]]; then
        cat "$WORK"/smol/smol.xz.part0{0,1} | xz -d > "$WORK/smol/model.gguf.tmp" && mv "$WORK/smol/model.gguf.tmp" "$WORK/smol/model.gguf"
        sha256sum "$WORK/smol/model.gguf" | tee -a "$OUT/env.txt"
    fi
    # where tests/conftest.py's real_model_dir finds it without the package index
    if [[ -f $WORK/smol/model.gguf ]]; then
        mkdir -p .cache/models/downloads
        cp -n "$WORK/smol/model.gguf" .cache/models/downloads/SmolLM2-135M-Instruct.Q4_1.gguf
    fi
}

gputests() {
    local extra=()
    say "gputests: start"
    timeout 420 $py -m pytest -p no:cacheprovider -q -ra -m gpu --timeout 300 tests/ 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
    say "gputests: done"
}

kernels() {
    say "kernels: start"
    timeout 180 $py benchmarks/kernel_bench.py --out "$OUT/kernel_bench.json" 2>&1 | tee "$OUT/kernel_bench.md" | tail -15
    say "kernels: done"
}

bench() {  # bench:none,dynamic:500[:lmi]
    IFS=: read -r _ only n wl <<<"$1"
    say "bench $only n=$n: start"
    timeout ${BENCH_TIMEOUT:-420} $py -m handler bench compare --preset gpu --out "$WORK/bench" --only "$only" \
        --workloads "${wl:-lmi}" --reps 1 --requests "$n" --serial-requests "${SERIAL:-16}" --no-progress \
        --startup-timeout 300 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\s*$" | tail -30
    cp "$WORK/bench/results.json" "$OUT/results-$only.json" 2>/dev/null
    (cd "$WORK/bench" && tar czf "$OUT/runs-logs.tgz" runs/*/*.log runs/*/*.properties 2>/dev/null)
    say "bench $only: done"
}

suite() {
    say "suite: start"
    timeout ${SUITE_TIMEOUT:-300} $py -m pytest -p no:cacheprovider -q -ra --timeout 240 -n 6 \
        --ignore=tests/test_container.py --ignore=tests/tools/test_deploy.py --ignore=tests/model/test_s3.py \
        --ignore=tests/tools/test_notebooks.py --ignore=tests/model/test_lora.py --ignore=tests/http/test_api_clients.py \
        tests/ 2>&1 | tee "$OUT/suite.log" | tail -40
    say "suite: done"
}

for phase in "$@"; do
    case $phase in
        setup|smol|gputests|kernels|suite) $phase ;;
        bench:*) bench "$phase" ;;
        *) echo "unknown phase $phase"; exit 2 ;;
    esac
done
say "all phases done"
