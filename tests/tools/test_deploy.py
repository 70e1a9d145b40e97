"""handler.tools.deploy against moto's in-process SageMaker / Application Auto Scaling."""
from __future__ import annotations

import io
import json

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from handler.tools import deploy
from tests.support.sagemaker_standin import moto_session, smoothed_init
from handler.tools.deploy import (DeployError, create_deployment, environment_from_properties, invoke,
                            invoke_stream, iter_jsonlines, properties_to_env, register_autoscaling,
                            teardown)

ROLE = "arn:aws:iam::123456789012:role/SageMakerExecution"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/lmi-serve:latest"
INSTANCE = "ml.g4dn.xlarge"  # moto validates against an old list without ml.g5.*

CONTINUOUS = """\
# the continuous-batching example
engine=MPI
option.entryPoint=djl_python.huggingface
option.model_id=/home/me/models/tiny
option.rolling_batch=auto
option.max_rolling_batch_size=64
option.paged_attention=false
option.max_rolling_batch_prefill_tokens=16080
"""


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for var in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "SAGEMAKER_ROLE_ARN"):
        monkeypatch.delenv(var, raising=False)
    # moto's Describe* answers carry empty structures that the SDK's models reject; every
    # boto3 session (the CLI makes its own) drops them (tests/support/sagemaker_standin.py)
    monkeypatch.setattr(boto3.session.Session, "__init__", smoothed_init())
    with mock_aws():
        session = moto_session("us-east-1")
        yield session.client("sagemaker"), session.client("application-autoscaling"), session


@pytest.fixture
def props(tmp_path):
    path = tmp_path / "serving.properties"
    path.write_text(CONTINUOUS)
    return str(path)


def test_properties_become_lmi_environment(props):
    notes = []
    env = environment_from_properties(props, model_data="s3://b/models/tiny/", notes=notes)
    assert env == {
        "SERVING_ENGINE": "MPI",
        "OPTION_ENTRYPOINT": "djl_python.huggingface",
        "OPTION_ROLLING_BATCH": "auto",
        "OPTION_MAX_ROLLING_BATCH_SIZE": "64",
        "OPTION_PAGED_ATTENTION": "false",
        "OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS": "16080",
    }
    assert len(notes) == 1 and "/home/me/models/tiny is a local path" in notes[0]


def test_the_server_reads_the_environment_back_as_the_same_properties(props, tmp_path):
    from handler.config import load_config

    env = environment_from_properties(props, model_data="s3://b/m/")
    cfg = load_config(None, str(tmp_path / "model"), env=env, check_model=False)
    assert (cfg.strategy, cfg.engine, cfg.max_rolling_batch_size, cfg.max_rolling_batch_prefill_tokens) == \
        ("rolling", "MPI", 64, 16080)


def test_s3_model_id_is_kept_and_no_model_data_needed(tmp_path):
    path = tmp_path / "p.properties"
    path.write_text("option.model_id=s3://my-bucket/llama/\nbatch_size=4\nmax_batch_delay=100\n")
    assert environment_from_properties(str(path)) == {
        "OPTION_MODEL_ID": "s3://my-bucket/llama/", "SERVING_BATCH_SIZE": "4", "SERVING_MAX_BATCH_DELAY": "100"}


@pytest.mark.parametrize("text, words", [
    ("option.rolling_batch=auto\n", "has no option.model_id=s3://"),
    ("option.model_id=./tiny\n", "is a local path; an endpoint needs --model-data"),
])
def test_properties_without_a_model_source_are_rejected(tmp_path, text, words):
    path = tmp_path / "p.properties"
    path.write_text(text)
    with pytest.raises(DeployError, match=words):
        environment_from_properties(str(path))


def test_bad_property_value_fails_before_anything_is_created(tmp_path):
    path = tmp_path / "p.properties"
    path.write_text("option.rolling_batch=auto\noption.max_rolling_batch_size=lots\n")
    with pytest.raises(DeployError) as err:
        environment_from_properties(str(path), model_data="s3://b/m.tar.gz")
    msg = str(err.value)
    assert "option.max_rolling_batch_size=lots" in msg and str(path) in msg and "\n" not in msg


