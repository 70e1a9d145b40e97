"""SageMaker deployment tooling: `python -m handler deploy create|invoke|autoscale|delete`.

Resources are SageMaker Python SDK objects (sagemaker-core's `sagemaker.core.resources`
Model / EndpointConfig / Endpoint, the `[sagemaker]` extra); boto3 is kept where the SDK
is defective or has nothing (docs/DEPLOY.md, "SDK defects"): the runtime client (no
retries, a long read timeout) and application-autoscaling. Functions (notebooks and
tests call them):
  environment_from_properties(path, model_data=..., instance_type=...) -> env dict
  create_deployment(session, name=, image_uri=, role_arn=, env=, model_data=, ...) -> names
  invoke(runtime, endpoint, prompt, ...) -> response dict
  invoke_stream(runtime, endpoint, prompt, ...) -> iterator of jsonlines dicts
  register_autoscaling(aas, endpoint, ...) -> {"resource_id", "policy_arn"}
  teardown(session, name, aas=None) -> list of what was deleted
`session` is a boto3 session (clients()["session"]). LocalRuntime(url) has the two
sagemaker-runtime invoke methods over plain HTTP, so the same code can talk to a
container running locally.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterable, Iterator

DEFAULT_INSTANCE_TYPE = "ml.g5.2xlarge"
VARIANT = "AllTraffic"
SCALABLE_DIMENSION = "sagemaker:variant:DesiredInstanceCount"

_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
_ROLE = re.compile(r"arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+")
_INSTANCE = re.compile(r"ml\.[a-z0-9-]+\.[a-z0-9]+")
_ENV_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]{0,1023}")

# GPUs per instance for the families LLMs are usually served on; for validating
# option.tensor_parallel_degree before an endpoint is created. Unknown types: no check.
_GPUS = {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1,
         "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}
_GPU_FAMILIES = ("g4dn", "g5", "g6", "g6e")


class DeployError(Exception):
    """A deployment problem; str(e) is the one line shown to the user."""


# ------------------------------------------------------------------------------------
# serving.properties -> container environment
# ------------------------------------------------------------------------------------
def properties_to_env(props: dict[str, str]) -> dict[str, str]:
    """LMI's convention: option.<key> -> OPTION_<KEY>, a top-level key -> SERVING_<KEY>."""
    env = {}
    for key, value in props.items():
        if key.lower().startswith("option."):
            var = "OPTION_" + key[len("option."):]
        else:
            var = "SERVING_" + key
        var = re.sub(r"[^A-Za-z0-9_]", "_", var).upper()
        if not _ENV_NAME.fullmatch(var):
            raise DeployError(f"property {key!r} cannot be an environment variable name")
        if len(value) > 1024:
            raise DeployError(f"property {key}: value is {len(value)} characters; SageMaker allows 1024")
        if var in env:
            raise DeployError(f"properties {key!r} and another key both map to {var}")
        env[var] = value.strip()
    return env


def _instance_gpus(instance_type: str) -> int | None:
    _, family, size = instance_type.split(".")
    return _GPUS.get(size) if family in _GPU_FAMILIES else None


