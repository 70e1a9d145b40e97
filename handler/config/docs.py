"""The reference tables rendered from the declarations: serving.properties keys
(handler/config/schema.py) and the LMI_* environment switches (handler/config/switches.py).

    python -m handler.config.docs --check     # exit 1 naming every stale generated block
    python -m handler.config.docs --write     # rewrite them
    python -m handler.config.docs --print properties

A generated block sits between a `<!-- NAME:begin -->` line and a `<!-- NAME:end -->` line; the
prose around it is hand-written. docs/PROPERTIES.md must have its markers; README.md's compact
table (`properties-summary`) is filled when its markers are there and skipped otherwise.
tests/config/test_docs.py fails when a block differs from what this renders.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable

from handler.config import compat
from handler.config.schema import ALIASES, IGNORED, KEYS, PORT, SCHEMA, Key
from handler.config.switches import SWITCHES


def _code(v) -> str:
    if isinstance(v, bool):
        v = str(v).lower()
    elif isinstance(v, float):
        v = format(v, "g")
    return f"`{v}`"


def _default_cell(k: Key) -> str:
    if k.default_doc is not None:
        return k.default_doc
    return "" if k.default is None else _code(k.default)


def _values_cell(k: Key) -> str:
    if k.values is not None:
        return k.values
    if k.allowed:
        text = ", ".join(_code(a) for a in k.allowed)
        aliases = getattr(k.parse, "aliases", ())
        return text + (f" (also {', '.join(_code(a) for a in aliases)})" if aliases else "")
    return ", ".join(x for x in (k.unit, getattr(k.parse, "doc", "")) if x)


def _doc_order() -> list[Key]:
    """Declaration order, each alias right after the key it names."""
    out = []
    for k in KEYS:
        if not k.alias_of:
            out.append(k)
            out.extend(SCHEMA[a] for a in ALIASES.get(k.name, ()))
    return out


def _row(*cells: str) -> str:
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def _env_cell(k: Key) -> str:
    return ", ".join(_code(v) for v in (*k.explicit_env, *k.env))


def render_properties_table() -> str:
    """docs/PROPERTIES.md's "Keys" table."""
    rows = ["| key | default | unit / values | meaning | environment |", "|---|---|---|---|---|"]
    for k in _doc_order():
        env = _env_cell(k) + (f" {k.env_doc}" if k.env_doc else "")
        rows.append(_row(_code(k.name), _default_cell(k), _values_cell(k), k.doc, env))
    rows.append(_row("(port)", _code(PORT.default), PORT.values, PORT.doc, _code(PORT.var)))
    return "\n".join(rows)


def render_properties_summary() -> str:
    """README.md's compact table: key | default | environment variable."""
    rows = ["| key | default | environment variable |", "|---|---|---|"]
    for k in _doc_order():
        default = k.summary_default
        if default is None:
            default = _default_cell(k)
            if k.default is not None and k.unit in ("ms", "s"):
                default += f" ({k.unit})"
        rows.append(_row(_code(k.name), default, _env_cell(k)))
    rows.append(_row("(port)", _code(PORT.default), _code(PORT.var)))
    return "\n".join(rows)


def render_ignored_keys() -> str:
    """docs/PROPERTIES.md's list of the LMI keys accepted and ignored, wrapped at 100 columns."""
    words = [_code(k) + "," for k in IGNORED]
    words[-1] = words[-1][:-1] + "."
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > 100:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return "\n".join(lines + [line])


def render_switches_table() -> str:
    """docs/PROPERTIES.md's table of the LMI_* environment switches."""
    rows = ["| variable | default | values | meaning | read by |", "|---|---|---|---|---|"]
    for s in SWITCHES.values():
        rows.append(_row(_code(s.name), s.default_shown, s.values_doc, s.doc, s.read_by))
    return "\n".join(rows)


def render_lmi_lines() -> str:
    """docs/PROPERTIES.md's table of what each option.lmi_compat line changes."""
    names = list(compat.LINES)
    rows = ["| behaviour | " + " | ".join(_code(n) for n in names) + " |", "|---|" + "---|" * len(names)]
    for what, by_line in compat.DIFFERENCES:
        rows.append(_row(what, *(by_line[n] for n in names)))
    return "\n".join(rows)


# file (relative to the repository root) -> block name -> renderer; `required`: a file whose
# markers must exist (README.md's block is filled only once its markers are there).
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "docs/PROPERTIES.md": {"properties": render_properties_table, "ignored-keys": render_ignored_keys,
                           "switches": render_switches_table, "lmi-lines": render_lmi_lines},
    "README.md": {"properties-summary": render_properties_summary},
}
REQUIRED = {"docs/PROPERTIES.md"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def fill(text: str, name: str, body: str) -> str | None:
    """`text` with block `name` replaced by `body`; None when its markers are absent."""
    begin, end = _markers(name)
    m = re.search(rf"^{re.escape(begin)}[ \t]*\n(.*?)^{re.escape(end)}[ \t]*$", text, re.S | re.M)
    if m is None:
        return None
    return text[:m.start(1)] + body.rstrip("\n") + "\n" + text[m.end(1):]


def block(text: str, name: str) -> str | None:
    """The current content of block `name` (None when its markers are absent)."""
    begin, end = _markers(name)
    m = re.search(rf"^{re.escape(begin)}[ \t]*\n(.*?)^{re.escape(end)}[ \t]*$", text, re.S | re.M)
    return None if m is None else m.group(1).rstrip("\n")


def sync(root: str = ROOT, write: bool = False) -> list[str]:
    """Compare (and with write=True rewrite) every generated block; returns the problems found:
    'FILE: block NAME is stale' / 'FILE: no NAME markers'."""
    problems = []
    for rel, blocks in BLOCKS.items():
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            if rel in REQUIRED:
                problems.append(f"{rel}: missing")
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = text
        for name, render in blocks.items():
            filled = fill(new, name, render())
            if filled is None:
                if rel in REQUIRED:
                    problems.append(f"{rel}: no {' / '.join(_markers(name))} markers")
                continue
            if filled != new:
                problems.append(f"{rel}: block {name} is stale")
                new = filled
        if write and new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m handler.config.docs",
                                description="Render the properties and switches reference tables from the "
                                            "schema into docs/PROPERTIES.md (and README.md's summary).")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", action="store_true", help="exit 1 if a generated block differs")
    g.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    g.add_argument("--print", choices=sorted(n for b in BLOCKS.values() for n in b), metavar="BLOCK",
                   help="print one rendered block")
    p.add_argument("--root", default=ROOT, help="repository root (default: this checkout)")
    a = p.parse_args(argv)
    if a.print:
        print(next(b[a.print] for b in BLOCKS.values() if a.print in b)())
        return 0
    problems = sync(a.root, write=a.write)
    for line in problems:
        print(("fixed: " if a.write and "stale" in line else "") + line, file=sys.stderr)
    if a.write:
        return 1 if any("stale" not in line for line in problems) else 0
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