def test_properties_to_env_rejects_colliding_keys():
    with pytest.raises(DeployError, match="both map to OPTION_A_B"):
        properties_to_env({"option.a.b": "1", "option.a_b": "2"})


def test_sdk_create_reaches_in_service_with_the_derived_environment(aws, props):
    sm, _, session = aws
    env = environment_from_properties(props, model_data="s3://b/models/tiny/", instance_type=INSTANCE)
    out = create_deployment(session, name="lmi-test", image_uri=IMAGE, role_arn=ROLE, env=env,
                            model_data="s3://b/models/tiny", instance_type=INSTANCE, instance_count=2,
                            startup_timeout=1200, wait=True, wait_delay=1, log=lambda *_: None)
    assert out["status"] == "InService"
    assert sm.describe_endpoint(EndpointName="lmi-test")["EndpointStatus"] == "InService"
    container = sm.describe_model(ModelName="lmi-test")["PrimaryContainer"]
    assert container["Environment"]["OPTION_ROLLING_BATCH"] == "auto"
    assert container["Environment"]["OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS"] == "16080"
    assert container["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://b/models/tiny/", "S3DataType": "S3Prefix", "CompressionType": "None"}
    assert "ModelDataUrl" not in container
    (variant,) = sm.describe_endpoint_config(EndpointConfigName="lmi-test")["ProductionVariants"]
    assert (variant["InstanceType"], variant["InitialInstanceCount"],
            variant["ContainerStartupHealthCheckTimeoutInSeconds"]) == (INSTANCE, 2, 1200)


def test_sdk_tarball_model_data_uses_model_data_url(aws):
    sm, _, session = aws
    create_deployment(session, name="tarball", image_uri=IMAGE, role_arn=ROLE, env={},
                      model_data="s3://b/model.tar.gz", instance_type=INSTANCE, log=lambda *_: None)
    container = sm.describe_model(ModelName="tarball")["PrimaryContainer"]
    assert container["ModelDataUrl"] == "s3://b/model.tar.gz" and "ModelDataSource" not in container


@pytest.mark.parametrize("kwargs, words", [
    ({"role_arn": None}, "--role-arn is required"),
    ({"role_arn": "my-role"}, "not an IAM role ARN"),
    ({"instance_type": "g5.2xlarge"}, "--instance-type='g5.2xlarge' is not a SageMaker instance type"),
    ({"name": "bad_name"}, "--name='bad_name' is not a SageMaker name"),
    ({"model_data": "/local/model"}, "must be an s3:// URI"),
])
def test_bad_inputs_are_one_line_errors_and_create_nothing(aws, kwargs, words):
    sm, _, session = aws
    args = dict(name="x", image_uri=IMAGE, role_arn=ROLE, env={}, instance_type=INSTANCE)
    args.update(kwargs)
    with pytest.raises(DeployError, match=words.replace("(", r"\(").replace("[", r"\[")):
        create_deployment(session, **args)
    assert sm.list_models()["Models"] == [] and sm.list_endpoints()["Endpoints"] == []


def test_sdk_aws_rejection_rolls_back_what_was_created(aws):
    sm, _, session = aws
    # moto rejects ml.g5.* in create_endpoint_config, after create_model succeeded
    with pytest.raises(ClientError):
        create_deployment(session, name="rb", image_uri=IMAGE, role_arn=ROLE, env={},
                          instance_type="ml.g5.2xlarge", log=lambda *_: None)
    assert sm.list_models()["Models"] == []


def test_sdk_existing_name_is_refused_without_touching_it(aws):
    sm, _, session = aws
    create_deployment(session, name="taken", image_uri=IMAGE, role_arn=ROLE, env={}, instance_type=INSTANCE,
                      log=lambda *_: None)
    with pytest.raises(DeployError, match="model named 'taken' already exists"):
        create_deployment(session, name="taken", image_uri=IMAGE, role_arn=ROLE, env={},
                          instance_type=INSTANCE, log=lambda *_: None)
    assert sm.describe_endpoint(EndpointName="taken")["EndpointStatus"] == "InService"