def environment_from_properties(path: str, *, model_data: str | None = None,
                                instance_type: str = DEFAULT_INSTANCE_TYPE,
                                notes: list[str] | None = None) -> dict[str, str]:
    """Read a serving.properties file and return the container environment for it.

    The model comes from `model_data` (mounted at /opt/ml/model) or from an s3://
    option.model_id; a local-path model_id is dropped when model_data is given. The
    result is checked with the server's own configuration loader, so a bad key or value
    fails here rather than on the endpoint.
    """
    from handler.config import ConfigError, load_config, parse_properties

    try:
        with open(path, encoding="utf-8-sig") as f:
            props = parse_properties(f.read())
    except OSError as e:
        raise DeployError(f"--properties {path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise DeployError(f"--properties {path}: {e}") from None
    notes = [] if notes is None else notes
    model_key = next((k for k in props if k.lower() in ("option.model_id", "option.s3url")), None)
    model_id = props[model_key].strip() if model_key else ""
    if model_id and not model_id.lower().startswith("s3://"):
        if not model_data:
            raise DeployError(f"{path}: {model_key}={model_id} is a local path; an endpoint needs "
                              "--model-data s3://... or option.model_id=s3://bucket/prefix")
        notes.append(f"{model_key}={model_id} is a local path: dropped, the endpoint loads "
                     f"--model-data from /opt/ml/model")
        del props[model_key]
    elif model_id and model_data:
        notes.append(f"{model_key}={model_id} is what the server loads; --model-data is copied "
                     "to /opt/ml/model but not used")
    elif not model_id and not model_data:
        raise DeployError(f"{path} has no option.model_id=s3://...; pass --model-data s3://...")
    env = properties_to_env(props)

    gpus = _instance_gpus(instance_type)
    with tempfile.TemporaryDirectory() as empty:
        try:
            load_config(None, os.path.join(empty, "model"), env=env, check_model=False,
                        gpu_count=gpus if gpus is not None else 1)
        except ConfigError as e:
            raise DeployError(f"{path} (sent as container environment): {e}") from None
    return env


# ------------------------------------------------------------------------------------
# create / wait (SageMaker Python SDK: sagemaker.core.resources)
# ------------------------------------------------------------------------------------
def sdk():
    """(resources, shapes) of the SageMaker Python SDK (sagemaker-core), imported on use:
    it is a client-side extra, not a server dependency."""
    try:
        from sagemaker.core import resources, shapes
    except ImportError:
        raise DeployError("the SageMaker Python SDK is not installed: pip install 'lmi-serve[sagemaker]' "
                          "(sagemaker-core)") from None
    return resources, shapes


def _check_inputs(name: str, image_uri: str, role_arn: str | None, instance_type: str,
                  instance_count: int, model_data: str | None) -> None:
    if not _NAME.fullmatch(name or ""):
        raise DeployError(f"--name={name!r} is not a SageMaker name: 1-63 letters, digits and "
                          "hyphens, starting and ending with a letter or digit")
    if not image_uri:
        raise DeployError("--image-uri is required: the ECR URI of the serving image "
                          "(ACCOUNT.dkr.ecr.REGION.amazonaws.com/REPO:TAG)")
    if not role_arn:
        raise DeployError("--role-arn is required (or set SAGEMAKER_ROLE_ARN): an IAM role SageMaker "
                          "can assume, arn:aws:iam::ACCOUNT:role/NAME")
    if not _ROLE.fullmatch(role_arn):
        raise DeployError(f"--role-arn={role_arn!r} is not an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)")
    if not _INSTANCE.fullmatch(instance_type or ""):
        raise DeployError(f"--instance-type={instance_type!r} is not a SageMaker instance type "
                          f"(like {DEFAULT_INSTANCE_TYPE})")
    if instance_count < 1:
        raise DeployError(f"--instance-count={instance_count} must be at least 1")
    if model_data and not model_data.startswith("s3://"):
        raise DeployError(f"--model-data={model_data!r} must be an s3:// URI "
                          "(a model.tar.gz or a prefix of uncompressed files)")


def container_definition(image_uri: str, env: dict[str, str], model_data: str | None):
    """The SDK's ContainerDefinition. A tarball is a plain ModelDataUrl; a prefix of
    uncompressed files must be the S3DataSource form (SageMaker copies it as is to
    /opt/ml/model; a prefix given as ModelDataUrl is taken for a tarball and fails)."""
    _, shapes = sdk()
    if model_data and model_data.endswith((".tar.gz", ".tgz")):
        return shapes.ContainerDefinition(image=image_uri, environment=dict(env), model_data_url=model_data)
    if model_data:
        return shapes.ContainerDefinition(
            image=image_uri, environment=dict(env),
            model_data_source=shapes.ModelDataSource(s3_data_source=shapes.S3ModelDataSource(
                s3_uri=model_data.rstrip("/") + "/", s3_data_type="S3Prefix", compression_type="None")))
    return shapes.ContainerDefinition(image=image_uri, environment=dict(env))


def _get(getter, name: str, session):
    """The SDK object named `name`, or None when SageMaker has none."""
    from botocore.exceptions import ClientError

    try:
        return getter(name, session=session, region=session.region_name)
    except ClientError as e:
        if _is_missing(e):
            return None
        raise


def create_deployment(session, *, name: str, image_uri: str, role_arn: str | None, env: dict[str, str],
                      model_data: str | None = None, instance_type: str = DEFAULT_INSTANCE_TYPE,
                      instance_count: int = 1, startup_timeout: int = 900, wait: bool = False,
                      wait_delay: int = 30, wait_timeout: int = 3600, log=print) -> dict[str, str]:
    """Create model, endpoint config and endpoint, all named `name`, as SDK objects
    (sagemaker.core.resources Model / EndpointConfig / Endpoint) on a boto3 `session`.

    Returns {"model", "endpoint_config", "endpoint", "arn", "status"}. If a step fails,
    what this call created is deleted again; existing resources are never touched.
    """
    _check_inputs(name, image_uri, role_arn, instance_type, instance_count, model_data)
    resources, shapes = sdk()
    region = session.region_name
    for what, cls in (("model", resources.Model), ("endpoint config", resources.EndpointConfig),
                      ("endpoint", resources.Endpoint)):
        if _get(cls.get, name, session) is not None:
            raise DeployError(f"a SageMaker {what} named {name!r} already exists: delete it "
                              f"(python -m handler deploy delete --name {name}) or choose another --name")
    created: list[tuple[str, object]] = []
    try:
        model = resources.Model.create(
            model_name=name, execution_role_arn=role_arn,
            primary_container=container_definition(image_uri, env, model_data), session=session, region=region)
        created.append(("model", model))
        log(f"created model {name}")
        config = resources.EndpointConfig.create(
            endpoint_config_name=name, session=session, region=region,
            production_variants=[shapes.ProductionVariant(
                variant_name=VARIANT, model_name=name, instance_type=instance_type,
                initial_instance_count=instance_count,
                container_startup_health_check_timeout_in_seconds=startup_timeout,
                model_data_download_timeout_in_seconds=startup_timeout)])
        created.append(("endpoint config", config))
        log(f"created endpoint config {name} ({instance_count} x {instance_type})")
        endpoint = resources.Endpoint.create(endpoint_name=name, endpoint_config_name=config,
                                             session=session, region=region)
        created.append(("endpoint", endpoint))
        log(f"created endpoint {name}")
    except Exception:
        for what, obj in reversed(created):
            try:
                obj.delete()
                log(f"rolled back: deleted {what} {name}")
            except Exception as e:  # keep the original error; this one is only reported
                log(f"rollback: could not delete {what} {name}: {e}")
        raise
    if wait:
        wait_in_service(endpoint, delay=wait_delay, timeout=wait_timeout, log=log)
    else:
        endpoint.refresh()
    return {"model": name, "endpoint_config": name, "endpoint": name, "arn": endpoint.endpoint_arn,
            "status": endpoint.endpoint_status}


def wait_in_service(endpoint, *, delay: int = 30, timeout: int = 3600, log=print) -> str:
    """Endpoint.wait_for_status("InService"); a failed endpoint raises DeployError carrying
    SageMaker's FailureReason."""
    from sagemaker.core.utils.exceptions import FailedStatusError, TimeoutExceededError

    name = endpoint.endpoint_name
    log(f"waiting for endpoint {name} to be InService (up to {timeout // 60} min)")
    start = time.monotonic()
    try:
        endpoint.wait_for_status("InService", poll=delay, timeout=timeout)
    except (FailedStatusError, TimeoutExceededError):
        endpoint.refresh()
        reason = getattr(endpoint, "failure_reason", None)
        reason = reason if isinstance(reason, str) else f"not InService after {timeout} s"
        raise DeployError(f"endpoint {name} is {endpoint.endpoint_status}: {' '.join(reason.split())} "
                          f"(see CloudWatch log group /aws/sagemaker/Endpoints/{name})") from None
    log(f"endpoint {name} is InService after {time.monotonic() - start:.0f} s")
    return "InService"


# ------------------------------------------------------------------------------------
# invoke
# ------------------------------------------------------------------------------------
def _body(prompt: str | list[str], max_new_tokens: int, parameters: dict | None, stream: bool) -> bytes:
    params = {"max_new_tokens": max_new_tokens, **(parameters or {})}
    req = {"inputs": prompt, "parameters": params}
    if stream:
        req["stream"] = True
    return json.dumps(req).encode()


def _model_error(e, endpoint: str) -> DeployError | None:
    """SageMaker's ModelError (HTTP 424: the container answered an error) as one line with
    the container's own status and message; None for other errors."""
    err = e.response.get("Error", {})
    if err.get("Code") != "ModelError":
        return None
    status = e.response.get("OriginalStatusCode", "?")
    original = e.response.get("OriginalMessage") or err.get("Message", "")
    return DeployError(f"endpoint {endpoint}: the model answered {status}: {' '.join(str(original).split())}")


def invoke(runtime, endpoint: str, prompt: str | list[str], *, max_new_tokens: int = 64,
           parameters: dict | None = None) -> dict | list:
    """One request; returns the decoded JSON response ({"generated_text": ...})."""
    from botocore.exceptions import ClientError

    try:
        resp = runtime.invoke_endpoint(EndpointName=endpoint, ContentType="application/json",
                                       Accept="application/json",
                                       Body=_body(prompt, max_new_tokens, parameters, False))
    except ClientError as e:
        raise (_model_error(e, endpoint) or e) from None
    raw = resp["Body"].read()
    try:
        return json.loads(raw)
    except ValueError:
        raise DeployError(f"endpoint {endpoint} returned a body that is not JSON: {raw[:200]!r}") from None


def iter_jsonlines(parts: Iterable[bytes]) -> Iterator[dict]:
    """Byte chunks split anywhere -> one dict per complete JSON line."""
    buf = b""
    for part in parts:
        buf += part
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if buf.strip():
        yield json.loads(buf)


def _payload_parts(event_stream, endpoint: str) -> Iterator[bytes]:
    """PayloadPart bytes from an event stream. botocore raises an exception frame
    (ModelStreamError, InternalStreamFailure) as EventStreamError while iterating."""
    from botocore.exceptions import EventStreamError

    try:
        for event in event_stream:
            if "PayloadPart" in event:
                yield event["PayloadPart"]["Bytes"]
            else:
                kind, detail = next(iter(event.items()))
                raise DeployError(f"endpoint {endpoint} stream failed: {kind}: "
                                  f"{detail.get('Message', detail) if isinstance(detail, dict) else detail}")
    except EventStreamError as e:
        err = e.response.get("Error", {})
        raise DeployError(f"endpoint {endpoint} stream failed: {err.get('Code', '?')}: "
                          f"{err.get('Message', '')}") from None


def invoke_stream(runtime, endpoint: str, prompt: str, *, max_new_tokens: int = 64,
                  parameters: dict | None = None) -> Iterator[dict]:
    """Streamed request; yields {"token": {"id", "text", "log_prob"}, ...} dicts, the last
    one also carrying "generated_text"."""
    from botocore.exceptions import ClientError

    try:
        resp = runtime.invoke_endpoint_with_response_stream(
            EndpointName=endpoint, ContentType="application/json", Accept="application/jsonlines",
            Body=_body(prompt, max_new_tokens, parameters, True))
    except ClientError as e:
        raise (_model_error(e, endpoint) or e) from None
    for line in iter_jsonlines(_payload_parts(resp["Body"], endpoint)):
        if "error" in line:  # the server reports a failure after the 200 header as a line
            raise DeployError(f"endpoint {endpoint} stream failed: {line.get('code', '?')}: {line['error']}")
        yield line


class LocalRuntime:
    """The two sagemaker-runtime calls used here, against a local server, e.g.
    LocalRuntime("http://127.0.0.1:8080") for a container run with `-p 8080:8080`.
    The endpoint name is ignored. `Body` is bytes, or str (what the SDK's serializers
    return), sent as UTF-8. One attempt per call: nothing is retried."""

    def __init__(self, url: str, timeout: float = 600):
        self.url = url.rstrip("/") + "/invocations"
        self.timeout = timeout

    def _post(self, body, content_type: str, accept: str):
        if isinstance(body, str):
            body = body.encode("utf-8")
        elif isinstance(body, (bytearray, memoryview)):
            body = bytes(body)
        elif not isinstance(body, bytes):
            raise DeployError(f"Body must be bytes or str, not {type(body).__name__}")
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": content_type, "Accept": accept})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise DeployError(f"{self.url} answered {e.code}: {e.read()[:500].decode(errors='replace')}") from None
        except urllib.error.URLError as e:
            raise DeployError(f"cannot reach {self.url}: {e.reason}") from None
        except TimeoutError:
            raise DeployError(f"{self.url}: no answer within {self.timeout:g} s (not retried)") from None

    def invoke_endpoint(self, *, EndpointName: str, Body: bytes | str, ContentType: str = "application/json",
                        Accept: str = "application/json", **_):
        resp = self._post(Body, ContentType, Accept)
        return {"Body": resp, "ContentType": resp.headers.get("Content-Type")}

    def invoke_endpoint_with_response_stream(self, *, EndpointName: str, Body: bytes | str,
                                             ContentType: str = "application/json",
                                             Accept: str = "application/jsonlines", **_):
        resp = self._post(Body, ContentType, Accept)

        def events():
            with resp:
                while chunk := resp.read1(65536):
                    yield {"PayloadPart": {"Bytes": chunk}}
        return {"Body": events(), "ContentType": resp.headers.get("Content-Type")}


# ------------------------------------------------------------------------------------
# autoscaling
# ------------------------------------------------------------------------------------
def resource_id(endpoint: str, variant: str = VARIANT) -> str:
    return f"endpoint/{endpoint}/variant/{variant}"


def register_autoscaling(aas, endpoint: str, *, min_capacity: int = 1, max_capacity: int = 2,
                         target_invocations: float = 10.0, scale_in_cooldown: int = 300,
                         scale_out_cooldown: int = 60, variant: str = VARIANT) -> dict[str, str]:
    """Scalable target on the variant's instance count + a target-tracking policy on
    SageMakerVariantInvocationsPerInstance (invocations per instance per minute)."""
    if not 1 <= min_capacity <= max_capacity:
        raise DeployError(f"--min-capacity={min_capacity} / --max-capacity={max_capacity}: "
                          "need 1 <= min <= max")
    if target_invocations <= 0:
        raise DeployError(f"--target-invocations={target_invocations} must be > 0")
    rid = resource_id(endpoint, variant)
    aas.register_scalable_target(ServiceNamespace="sagemaker", ResourceId=rid,
                                 ScalableDimension=SCALABLE_DIMENSION,
                                 MinCapacity=min_capacity, MaxCapacity=max_capacity)
    policy = aas.put_scaling_policy(
        PolicyName=f"{endpoint}-invocations", ServiceNamespace="sagemaker", ResourceId=rid,
        ScalableDimension=SCALABLE_DIMENSION, PolicyType="TargetTrackingScaling",
        TargetTrackingScalingPolicyConfiguration={
            "TargetValue": float(target_invocations),
            "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
            "ScaleInCooldown": scale_in_cooldown, "ScaleOutCooldown": scale_out_cooldown})
    return {"resource_id": rid, "policy_arn": policy["PolicyARN"]}


# ------------------------------------------------------------------------------------
# teardown
# ------------------------------------------------------------------------------------
def _is_missing(e) -> bool:
    err = e.response.get("Error", {})
    msg = str(err.get("Message", "")).lower()
    return err.get("Code") in ("ObjectNotFoundException", "ResourceNotFound", "NotFound") or \
        (err.get("Code") == "ValidationException" and
         any(s in msg for s in ("could not find", "does not exist", "no scalable target")))


def teardown(session, name: str, aas=None, log=print) -> list[str]:
    """Delete autoscaling (if `aas`, a boto3 application-autoscaling client), then the SDK's
    Endpoint, EndpointConfig and Model objects. Pieces that are already gone are skipped;
    returns what was deleted, e.g. ["endpoint x", ...]."""
    from botocore.exceptions import ClientError

    resources, _ = sdk()
    endpoint = _get(resources.Endpoint.get, name, session)
    config = _get(resources.EndpointConfig.get, endpoint.endpoint_config_name if endpoint else name, session)
    model_names = sorted({v.model_name for v in config.production_variants}) if config else [name]

    steps = []
    if aas is not None:
        for target in aas.describe_scalable_targets(
                ServiceNamespace="sagemaker", ResourceIds=[resource_id(name)])["ScalableTargets"]:
            steps.append((f"scalable target {target['ResourceId']}", lambda t=target: aas.deregister_scalable_target(
                ServiceNamespace="sagemaker", ResourceId=t["ResourceId"], ScalableDimension=t["ScalableDimension"])))
    if endpoint is not None:
        steps.append((f"endpoint {name}", endpoint.delete))
    if config is not None:
        steps.append((f"endpoint config {config.endpoint_config_name}", config.delete))
    for m in model_names:
        model = _get(resources.Model.get, m, session)
        if model is not None:
            steps.append((f"model {m}", model.delete))

    deleted = []
    for what, delete in steps:
        try:
            delete()
        except ClientError as e:
            if _is_missing(e):
                log(f"{what}: not found, skipped")
                continue
            raise
        deleted.append(what)
        log(f"deleted {what}")
    return deleted


# ------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------
RUNTIME_READ_TIMEOUT = 600


def runtime_config(read_timeout: float = RUNTIME_READ_TIMEOUT):
    """botocore Config for sagemaker-runtime: wait `read_timeout` s for a response and make
    one attempt only. botocore's retry modes resend a request whose answer timed out, so
    with retries a long generation would be generated again (the SDK's own clients use
    the 60 s default read timeout and up to 11 attempts; see docs/DEPLOY.md)."""
    from botocore.config import Config

    return Config(read_timeout=read_timeout, connect_timeout=10, retries={"total_max_attempts": 1})


def clients(region: str | None = None, session=None, read_timeout: float = RUNTIME_READ_TIMEOUT) -> dict:
    """{"session", "sagemaker", "runtime", "autoscaling"} from one boto3 session: the session
    is what the SDK's objects take; `runtime` is a sagemaker-runtime client that never
    retries an invocation (runtime_config); `autoscaling` is application-autoscaling,
    which the SDK does not cover."""
    import boto3

    session = session or boto3.session.Session(region_name=region)
    if not session.region_name:
        raise DeployError("no AWS region: pass --region or set AWS_REGION")
    return {"session": session, "sagemaker": session.client("sagemaker"),
            "runtime": session.client("sagemaker-runtime", config=runtime_config(read_timeout)),
            "autoscaling": session.client("application-autoscaling")}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m handler deploy",
                                description="Deploy the serving image as a SageMaker endpoint.")
    p.add_argument("--region", help="AWS region (default: the AWS configuration's)")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("create", help="create model, endpoint config and endpoint")
    c.add_argument("--properties", required=True, metavar="FILE",
                   help="serving.properties; its keys become OPTION_*/SERVING_* environment variables")
    c.add_argument("--model-data", metavar="S3_URI",
                   help="s3://.../model.tar.gz, or an s3:// prefix of uncompressed model files")
    c.add_argument("--image-uri", required=True, help="ECR URI of the serving image")
    c.add_argument("--role-arn", default=os.environ.get("SAGEMAKER_ROLE_ARN"),
                   help="IAM execution role (default $SAGEMAKER_ROLE_ARN)")
    c.add_argument("--instance-type", default=DEFAULT_INSTANCE_TYPE)
    c.add_argument("--instance-count", type=int, default=1)
    c.add_argument("--name", default=None, help="name of model, config and endpoint (default lmi-serve-TIME)")
    c.add_argument("--startup-timeout", type=int, default=900, metavar="S",
                   help="ContainerStartupHealthCheckTimeoutInSeconds and model download timeout")
    c.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra container environment variable (repeatable)")
    c.add_argument("--wait", action="store_true", help="wait until the endpoint is InService")

    i = sub.add_parser("invoke", help="send one prompt")
    i.add_argument("--endpoint", required=True)
    i.add_argument("--prompt", required=True)
    i.add_argument("--max-new-tokens", type=int, default=64)
    i.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    i.add_argument("--local-url", metavar="URL", help="a local server instead of SageMaker (http://127.0.0.1:8080)")

    a = sub.add_parser("autoscale", help="register target-tracking autoscaling")
    a.add_argument("--endpoint", required=True)
    a.add_argument("--min-capacity", type=int, default=1)
    a.add_argument("--max-capacity", type=int, default=2)
    a.add_argument("--target-invocations", type=float, default=10.0,
                   help="target invocations per instance per minute")
    a.add_argument("--scale-in-cooldown", type=int, default=300)
    a.add_argument("--scale-out-cooldown", type=int, default=60)

    d = sub.add_parser("delete", help="delete autoscaling, endpoint, endpoint config and model")
    d.add_argument("--name", required=True)
    return p


