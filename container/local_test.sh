#!/usr/bin/env bash
# Build the CPU variant of the serving image and smoke-test it locally with podman:
# /ping, a plain and a streamed /invocations, then a SIGTERM stop (timed).
#
#   container/local_test.sh [--build-only | --no-build] [--remove-image]   (the image is kept by default)
#   --no-build: test the image already built (IMAGE) as it is
#   A build prunes the store's untagged images before and after (`podman image prune`: earlier
#   builds' layers that no tag uses; with the vfs driver each is a full copy of the image), and
#   when the store's disk has under MIN_FREE_GB left, the other checkouts' test images
#   (localhost/lmi-serve:test-*, rebuilt on demand) first.
#   Each stage is built in one working container with no per-step layer cache (buildah's
#   --layers=false): with the vfs driver a cached step is a full copy of the tree beneath it, and
#   the cached build peaked at ~22 GB of disk against ~7 GB, no faster (156 s against 145 s here).
#
# Needs root, podman, buildah, runc (and debootstrap if the base image is missing).
# Environment knobs:
#   IMAGE        image tag to build            (default localhost/lmi-serve:cpu)
#   BASE_IMAGE   base image                    (default localhost/bookworm-min, built
#                                               with debootstrap when absent)
#   TORCH_WHEEL  a CPU torch wheel to bake in  (default: the first torch-*cpu*.whl in
#                                               /opt/wheels or ~/.cache/pip)
#   PORT         host port on 127.0.0.1        (default: a free one)
#   RUN_USER     uid:gid inside the container  (default 1000:1000, to prove the image
#                                               runs as a non-root user too)
#   PYTHON       host python with this package (default .venv/bin/python)
#   MIN_FREE_GB  free disk a build wants in podman's store (default 12)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
IMAGE=${IMAGE:-localhost/lmi-serve:cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/bookworm-min}
RUN_USER=${RUN_USER:-1000:1000}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
BUILD_ONLY=0
NO_BUILD=0
KEEP_IMAGE=1
for arg in "$@"; do
    case "$arg" in
        --build-only) BUILD_ONLY=1 ;;
        --no-build) NO_BUILD=1 ;;
        --keep-image) KEEP_IMAGE=1 ;;
        --remove-image) KEEP_IMAGE=0 ;;
        *) echo "error: unknown argument '$arg' (allowed: --build-only, --no-build, --keep-image, --remove-image)" >&2; exit 2 ;;
    esac
done