def test_sdk_autoscaling_then_teardown_leaves_nothing(aws):
    sm, aas, session = aws
    create_deployment(session, name="scaled", image_uri=IMAGE, role_arn=ROLE, env={}, instance_type=INSTANCE,
                      log=lambda *_: None)
    out = register_autoscaling(aas, "scaled", min_capacity=1, max_capacity=4, target_invocations=25)
    (target,) = aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]
    assert (target["ResourceId"], target["ScalableDimension"], target["MinCapacity"], target["MaxCapacity"]) == \
        ("endpoint/scaled/variant/AllTraffic", "sagemaker:variant:DesiredInstanceCount", 1, 4)
    (policy,) = aas.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    assert policy["PolicyARN"] == out["policy_arn"] and policy["PolicyType"] == "TargetTrackingScaling"
    tracking = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["TargetValue"] == 25.0
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == "SageMakerVariantInvocationsPerInstance"

    deleted = teardown(session, "scaled", aas=aas, log=lambda *_: None)
    assert deleted == ["scalable target endpoint/scaled/variant/AllTraffic", "endpoint scaled",
                       "endpoint config scaled", "model scaled"]
    assert aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"] == []
    assert sm.list_endpoints()["Endpoints"] == []
    assert sm.list_endpoint_configs()["EndpointConfigs"] == []
    assert sm.list_models()["Models"] == []
    assert teardown(session, "scaled", aas=aas, log=lambda *_: None) == []  # nothing left: no error


def test_sdk_teardown_of_partial_deployment(aws):
    sm, aas, session = aws
    sm.create_model(ModelName="half", ExecutionRoleArn=ROLE, PrimaryContainer={"Image": IMAGE})
    assert teardown(session, "half", aas=aas, log=lambda *_: None) == ["model half"]
    assert sm.list_models()["Models"] == []


def test_bad_autoscaling_bounds():
    with pytest.raises(DeployError, match="need 1 <= min <= max"):
        register_autoscaling(None, "e", min_capacity=3, max_capacity=2)


def test_invoke_through_moto_runtime_reports_non_json(aws):
    runtime = boto3.client("sagemaker-runtime", region_name="us-east-1")
    with pytest.raises(DeployError, match="not JSON"):  # moto's canned body is b"body"
        invoke(runtime, "any", "hi")


class FakeRuntime:
    """Returns the given chunks as a response stream, and records the request."""

    def __init__(self, chunks):
        self.chunks, self.requests = chunks, []

    def invoke_endpoint_with_response_stream(self, **kwargs):
        self.requests.append(kwargs)
        return {"Body": ({"PayloadPart": {"Bytes": c}} for c in self.chunks)}

    def invoke_endpoint(self, **kwargs):
        self.requests.append(kwargs)
        return {"Body": io.BytesIO(b'{"generated_text": " world"}')}


def test_stream_reassembles_lines_split_across_payload_parts():
    lines = [{"token": {"id": 5, "text": " Hello", "log_prob": -0.5}},
             {"token": {"id": 6, "text": ",", "log_prob": -1.0}, "generated_text": " Hello,"}]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    rt = FakeRuntime([data[:7], data[7:40], data[40:41], data[41:]])
    assert list(invoke_stream(rt, "ep", "Say", max_new_tokens=2)) == lines
    body = json.loads(rt.requests[0]["Body"])
    assert body == {"inputs": "Say", "parameters": {"max_new_tokens": 2}, "stream": True}


def test_stream_error_event_is_a_deploy_error():
    class ErrRuntime(FakeRuntime):
        def invoke_endpoint_with_response_stream(self, **kwargs):
            return {"Body": iter([{"ModelStreamError": {"Message": "CUDA out of memory", "ErrorCode": "500"}}])}

    with pytest.raises(DeployError, match="ModelStreamError: CUDA out of memory"):
        list(invoke_stream(ErrRuntime([]), "ep", "x"))


def test_iter_jsonlines_last_line_without_newline():
    assert list(iter_jsonlines([b'{"a": 1}\n{"b"', b": 2}"])) == [{"a": 1}, {"b": 2}]


