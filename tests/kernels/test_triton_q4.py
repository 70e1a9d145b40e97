"""kernels/triton_q4.py (the CUDA dequant-GEMM of grouped 4-bit weights): against float64 of the
dequantized weights under the Triton interpreter, and compiled for Hopper without a GPU."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_q4_gemm_under_the_interpreter_matches_float64():
    # A fresh process: TRITON_INTERPRET must be set before triton is first imported.
    r = subprocess.run([sys.executable, "-m", "kernels.triton_q4"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "0 failure(s)" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("ok   ") == 4, r.stdout


@needs_triton
def test_q4_gemm_compiles_for_hopper_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "kernels.triton_q4", "--compile-sm", "90"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("compiled _q4_gemm_kernel for sm_90") == 6, r.stdout
