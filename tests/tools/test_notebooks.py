"""Execute the notebooks end to end with nbclient: AWS calls go to a moto server on
loopback (AWS_ENDPOINT_URL), requests to a real local server on a tiny model."""
from __future__ import annotations

import os
import re
from pathlib import Path

import boto3
import nbformat
import pytest
from moto.server import ThreadedMotoServer
from nbclient import NotebookClient

from tests.support.sagemaker_standin import RuntimeStandIn
from tests.support.server import Server

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"

pytestmark = pytest.mark.slow


def with_overrides(nb, overrides: dict, setup: str = "") -> nbformat.NotebookNode:
    """Insert a cell assigning `overrides` (after `setup` code) right after the cell tagged
    "parameters" (what papermill does), so the notebook's own defaults stay untouched."""
    idx = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    src = setup + "\n".join(f"{k} = {v!r}" for k, v in overrides.items())
    nb.cells.insert(idx + 1, nbformat.v4.new_code_cell(src, metadata={"tags": ["injected-parameters"]}))
    return nb


def execute(name: str, overrides: dict, timeout: int = 300, setup: str = "") -> nbformat.NotebookNode:
    nb = with_overrides(nbformat.read(NOTEBOOKS / name, as_version=4), overrides, setup)
    # The kernel runs in notebooks/: it imports this checkout's `handler` (installed or not).
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([old] if old else []))
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return nb


def cell_text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        out.append(o.get("text", "") or o.get("data", {}).get("text/plain", ""))
    return "".join(out)


@pytest.fixture(scope="module")
def local_server(demo_model_dir, tmp_path_factory):
    srv = Server("option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=4\n",
                 demo_model_dir, tmp_path_factory.mktemp("nb-server"))
    yield srv.url
    srv.stop()


@pytest.fixture
def moto_aws(monkeypatch, local_server):
    """SageMaker control plane: moto on loopback (AWS_ENDPOINT_URL); runtime: the stand-in
    (AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME) forwarding endpoint "nb-test" to a real server."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    standin = RuntimeStandIn({"nb-test": local_server})
    for var, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}",
                       "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": standin.url,
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)  # the kernel inherits this environment
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield boto3.session.Session(region_name="us-east-1"), standin
    standin.stop()
    server.stop()


# In the kernel: moto's empty Describe* structures dropped, as SageMaker sends none.
MOTO_SETUP = ("import boto3.session\nfrom tests.support.sagemaker_standin import smoothed_init\n"
              "boto3.session.Session.__init__ = smoothed_init()\n")


def test_deploy_notebook_runs_the_sdk_against_moto_and_the_runtime_standin(moto_aws):
    session, standin = moto_aws
    nb = execute("deploy.ipynb", {
        "NAME": "nb-test",
        "IMAGE_URI": "123456789012.dkr.ecr.us-east-1.amazonaws.com/lmi-serve:test",
        "ROLE_ARN": "arn:aws:iam::123456789012:role/SageMakerExecution",
        "MODEL_DATA": "s3://nb-test-bucket/models/tiny/",
        "PROPERTIES": str(REPO / "serving.properties.d" / "paged.properties"),
        "INSTANCE_TYPE": "ml.g4dn.xlarge",  # moto's instance list predates ml.g5
        "WAIT_DELAY": 1,
        "MAX_CAPACITY": 3,
    }, setup=MOTO_SETUP)
    outputs = {i: cell_text(c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "\n".join(outputs.values())
    assert '"OPTION_PAGED_ATTENTION": "true"' in text
    assert "'status': 'InService'" in text
    assert "InService arn:aws:sagemaker:us-east-1:123456789012:endpoint/nb-test" in text  # Endpoint.get
    assert re.search(r"'finish_reason': '(length|eos_token)', 'generated_tokens': \d+", text), text
    assert " tokens, first after " in text
    assert "\n3\n" in text  # the scalable target's MaxCapacity, read back
    # boto3 parsed the stand-in's event-stream frames; each generation was sent once
    assert [(r["endpoint"], r["stream"]) for r in standin.requests] == [("nb-test", False), ("nb-test", True)]

    sm = session.client("sagemaker")
    assert sm.list_endpoints()["Endpoints"] == [] and sm.list_models()["Models"] == []
    assert session.client("application-autoscaling").describe_scalable_targets(
        ServiceNamespace="sagemaker")["ScalableTargets"] == []


def test_notebooks_call_handler_deploy_instead_of_boto3_directly():
    """The deployment logic lives once, in handler.tools.deploy."""
    for path in sorted(NOTEBOOKS.glob("deploy*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        for call in ("create_model(", "create_endpoint(", "invoke_endpoint(", "register_scalable_target(",
                     "delete_endpoint("):
            assert call not in src, f"{path.name} calls {call} itself; use handler.tools.deploy"
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), f"{path.name}: no parameters cell"


def test_benchmark_notebook_runs_a_small_comparison(demo_model_dir, tmp_path):
    out = tmp_path / "bench"
    nb = execute("benchmark.ipynb", {"model_dir": demo_model_dir, "out_dir": str(out)}, timeout=600)
    # the notebook wrote the same artefacts as `bench compare`, with every asked-for server measured
    import json
    res = json.loads((out / "results.json").read_text())
    entries = {**res["strategies"], **res["peers"]}
    assert set(entries) == {"dynamic", "paged", "hf_naive"}
    assert all(e.get("requests_per_s", 0) > 0 and e.get("errors") == 0 for e in entries.values()), entries
    assert (out / "results.png").stat().st_size > 0
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", [])), "the notebook drew no chart"


def test_tuning_notebook_runs_a_small_tune(demo_model_dir, tmp_path):
    out = tmp_path / "tune"
    nb = execute("tuning.ipynb", {"model_dir": demo_model_dir, "out_dir": str(out)}, timeout=600)
    import json
    res = json.loads((out / "tune.json").read_text())
    assert res["chosen"] is not None and res["candidates"][res["chosen"]]["meets_slo"]
    assert (out / "serving.properties").read_text().startswith("# Written by `python -m handler tune`")
    assert "<- chosen" in "".join(cell_text(c) for c in nb.cells if c.cell_type == "code")
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells for o in c.get("outputs", [])), "the notebook showed no plot"