# ---- CLI ---------------------------------------------------------------------------
def test_sdk_cli_create_autoscale_delete(aws, props, capsys):
    sm, aas, session = aws
    base = ["--region", "us-east-1"]
    rc = deploy.main(base + ["create", "--properties", props, "--model-data", "s3://b/model.tar.gz",
                             "--image-uri", IMAGE, "--role-arn", ROLE, "--instance-type", INSTANCE,
                             "--name", "cli", "--wait", "--env", "EXTRA=1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert json.loads(out.strip().splitlines()[-1])["status"] == "InService"
    assert sm.describe_model(ModelName="cli")["PrimaryContainer"]["Environment"]["EXTRA"] == "1"
    assert deploy.main(base + ["autoscale", "--endpoint", "cli", "--max-capacity", "3"]) == 0
    assert aas.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"][0]["MaxCapacity"] == 3
    assert deploy.main(base + ["delete", "--name", "cli"]) == 0
    assert sm.list_endpoints()["Endpoints"] == [] and sm.list_models()["Models"] == []


def test_cli_errors_are_one_line(aws, props, capsys):
    rc = deploy.main(["create", "--properties", props, "--model-data", "s3://b/m.tar.gz",
                      "--image-uri", IMAGE, "--instance-type", INSTANCE])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --role-arn is required") and err.count("\n") == 1

    rc = deploy.main(["create", "--properties", props, "--model-data", "s3://b/m.tar.gz", "--image-uri",
                      IMAGE, "--role-arn", ROLE, "--instance-type", "ml.g5.2xlarge", "--name", "g5"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: AWS CreateEndpointConfig: ValidationException:")
    assert err.count("\n") == 1


def test_cli_no_region(monkeypatch, capsys, tmp_path):
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert deploy.main(["delete", "--name", "x"]) == 2
    assert capsys.readouterr().err == "error: no AWS region: pass --region or set AWS_REGION\n"


def test_cli_no_credentials(no_aws_credentials, capsys):
    assert deploy.main(["--region", "us-east-1", "delete", "--name", "x"]) == 1
    assert capsys.readouterr().err.startswith("error: no AWS credentials: run `aws configure`")


def test_cli_validates_before_needing_aws(monkeypatch, props, capsys):
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    rc = deploy.main(["create", "--properties", props, "--image-uri", IMAGE, "--role-arn", ROLE])
    assert rc == 2
    assert "is a local path; an endpoint needs --model-data" in capsys.readouterr().err


def test_stream_error_line_from_the_server_is_a_deploy_error():
    data = b'{"token": {"id": 1, "text": "a", "log_prob": -1.0}}\n{"error": "model failed", "code": 424}\n'
    got = []
    with pytest.raises(DeployError, match="stream failed: 424: model failed"):
        for line in invoke_stream(FakeRuntime([data]), "ep", "x"):
            got.append(line)
    assert got == [{"token": {"id": 1, "text": "a", "log_prob": -1.0}}]


def test_cli_stream_prints_tokens_and_finish_reason(monkeypatch, capsys):
    lines = [{"token": {"id": 1, "text": " Hel", "log_prob": -1.0}},
             {"token": {"id": 2, "text": "lo", "log_prob": -1.0}, "generated_text": " Hello",
              "details": {"finish_reason": "length", "generated_tokens": 2}}]
    rt = FakeRuntime([b"".join(json.dumps(x).encode() + b"\n" for x in lines)])
    monkeypatch.setattr(deploy, "LocalRuntime", lambda url: rt)
    rc = deploy.main(["invoke", "--local-url", "http://x", "--endpoint", "e", "--prompt", "p", "--stream",
                      "--max-new-tokens", "2"])
    assert rc == 0
    assert capsys.readouterr().out == " Hello\n[2 tokens streamed, finish_reason=length]\n"
    assert json.loads(rt.requests[0]["Body"])["parameters"] == {"max_new_tokens": 2, "details": True}


def test_local_runtime_reports_http_errors_in_one_line():
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"code": 400, "message": "parameters.max_new_tokens: must be >= 1"}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rt = deploy.LocalRuntime(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(DeployError, match=r"answered 400: .*max_new_tokens: must be >= 1"):
            invoke(rt, "local", "hi", max_new_tokens=0)
    finally:
        server.shutdown()


# ---- the SDK and the runtime stand-in against a running server ------------------------
import http.server  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from botocore.config import Config  # noqa: E402
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer  # noqa: E402
from botocore.exceptions import ReadTimeoutError  # noqa: E402

from tests.support.reference import hf_greedy  # noqa: E402
from tests.support.sagemaker_standin import RuntimeStandIn, encode_event, payload_part, stream_error  # noqa: E402
from tests.support.server import Server  # noqa: E402

PROMPT = "def fibonacci(n):"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    srv = Server("option.rolling_batch=auto\noption.paged_attention=true\noption.max_rolling_batch_size=4\n",
                 demo_model_dir, tmp_path_factory.mktemp("sdk-server"))
    yield srv
    srv.stop()


def _ids(result: dict) -> list[int]:
    return [t["id"] for t in result["details"]["tokens"]]


def _request(inputs, n: int, **extra) -> dict:
    return {"inputs": inputs, "parameters": {"max_new_tokens": n, "details": True}, **extra}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("docker") is None,
                    reason="the SDK's LocalSagemakerRuntimeClient runs `docker context inspect` to find "
                           "the host; no docker CLI on PATH")
def test_sdk_local_runtime_client_plain_list_and_stream(server, demo_model_dir):
    """sagemaker-core's local-mode runtime client and its serializers against a bare server."""
    from sagemaker.core.deserializers import JSONDeserializer
    from sagemaker.core.local.local_session import LocalSagemakerRuntimeClient
    from sagemaker.core.serializers import JSONSerializer

    client = LocalSagemakerRuntimeClient(config={"local": {"serving_port": server.port}})
    ser, de = JSONSerializer(), JSONDeserializer()

    def call(body):
        resp = client.invoke_endpoint(Body=ser.serialize(body), EndpointName="local",
                                      ContentType=ser.CONTENT_TYPE, Accept="application/json")
        return resp["Body"]

    body = call(_request(PROMPT, 8))
    assert _ids(de.deserialize(body, "application/json")) == hf_greedy(demo_model_dir, PROMPT, 8)
    results = de.deserialize(call(_request(PROMPTS, 6)), "application/json")
    assert [_ids(r) for r in results] == [hf_greedy(demo_model_dir, p, 6) for p in PROMPTS]
    lines = list(iter_jsonlines([call(_request(PROMPT, 8, stream=True)).read()]))
    assert [x["token"]["id"] for x in lines if "token" in x] == hf_greedy(demo_model_dir, PROMPT, 8)
    assert lines[-1]["generated_text"] == "".join(x["token"]["text"] for x in lines)


@pytest.mark.slow
def test_local_runtime_takes_the_sdk_serializers_str_and_bytes(server, demo_model_dir):
    from sagemaker.core.serializers import JSONSerializer

    want = hf_greedy(demo_model_dir, PROMPT, 6)
    rt = deploy.LocalRuntime(server.url)
    text = JSONSerializer().serialize(_request(PROMPT, 6))
    assert isinstance(text, str)
    for body in (text, text.encode(), bytearray(text.encode())):
        resp = rt.invoke_endpoint(EndpointName="local", Body=body)
        assert _ids(json.loads(resp["Body"].read())) == want
    resp = rt.invoke_endpoint_with_response_stream(EndpointName="local", Body=JSONSerializer().serialize(
        _request(PROMPT, 6, stream=True)))
    lines = list(iter_jsonlines(e["PayloadPart"]["Bytes"] for e in resp["Body"]))
    assert [x["token"]["id"] for x in lines if "token" in x] == want
    with pytest.raises(DeployError, match="Body must be bytes or str, not dict"):
        rt.invoke_endpoint(EndpointName="local", Body=_request(PROMPT, 6))


@pytest.mark.slow
def test_sdk_lmi_predictions_route_answers_like_invocations(server, demo_model_dir):
    import requests

    res = requests.post(f"{server.url}/predictions/my-model", json=_request(PROMPT, 6), timeout=120)
    assert res.status_code == 200, res.text
    assert _ids(res.json()) == hf_greedy(demo_model_dir, PROMPT, 6)


# -- the stand-in's event-stream frames ------------------------------------------------
def test_sagemaker_event_stream_frames_decode_with_botocore():
    """Our encoder against botocore's own decoder (which checks both CRCs)."""
    buf = EventStreamBuffer()
    frames = [payload_part(b'{"token": 1}\n'), payload_part(b""), stream_error("gone", "StreamBroken")]
    data = b"".join(frames)
    buf.add_data(data[:5])
    buf.add_data(data[5:])
    msgs = list(buf)
    assert [m.headers[":message-type"] for m in msgs] == ["event", "event", "exception"]
    assert msgs[0].headers[":event-type"] == "PayloadPart" and msgs[0].payload == b'{"token": 1}\n'
    assert json.loads(msgs[2].payload) == {"Message": "gone", "ErrorCode": "StreamBroken"}
    bad = bytearray(encode_event({":message-type": "event"}, b"x"))
    bad[-1] ^= 1
    buf = EventStreamBuffer()
    buf.add_data(bytes(bad))
    with pytest.raises(ChecksumMismatch):
        list(buf)


def _runtime(url: str, **cfg):
    session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                    region_name="us-east-1")
    config = deploy.runtime_config(**cfg) if not isinstance(cfg.get("config"), Config) else cfg["config"]
    return session.client("sagemaker-runtime", endpoint_url=url, config=config)


@pytest.mark.slow
def test_sagemaker_runtime_standin_boto3_plain_and_event_stream(server, demo_model_dir):
    with RuntimeStandIn({"ep": server.url}) as standin:
        rt = _runtime(standin.url)
        want = hf_greedy(demo_model_dir, PROMPT, 12)
        assert _ids(invoke(rt, "ep", PROMPT, max_new_tokens=12, parameters={"details": True})) == want
        # the raw events boto3 parsed from the frames, then our jsonlines reassembly
        resp = rt.invoke_endpoint_with_response_stream(
            EndpointName="ep", ContentType="application/json", Accept="application/jsonlines",
            Body=json.dumps(_request(PROMPT, 12, stream=True)))
        assert resp["ContentType"].startswith("application/jsonlines")
        parts = [e["PayloadPart"]["Bytes"] for e in resp["Body"]]
        assert len(parts) > 1  # frames as the tokens came, not one body
        lines = list(iter_jsonlines(parts))
        assert [x["token"]["id"] for x in lines if "token" in x] == want
        streamed = list(invoke_stream(rt, "ep", PROMPT, max_new_tokens=12))
        assert [x["token"]["id"] for x in streamed if "token" in x] == want
        assert len(standin.requests) == 3


@pytest.mark.slow
def test_sagemaker_runtime_standin_errors_are_model_error_424(server):
    with RuntimeStandIn({"ep": server.url}) as standin:
        rt = _runtime(standin.url)
        with pytest.raises(ClientError) as err:
            rt.invoke_endpoint(EndpointName="ep", ContentType="application/json",
                               Body=json.dumps(_request(PROMPT, 0)))
        assert err.value.response["Error"]["Code"] == "ModelError"
        assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 424
        assert err.value.response["OriginalStatusCode"] == 400
        for call in (invoke, lambda *a, **k: list(invoke_stream(*a, **k))):
            with pytest.raises(DeployError, match=r"endpoint ep: the model answered 400: .*max_new_tokens"):
                call(rt, "ep", PROMPT, max_new_tokens=0)
        with pytest.raises(ClientError, match="ValidationError.*Endpoint nope of account"):
            invoke(rt, "nope", PROMPT)


class _Upstream:
    """A fake container: `handler(h)` writes the response."""

    def __init__(self, handler):
        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                handler(self)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_sagemaker_stream_broken_mid_way_is_model_stream_error():
    def half_stream(h):
        h.send_response(200)
        h.send_header("Content-Type", "application/jsonlines")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        line = b'{"token": {"id": 1, "text": "a", "log_prob": -1.0}}\n'
        h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        h.wfile.flush()
        h.connection.shutdown(socket.SHUT_RDWR)  # no closing chunk: the container died

    with _Upstream(half_stream) as up, RuntimeStandIn({"ep": up.url}) as standin:
        got = []
        with pytest.raises(DeployError, match="stream failed: ModelStreamError: the container closed"):
            for line in invoke_stream(_runtime(standin.url), "ep", PROMPT):
                got.append(line)
        assert got == [{"token": {"id": 1, "text": "a", "log_prob": -1.0}}]


def test_no_invoke_path_resends_a_generation_that_outlasts_the_read_timeout():
    """botocore resends a request whose answer timed out; ours makes one attempt."""
    def slow(h):
        time.sleep(2.5)
        body = b'{"generated_text": "late"}'
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    with _Upstream(slow) as up, RuntimeStandIn({"ep": up.url}) as standin:
        with pytest.raises(ReadTimeoutError):
            invoke(_runtime(standin.url, read_timeout=1), "ep", PROMPT)
        assert len(standin.requests) == 1
        # the same call under a retry policy like the SDK's (standard mode): sent again
        retrying = Config(read_timeout=1, retries={"total_max_attempts": 3, "mode": "standard"})
        with pytest.raises(ReadTimeoutError):
            invoke(_runtime(standin.url, config=retrying), "ep", PROMPT)
        assert len(standin.requests) == 1 + 3
        # LocalRuntime: one attempt too
        with pytest.raises(DeployError, match=r"no answer within 1 s \(not retried\)"):
            deploy.LocalRuntime(up.url, timeout=1).invoke_endpoint(EndpointName="ep", Body=b"{}")


def test_sdk_runtime_client_defaults_retry_and_ours_do_not():
    """What docs/DEPLOY.md says of sagemaker-core's runtime client (Endpoint.invoke has no
    way to pass a botocore Config), and of ours. Fails when the SDK changes its defaults."""
    from sagemaker.core.utils.utils import SageMakerClient

    session = boto3.session.Session(aws_access_key_id="t", aws_secret_access_key="t", region_name="us-east-1")
    sdk_cfg = SageMakerClient(session=session, region_name="us-east-1").get_client("sagemaker-runtime").meta.config
    # botocore's max_attempts=10 is 10 retries: up to 11 sends of one generation
    assert (sdk_cfg.read_timeout, sdk_cfg.retries) == (60, {"total_max_attempts": 11, "mode": "standard"})
    ours = deploy.clients(session=session)["runtime"].meta.config
    assert (ours.read_timeout, ours.retries["total_max_attempts"]) == (deploy.RUNTIME_READ_TIMEOUT, 1)


@pytest.fixture
def moto_and_standin(monkeypatch, server):
    """SageMaker on moto's server (AWS_ENDPOINT_URL) and the runtime on the stand-in
    (AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME), endpoint "sdk-ep" forwarding to the server."""
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    standin = RuntimeStandIn({"sdk-ep": server.url})
    for var, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}",
                       "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": standin.url, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield moto_session("us-east-1"), standin
    standin.stop()
    moto.stop()


@pytest.mark.slow
def test_sdk_endpoint_invoke_through_the_standin_and_its_stream_defect(moto_and_standin, demo_model_dir):
    """The SDK's Endpoint.invoke parses a real answer; its invoke_with_response_stream is the
    defect docs/DEPLOY.md describes (this fails once sagemaker-core fixes it)."""
    from sagemaker.core.resources import Endpoint

    session, standin = moto_and_standin
    create_deployment(session, name="sdk-ep", image_uri=IMAGE, role_arn=ROLE, env={}, instance_type=INSTANCE,
                      wait=True, wait_delay=1, log=lambda *_: None)
    endpoint = Endpoint.get("sdk-ep", session=session, region="us-east-1")
    out = endpoint.invoke(body=json.dumps(_request(PROMPT, 8)), content_type="application/json",
                          accept="application/json")
    body = out.body.read() if hasattr(out.body, "read") else out.body
    assert _ids(json.loads(body)) == hf_greedy(demo_model_dir, PROMPT, 8)
    with pytest.raises(AttributeError, match="'EventStream' object has no attribute 'get'"):
        endpoint.invoke_with_response_stream(body=json.dumps(_request(PROMPT, 8, stream=True)),
                                             content_type="application/json")
    # our path on the same session and endpoint: boto3's client parses the frames
    runtime = deploy.clients(session=session)["runtime"]
    lines = list(invoke_stream(runtime, "sdk-ep", PROMPT, max_new_tokens=8))
    assert [x["token"]["id"] for x in lines if "token" in x] == hf_greedy(demo_model_dir, PROMPT, 8)
    assert [r["stream"] for r in standin.requests] == [False, True, True]
    assert teardown(session, "sdk-ep", log=lambda *_: None) == ["endpoint sdk-ep", "endpoint config sdk-ep",
                                                                 "model sdk-ep"]