def _run(args) -> int:
    if args.command == "create":
        name = args.name or time.strftime("lmi-serve-%Y%m%d-%H%M%S")
        _check_inputs(name, args.image_uri, args.role_arn, args.instance_type, args.instance_count,
                      args.model_data)
        notes: list[str] = []
        env = environment_from_properties(args.properties, model_data=args.model_data,
                                          instance_type=args.instance_type, notes=notes)
        for kv in args.env:
            key, sep, value = kv.partition("=")
            if not sep or not _ENV_NAME.fullmatch(key):
                raise DeployError(f"--env {kv!r}: expected KEY=VALUE")
            env[key] = value
        for note in notes:
            print(f"note: {note}")
        print("container environment: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
        out = create_deployment(clients(args.region)["session"], name=name, image_uri=args.image_uri,
                                role_arn=args.role_arn, env=env, model_data=args.model_data,
                                instance_type=args.instance_type, instance_count=args.instance_count,
                                startup_timeout=args.startup_timeout, wait=args.wait)
        print(json.dumps(out))
    elif args.command == "invoke":
        runtime = LocalRuntime(args.local_url) if args.local_url else clients(args.region)["runtime"]
        if args.stream:
            n, details = 0, {}
            for line in invoke_stream(runtime, args.endpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                                      parameters={"details": True}):
                if "token" in line:
                    n += 1
                    print(line["token"]["text"], end="", flush=True)
                details = line.get("details", details)
            print(f"\n[{n} tokens streamed, finish_reason={details.get('finish_reason', '?')}]")
        else:
            out = invoke(runtime, args.endpoint, args.prompt, max_new_tokens=args.max_new_tokens)
            print(json.dumps(out, indent=2))
    elif args.command == "autoscale":
        out = register_autoscaling(clients(args.region)["autoscaling"], args.endpoint, min_capacity=args.min_capacity,
                                   max_capacity=args.max_capacity, target_invocations=args.target_invocations,
                                   scale_in_cooldown=args.scale_in_cooldown,
                                   scale_out_cooldown=args.scale_out_cooldown)
        print(json.dumps(out))
    elif args.command == "delete":
        aws = clients(args.region)
        teardown(aws["session"], args.name, aas=aws["autoscaling"])
    return 0


def main(argv: list[str]) -> int:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except DeployError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ClientError as e:
        err = e.response.get("Error", {})
        print(f"error: AWS {e.operation_name}: {err.get('Code', '?')}: "
              f"{' '.join(str(err.get('Message', e)).split())}", file=sys.stderr)
        return 1
    except NoCredentialsError:
        print("error: no AWS credentials: run `aws configure`, set AWS_PROFILE, or set "
              "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY", file=sys.stderr)
        return 1
    except BotoCoreError as e:
        print(f"error: AWS: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
