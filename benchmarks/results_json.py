"""Where a benchmark script's --out goes: one JSON file, its folder made if missing."""
from __future__ import annotations

import json
import os


def write_json(path: str | None, obj) -> None:
    """Write `obj` to `path` (indented JSON); nothing when path is None or empty."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
