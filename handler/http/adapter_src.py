"""Where the LoRA management routes may register an adapter from (`POST .../adapters?src=...`).

On SageMaker anyone allowed to invoke the endpoint can call these routes, so `src` is not trusted:
  - a relative `src` is taken under `<model dir>/adapters/` (LMI's layout);
  - an absolute one must lie under `<model dir>/adapters/` or a directory of `option.adapter_roots`;
  - an `s3://bucket/prefix` must lie under an `s3://` prefix of `option.adapter_roots` (it is then
    downloaded, as LMI does, by the model layer);
  - `..` segments, NUL bytes and anything else are refused lexically, before the file system is
    touched, and a symlink under an allowed root that leads out of it is refused the same way.
Every refusal is the same 403 with the same text whatever exists on disk: no file-system oracle.
No torch, no Flask: plain path arithmetic.
"""
from __future__ import annotations

import os
import posixpath

ADAPTERS_DIR = "adapters"      # <model dir>/adapters/<name>/, as handler.model.lora reads at start-up


class SrcRefused(Exception):
    """`src` is outside every allowed root (the message never says whether it exists)."""


def refused(src: str) -> SrcRefused:
    shown = src if len(src) <= 200 and src.isprintable() else repr(src[:200])
    return SrcRefused(f"src {shown} is not allowed: give an adapter name under <model dir>/{ADAPTERS_DIR}/, "
                      "or a path or s3:// URI under one of option.adapter_roots")


def _under(path: str, root: str, strict: bool) -> bool:
    root = root.rstrip("/") or "/"
    if path == root:
        return not strict
    return path.startswith(root if root.endswith("/") else root + "/")


def _s3_key(uri: str) -> str | None:
    """'s3://Bucket/a/b/' -> 'bucket/a/b' (None if it has '.', '..' or empty segments)."""
    rest = uri[5:]
    bucket, _, prefix = rest.partition("/")
    parts = [p for p in prefix.rstrip("/").split("/")] if prefix.rstrip("/") else []
    if not bucket or any(p in ("", ".", "..") for p in parts):
        return None
    return "/".join([bucket.lower(), *parts])


def resolve(src: str, model_dir: str, roots: tuple[str, ...] = ()) -> str:
    """The local directory (or s3:// URI) to register from; raises SrcRefused."""
    if not isinstance(src, str) or not src or "\x00" in src or "\\" in src:
        raise refused(str(src))
    if src[:5].lower() == "s3://":
        key = _s3_key(src)
        for root in roots:
            if root[:5].lower() == "s3://":
                rkey = _s3_key(root)
                if key is not None and rkey is not None and _under(key, rkey, strict=True):
                    return "s3://" + key
        raise refused(src)
    if ".." in src.split("/"):
        raise refused(src)
    adapters = posixpath.normpath(os.path.join(os.path.abspath(model_dir), ADAPTERS_DIR))
    local_roots = [(adapters, True)] + [(posixpath.normpath(r), False) for r in roots
                                        if r[:5].lower() != "s3://"]
    path = posixpath.normpath(src if src.startswith("/") else posixpath.join(adapters, src))
    admitted = [(r, strict) for r, strict in local_roots if _under(path, r, strict)]
    if not admitted:
        raise refused(src)
    # Symlinks: the real path must stay under the real path of a root that admitted it.
    real = os.path.realpath(path)
    if not any(_under(real, os.path.realpath(r), strict) for r, strict in admitted):
        raise refused(src)
    return real
