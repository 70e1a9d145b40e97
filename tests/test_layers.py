"""The layer contracts of pyproject.toml's [tool.importlinter] hold (lint-imports): tools above the
server, HTTP and model side by side above the torch-free engine, config at the bottom, no cycles."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "0 broken" in r.stdout, r.stdout[-2000:]


def test_handler_top_level_stays_small():
    # The tree shows the architecture: everything but the entry points lives in a layer package.
    modules = sorted(p.name for p in (ROOT / "handler").glob("*.py"))
    assert len(modules) <= 6, modules


def test_a_tool_command_without_the_tools_package_says_so(monkeypatch, capsys):
    # The serving image leaves handler/tools out (container/Dockerfile.dockerignore).
    import importlib

    import handler.__main__ as cli
    real = importlib.import_module

    def no_tools(name, *a, **kw):
        if name.startswith("handler.tools"):
            raise ModuleNotFoundError(f"No module named {name!r}", name="handler.tools")
        return real(name, *a, **kw)
    monkeypatch.setattr(cli.importlib, "import_module", no_tools)
    assert cli.main(["tune", "--help"]) == 2
    err = capsys.readouterr().err
    assert "`tune` is a client-side tool" in err and "Traceback" not in err
    assert "handler/tools/" in (ROOT / "container" / "Dockerfile.dockerignore").read_text()
