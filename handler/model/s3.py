"""Download a model stored under an S3 prefix into a local cache directory.

`option.model_id=s3://bucket/prefix` names an uncompressed model directory (config.json,
weights, tokenizer files). Objects are copied to
`$LMI_MODEL_CACHE/<bucket>/<prefix>` (default root /tmp/lmi-serve/models); files whose
size and ETag match the previous download are kept. The endpoint and credentials come
from boto3's usual chain, so AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 redirect it.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path, PurePosixPath

from handler.config.switches import SWITCHES, switch

log = logging.getLogger("handler.s3")   # the name operators filter on (unchanged by the layout)

DEFAULT_CACHE_ROOT = SWITCHES["LMI_MODEL_CACHE"].default   # "/tmp/lmi-serve/models"
MANIFEST = ".lmi-s3-manifest.json"  # {relative path: {"size": int, "etag": str}}


class S3ModelError(Exception):
    """A model under s3:// cannot be fetched; the message is one line for the user."""


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """'s3://bucket/a/b/' -> ('bucket', 'a/b/'); the prefix is '' or ends with '/'."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise S3ModelError(f"option.model_id={uri!r} is not an S3 URI: expected s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise S3ModelError(f"option.model_id={uri!r} has no bucket name: expected s3://bucket/prefix")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise S3ModelError(f"option.model_id={uri!r} has an empty, '.' or '..' path segment")
    return bucket, prefix + "/" if prefix else ""


def default_cache_dir(bucket: str, prefix: str) -> str:
    root = switch("LMI_MODEL_CACHE")   # unset or empty: DEFAULT_CACHE_ROOT
    return str(Path(root, bucket, prefix.strip("/")))


def resolve_model_dir(model_id: str, cache_dir: str | None = None, client=None) -> str:
    """Fetch every object under the S3 prefix `model_id` into `cache_dir` and return it.

    cache_dir: the directory to fill (default `default_cache_dir(bucket, prefix)`).
    client: a boto3 S3 client (default: one from a new boto3 session).
    Raises S3ModelError with a one-line message on any failure.
    """
    bucket, prefix = parse_s3_uri(model_id)
    uri = f"s3://{bucket}/{prefix}"
    target = Path(cache_dir or default_cache_dir(bucket, prefix))
    try:
        if client is None:
            import boto3

            client = boto3.session.Session().client("s3")  # fresh: reads the environment now
        objects = _list_objects(client, bucket, prefix)
        if not objects:
            hint = " (a model.tar.gz is not supported here: point option.model_id at the uncompressed files)" \
                if prefix.rstrip("/").endswith((".tar.gz", ".tgz")) else ""
            raise S3ModelError(f"no objects under {uri}{hint}")
        return str(_download(client, bucket, uri, objects, target))
    except S3ModelError:
        raise
    except Exception as exc:  # botocore errors -> one line naming the URI
        raise S3ModelError(_describe(exc, bucket, uri)) from exc


def _list_objects(client, bucket: str, prefix: str) -> dict[str, tuple[str, int, str]]:
    """-> {relative path: (key, size, etag)}; directory markers are skipped."""
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):
                continue
            rel = key[len(prefix):]
            if any(part in ("", ".", "..") for part in PurePosixPath(rel).parts) or rel.startswith("/"):
                raise S3ModelError(f"object key {key!r} in s3://{bucket} cannot be a local file name")
            objects[rel] = (key, obj["Size"], obj.get("ETag", "").strip('"'))
    return objects


def _download(client, bucket: str, uri: str, objects: dict, target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    manifest_path = target / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}

    # Files a previous download put here that are gone from S3 (e.g. old shards).
    for rel in set(manifest) - set(objects):
        (target / rel).unlink(missing_ok=True)
        manifest.pop(rel)

    todo = []
    for rel, (key, size, etag) in sorted(objects.items()):
        path = target / rel
        cached = manifest.get(rel)
        if cached == {"size": size, "etag": etag} and path.is_file() and path.stat().st_size == size:
            continue
        todo.append((rel, key, size, etag))
    total = sum(size for *_, size, _ in todo)
    log.info("%s: %d files, %d cached, downloading %d (%.1f MB) to %s",
             uri, len(objects), len(objects) - len(todo), len(todo), total / 1e6, target)

    done = 0
    start = time.monotonic()
    for i, (rel, key, size, etag) in enumerate(todo, 1):
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        client.download_file(bucket, key, str(tmp), Callback=_Progress(rel, size))
        os.replace(tmp, path)
        manifest[rel] = {"size": size, "etag": etag}
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        done += size
        log.info("[%d/%d] %s (%.1f MB), %.1f/%.1f MB in %.1f s",
                 i, len(todo), rel, size / 1e6, done / 1e6, total / 1e6, time.monotonic() - start)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return target


class _Progress:
    """boto3 transfer callback: logs a large file's progress at most every 10 s."""

    def __init__(self, name: str, size: int):
        self.name, self.size, self.seen = name, size, 0
        self.last = time.monotonic()

    def __call__(self, nbytes: int) -> None:
        self.seen += nbytes
        now = time.monotonic()
        if now - self.last >= 10 and self.size:
            self.last = now
            log.info("  %s: %.0f%% of %.1f MB", self.name, 100 * self.seen / self.size, self.size / 1e6)


def _describe(exc: Exception, bucket: str, uri: str) -> str:
    from botocore.exceptions import (BotoCoreError, ClientError, EndpointConnectionError,
                                     NoCredentialsError, PartialCredentialsError)

    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return (f"no AWS credentials to read {uri}: attach an IAM role with s3:GetObject and "
                "s3:ListBucket, or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    if isinstance(exc, EndpointConnectionError):
        return f"cannot reach S3 to read {uri}: {exc}"
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        if code in ("NoSuchBucket", "404"):
            return f"S3 bucket '{bucket}' does not exist (reading {uri})"
        if code in ("AccessDenied", "403", "AllAccessDisabled", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch", "ExpiredToken"):
            return (f"access denied reading {uri} ({code}): the role needs s3:ListBucket on "
                    f"arn:aws:s3:::{bucket} and s3:GetObject on its objects")
        return f"S3 error {code} reading {uri}: {err.get('Message') or exc}"
    if isinstance(exc, BotoCoreError):
        return f"S3 error reading {uri}: {exc}"
    if isinstance(exc, OSError):
        return f"cannot write the model from {uri} to the local cache: {exc}"
    return f"cannot download {uri}: {type(exc).__name__}: {exc}"
