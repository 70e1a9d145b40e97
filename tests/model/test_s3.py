"""handler.model.s3 against moto's S3 server on loopback, through the real boto3 HTTP client."""
from __future__ import annotations

import logging
import os

import boto3
import pytest
from moto.server import ThreadedMotoServer

from handler.model.s3 import MANIFEST, S3ModelError, parse_s3_uri, resolve_model_dir

FILES = {
    "config.json": b'{"model_type": "llama", "vocab_size": 8192}',
    "tokenizer.json": b'{"version": "1.0"}' * 50,
    "model.safetensors": bytes(range(256)) * 4096,  # 1 MiB, not valid safetensors: bytes only
    "sub/extra.txt": b"nested file",
}


@pytest.fixture(scope="module")
def moto_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("LMI_MODEL_CACHE", str(tmp_path / "cache"))
    client = boto3.client("s3")
    bucket = f"models-{os.urandom(4).hex()}"
    client.create_bucket(Bucket=bucket)
    for rel, data in FILES.items():
        client.put_object(Bucket=bucket, Key=f"llama/tiny/{rel}", Body=data)
    client.put_object(Bucket=bucket, Key="llama/tiny2/config.json", Body=b"{}")  # shares the prefix text
    client.put_object(Bucket=bucket, Key="llama/tiny/", Body=b"")  # console-style directory marker
    return client, bucket


def read_tree(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def test_downloads_every_object_under_the_prefix(s3, tmp_path, caplog):
    _, bucket = s3
    with caplog.at_level(logging.INFO, logger="handler.s3"):
        local = resolve_model_dir(f"s3://{bucket}/llama/tiny")
    assert local == str(tmp_path / "cache" / bucket / "llama" / "tiny")
    tree = read_tree(local)
    tree.pop(MANIFEST)
    assert tree == FILES  # not llama/tiny2/*, no directory marker
    assert "downloading 4" in caplog.text and "[4/4]" in caplog.text


def test_second_resolve_skips_unchanged_files_and_refreshes_changed_ones(s3, tmp_path):
    client, bucket = s3
    uri = f"s3://{bucket}/llama/tiny/"
    target = str(tmp_path / "explicit")
    assert resolve_model_dir(uri, cache_dir=target) == target
    weights = os.path.join(target, "model.safetensors")
    os.utime(weights, (1, 1))  # an old mtime marks "not rewritten"

    client.put_object(Bucket=bucket, Key="llama/tiny/config.json", Body=b'{"model_type": "qwen2"}')
    client.delete_object(Bucket=bucket, Key="llama/tiny/sub/extra.txt")
    resolve_model_dir(uri, cache_dir=target)

    assert os.stat(weights).st_mtime == 1
    tree = read_tree(target)
    assert tree["config.json"] == b'{"model_type": "qwen2"}'
    assert "sub/extra.txt" not in tree  # removed from S3 -> removed from the cache


def test_corrupted_cached_file_is_downloaded_again(s3, tmp_path):
    _, bucket = s3
    target = str(tmp_path / "c")
    resolve_model_dir(f"s3://{bucket}/llama/tiny", cache_dir=target)
    with open(os.path.join(target, "tokenizer.json"), "wb") as f:
        f.write(b"truncated")
    resolve_model_dir(f"s3://{bucket}/llama/tiny", cache_dir=target)
    assert read_tree(target)["tokenizer.json"] == FILES["tokenizer.json"]


@pytest.mark.parametrize("uri, words", [
    ("s3://", "no bucket name"),
    ("s3:///x", "no bucket name"),
    ("http://bucket/x", "not an S3 URI"),
    ("s3://bucket/a/../b", "'..'"),
])
def test_bad_uris(uri, words):
    with pytest.raises(S3ModelError) as err:
        resolve_model_dir(uri)
    assert words in str(err.value) and repr(uri) in str(err.value)
    assert "\n" not in str(err.value)


def test_parse_s3_uri():
    assert parse_s3_uri("s3://b") == ("b", "")
    assert parse_s3_uri("s3://b/a/c") == ("b", "a/c/")
    assert parse_s3_uri("s3://b/a/c/") == ("b", "a/c/")


def test_missing_bucket(s3):
    with pytest.raises(S3ModelError, match=r"^S3 bucket 'no-such-bucket-x' does not exist"):
        resolve_model_dir("s3://no-such-bucket-x/llama")


def test_prefix_without_objects(s3):
    _, bucket = s3
    with pytest.raises(S3ModelError, match=rf"^no objects under s3://{bucket}/nothing/here/$"):
        resolve_model_dir(f"s3://{bucket}/nothing/here")


def test_tarball_uri_gets_a_hint(s3):
    _, bucket = s3
    with pytest.raises(S3ModelError, match="model.tar.gz is not supported"):
        resolve_model_dir(f"s3://{bucket}/llama/model.tar.gz")


def test_no_credentials(no_aws_credentials, monkeypatch, moto_endpoint):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    with pytest.raises(S3ModelError, match=r"^no AWS credentials to read s3://b/m/"):
        resolve_model_dir("s3://b/m")


def test_access_denied_message():
    from botocore.stub import Stubber

    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="a", aws_secret_access_key="b")
    with Stubber(client) as stub:
        stub.add_client_error("list_objects_v2", service_error_code="AccessDenied",
                              service_message="Access Denied", http_status_code=403)
        with pytest.raises(S3ModelError, match=r"^access denied reading s3://locked/m/ \(AccessDenied\)"):
            resolve_model_dir("s3://locked/m", cache_dir="/tmp/unused-lmi-test", client=client)


def test_an_s3_adapter_is_downloaded_into_the_adapter_cache(s3, tmp_path):
    """POST .../adapters?src=s3://... (allowed by option.adapter_roots): LoraManager.register
    downloads it as LMI does, into LMI_MODEL_CACHE/adapters/<bucket>/<prefix>."""
    from handler.model.lora import AdapterError, fetch_s3
    client, bucket = s3
    client.put_object(Bucket=bucket, Key="adapters/a1/adapter_config.json", Body=b'{"r": 4}')
    client.put_object(Bucket=bucket, Key="adapters/a1/adapter_model.safetensors", Body=b"x" * 10)
    local = fetch_s3("a1", f"s3://{bucket}/adapters/a1")
    assert local == str(tmp_path / "cache" / "adapters" / bucket / "adapters" / "a1")
    assert open(os.path.join(local, "adapter_config.json")).read() == '{"r": 4}'
    with pytest.raises(AdapterError, match=r"adapter 'a2' \(s3://.*no objects under"):
        fetch_s3("a2", f"s3://{bucket}/adapters/a2")
