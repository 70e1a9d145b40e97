"""What the benchmark scripts share: the model flags of their command line, and where --out goes."""
from __future__ import annotations

import argparse
import json
import os


def model_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the script's first doc paragraph, with --model-dir, --dtype, --quantize, --out."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--quantize")
    p.add_argument("--out")
    return p


def write_json(path: str | None, obj) -> None:
    """Write `obj` to `path` (indented JSON); nothing when path is None or empty."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