# podman's vfs driver works without overlay support; runc because crun fails on
# rlimits with hybrid cgroups on these hosts.
PODMAN=(podman --storage-driver vfs)
BUILDAH=(buildah --storage-driver vfs)
log() { printf '[local_test %s] %s\n' "$(date +%T)" "$*"; }
die() { printf '[local_test] error: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (podman/buildah with the vfs driver)"
for tool in podman buildah runc curl; do
    command -v "$tool" >/dev/null || die "'$tool' not found: apt-get install -y podman buildah runc curl"
done

WORK=$(mktemp -d /tmp/lmi-local-test.XXXXXX)
NAME=lmi-local-test-$$
STAGED_WHEEL=""
cleanup() {
    "${PODMAN[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
    if [[ -n "$STAGED_WHEEL" ]]; then rm -f "$STAGED_WHEEL"; fi
    if [[ $KEEP_IMAGE == 0 ]]; then "${PODMAN[@]}" rmi -f "$IMAGE" >/dev/null 2>&1 || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

store_root() { "${PODMAN[@]}" info --format '{{.Store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage; }
store_free() { df -h --output=avail "$(store_root)" 2>/dev/null | tail -n 1 | tr -d ' ' || echo "?"; }
prune_stale() {
    local before after
    before=$("${PODMAN[@]}" images -a -q | wc -l)
    "${PODMAN[@]}" image prune -f >/dev/null 2>&1 || true
    after=$("${PODMAN[@]}" images -a -q | wc -l)
    if (( before > after )); then log "pruned $(( before - after )) stale image layer(s) of earlier builds"; fi
}
store_free_gb() { df -BG --output=avail "$(store_root)" 2>/dev/null | tail -n 1 | tr -dc '0-9'; }
# Short of disk: the test images of other checkouts go (not one a container still uses: no -f).
make_room() {
    local want=${MIN_FREE_GB:-12} free tag
    free=$(store_free_gb)
    [[ -n "$free" ]] && (( free < want )) || return 0
    for tag in $("${PODMAN[@]}" images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/lmi-serve:test-' || true); do
        [[ $tag == "$IMAGE" ]] && continue
        if "${PODMAN[@]}" rmi "$tag" >/dev/null 2>&1; then
            log "removed the test image $tag of another checkout (${free}G free, a build wants ${want}G)"
        fi
    done
    prune_stale
}

if [[ $NO_BUILD == 1 ]]; then
    "${PODMAN[@]}" image exists "$IMAGE" || die "--no-build: image $IMAGE not found (build it first)"
    log "testing the existing image $IMAGE"
else
    # 1. Base image: a minimal Debian bookworm (registries are unreachable here).
    if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
        [[ $BASE_IMAGE == localhost/bookworm-min ]] || die "base image $BASE_IMAGE not found"
        command -v debootstrap >/dev/null || die "'debootstrap' not found: apt-get install -y debootstrap"
        log "building base image $BASE_IMAGE with debootstrap"
        debootstrap --variant=minbase bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
            || { tail -20 "$WORK/debootstrap.log"; die "debootstrap failed"; }
        tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
        "${PODMAN[@]}" import "$WORK/rootfs.tar" "$BASE_IMAGE" >/dev/null
        rm -rf "$WORK/rootfs" "$WORK/rootfs.tar"
    fi

    # 2. CPU torch: PyPI's Linux torch is the CUDA build (~2.7 GB with its nvidia wheels),
    # and the CPU index is unreachable here, so a local CPU wheel goes into the build
    # context (container/wheels/, git-ignored) and the Dockerfile installs it.
    if [[ -z "${TORCH_WHEEL:-}" ]]; then
        TORCH_WHEEL=$(find /opt/wheels "$HOME/.cache/pip" -name 'torch-2.13.0*cpu*.whl' 2>/dev/null | head -n 1 || true)
    fi
    if [[ -n "${TORCH_WHEEL:-}" ]]; then
        [[ -f "$TORCH_WHEEL" ]] || die "TORCH_WHEEL=$TORCH_WHEEL is not a file"
        if [[ ! -f "container/wheels/$(basename "$TORCH_WHEEL")" ]]; then
            mkdir -p container/wheels
            cp "$TORCH_WHEEL" container/wheels/
            STAGED_WHEEL="container/wheels/$(basename "$TORCH_WHEEL")"
        fi
        log "using torch wheel $(basename "$TORCH_WHEEL")"
        TORCH_INDEX_URL=""
    else
        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
        log "no local CPU torch wheel found; installing from $TORCH_INDEX_URL"
    fi

    # 3. Image: the GPU Dockerfile with CPU build arguments. If this host's pip trusts an
    # extra CA (a TLS-inspecting proxy), the build's pip gets the same bundle, mounted
    # for the RUN steps only.
    CA_ARGS=()
    HOST_CA=${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}
    if [[ -n "$HOST_CA" && -f "$HOST_CA" ]]; then
        CA_ARGS=(-v "$HOST_CA:/etc/ssl/build-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/build-ca.crt)
        log "pip in the build trusts $HOST_CA"
    fi
    # The vfs driver stores every layer as a full copy of the image's tree (~2 GB), so each
    # rebuild leaves the previous image behind, untagged; a host that builds on every run (CI
    # keeps its store) fills its disk unless it goes.
    prune_stale
    make_room
    log "building $IMAGE from $BASE_IMAGE ($(store_free) free in podman's store)"
    start=$(date +%s)
    "${BUILDAH[@]}" bud --isolation chroot --layers=false --force-rm --format docker \
        --ignorefile container/Dockerfile.dockerignore -f container/Dockerfile \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg EXTRAS= \
        --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" "${CA_ARGS[@]}" \
        -t "$IMAGE" . >"$WORK/build.log" 2>&1 \
        || { tail -40 "$WORK/build.log"
             if grep -q "no space left on device" "$WORK/build.log"; then
                 die "image build failed: no space left in podman's store $(store_root) ($(store_free) free after pruning stale layers); free disk there or remove unused images (podman --storage-driver vfs images)"
             fi
             die "image build failed"; }
    prune_stale
    log "built $IMAGE in $(( $(date +%s) - start )) s ($("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'); $(store_free) free in podman's store)"
fi
[[ $BUILD_ONLY == 1 ]] && exit 0

# 4. A tiny model built on the host, with its serving.properties, mounted read-only.
log "building the demo model"
"$PYTHON" -m handler build-demo-model "$WORK/model" >"$WORK/model.log" 2>&1 \
    || { cat "$WORK/model.log"; die "build-demo-model failed"; }
cat >"$WORK/model/serving.properties" <<'EOF'
engine=Python
option.rolling_batch=auto
option.paged_attention=true
option.max_rolling_batch_size=8
EOF
chmod -R a+rX "$WORK"

# 5. Run it the way SageMaker does: `IMAGE serve`, port 8080 inside.
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
log "starting container $NAME on 127.0.0.1:$PORT as user $RUN_USER"
"${PODMAN[@]}" run --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=4096:4096 \
    -d --name "$NAME" --user "$RUN_USER" -p "127.0.0.1:$PORT:8080" \
    -v "$WORK/model:/opt/ml/model:ro" "$IMAGE" serve >/dev/null
URL=http://127.0.0.1:$PORT
start=$(date +%s)
until curl -sf "$URL/ping" >/dev/null; do
    if [[ $("${PODMAN[@]}" inspect --format '{{.State.Running}}' "$NAME") != true ]]; then
        "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -30
        die "container exited before /ping answered"
    fi
    (( $(date +%s) - start < 300 )) || { "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -30; die "/ping not ready after 300 s"; }
    sleep 1
done
log "/ping ready after $(( $(date +%s) - start )) s"

# 6. Requests.
body='{"inputs": "def fibonacci(n):", "parameters": {"max_new_tokens": 16}}'
log "POST /invocations"
curl -sS --fail-with-body -H 'Content-Type: application/json' -d "$body" "$URL/invocations" \
    || die "plain invocation failed"
echo
log "POST /invocations (stream)"
curl -sS -N --fail-with-body -H 'Content-Type: application/json' \
    -d '{"inputs": "def fibonacci(n):", "parameters": {"max_new_tokens": 8}, "stream": true}' \
    "$URL/invocations" >"$WORK/stream.jsonl" || { cat "$WORK/stream.jsonl"; die "streamed invocation failed"; }
cat "$WORK/stream.jsonl"
lines=$(grep -c '"token"' "$WORK/stream.jsonl" || true)
log "stream: $lines token lines"
(( lines >= 1 )) || die "stream returned no token lines"
tail -n 1 "$WORK/stream.jsonl" | grep -q '"generated_text"' || die "last stream line has no generated_text"

# 7. Stop with SIGTERM (podman stop sends SIGKILL only after 30 s) while a long streamed
# request is in flight: the server must finish it before exiting.
curl -sS -N -H 'Content-Type: application/json' \
    -d '{"inputs": "def fibonacci(n):", "parameters": {"max_new_tokens": 200}, "stream": true}' \
    "$URL/invocations" >"$WORK/inflight.jsonl" 2>&1 &
inflight=$!
until [[ -s "$WORK/inflight.jsonl" ]] || ! kill -0 "$inflight" 2>/dev/null; do sleep 0.05; done
log "stopping (SIGTERM) with a 200-token stream in flight"
start=$(date +%s.%N)
"${PODMAN[@]}" stop -t 30 "$NAME" >/dev/null
wait "$inflight" || true
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
code=$("${PODMAN[@]}" inspect --format '{{.State.ExitCode}}' "$NAME")
log "stopped in ${elapsed} s, exit code $code"
"${PODMAN[@]}" logs "$NAME" 2>&1 | tail -5 | sed 's/^/    container: /'
[[ $code != 137 ]] || die "the server ignored SIGTERM and was killed (exit 137)"
log "in-flight stream: $(grep -c '"token"' "$WORK/inflight.jsonl" || true) token lines"
tail -n 1 "$WORK/inflight.jsonl" | grep -q '"generated_text"' \
    || { tail -n 3 "$WORK/inflight.jsonl"; die "the in-flight request was cut off by the stop"; }
log "OK"
