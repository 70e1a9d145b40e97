"""A non-editable install carries what the server needs at run time: the CPU kernels' C sources,
which kernels/cpu/ compiles on the serving host (pyproject's package-data)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_kernel_sources(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheels = list(tmp_path.glob("lmi_serve-*.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    # every C source and header, the per-architecture folders' (kernels/x86, kernels/arm) included
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels").rglob("*") if p.suffix in (".c", ".h"))
    assert "kernels/x86/gemm.c" in sources and "kernels/arm/gemm.c" in sources
    assert "kernels/cpu/build.py" in names
    assert [s for s in sources if s not in names] == []
