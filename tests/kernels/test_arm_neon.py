"""The CPU kernels' aarch64 NEON build, cross-compiled here and run under qemu-user against plain C
references (tests/kernels/arm/check_kernels.c): every kernel the build reports available must be
checked and pass, bit for bit where the contract is (the panel GEMMs, int8, the 4/8-bit GEMM,
rotary, KV writes (int8 ones too), SiLU, the one-call layer stack), within tolerances of float64 elsewhere.

No Arm hardware is needed and no Arm speed is measured: qemu checks values only. The same driver
also runs natively on the x86 builds this CPU runs (a check of its references against builds the
other tests hold to torch)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from kernels import cpu as cpu_ext, isa
from kernels.cpu import build as cpu_build

CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arm", "check_kernels.c")
KERNELS = cpu_build.SRC_DIR

_missing = [t for t in (CC, QEMU) if shutil.which(t) is None]
needs_cross = pytest.mark.skipif(bool(_missing), reason=f"{' and '.join(_missing)} not on PATH: the NEON build is "
                                 "checked under qemu (apt-get install gcc-aarch64-linux-gnu qemu-user)")

# Every kernel family the driver knows; each must be reported (available or not).
FAMILIES = {"gemm", "gemm_bf16w", "gemm_bf16", "gemm_i8", "gemm_q", "silu", "prefill_attention_fp32",
            "prefill_attention_bf16", "step_layers", "step_layers_bf16", "rotary", "write_kv", "rms_norm", "row_stats",
            "decode_attention", "kv_int8", "moe", "moe_bf16", "encoder_attention_fp32", "encoder_attention_bf16"}


def _run(cmd, timeout):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stderr[-4000:]}"


def _driver(cc, backend, target, out, runner=()):
    """The driver linked with backend's kernels (every source of its build, the generic layer and its
    architecture folder, with its own flags from kernels/cpu/, `target` from kernels/isa.py), run (under
    `runner`, e.g. qemu); (target, the finished process)."""
    objs = []
    for i, (src, flags) in enumerate(cpu_build.sources(backend)):
        obj = str(out / f"{i}.o")
        _run([cc, *flags, *target, "-c", src, "-o", obj], timeout=300)
        objs.append(obj)
    exe = str(out / "check_kernels")
    # the references round every product and sum on its own (no FMA contraction)
    _run([cc, "-O2", "-ffp-contract=off", "-fopenmp", *target, "-I", KERNELS, DRIVER, *objs, "-lm", "-o", exe],
         timeout=300)
    return target, subprocess.run([*runner, exe], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", params=[set(), {"bf16", "i8mm"}], ids=["armv8.2-dotprod", "with-bf16-i8mm"])
def neon_report(request, tmp_path_factory):
    """The driver's output for the NEON build (kernels/isa.py's flags for a CPU listing `param`)."""
    return _driver(CC, "neon", isa.compile_flags("neon", request.param), tmp_path_factory.mktemp("neon"),
                   (QEMU, "-L", SYSROOT))


def _check(target, r) -> tuple[dict, dict, str]:
    """The driver's AVAIL and CHECK lines; asserts every kernel reported available passed."""
    out = r.stdout
    shown = f"{' '.join(target)}: rc {r.returncode}\n{out}\n{r.stderr[-3000:]}"
    avail = {name: flag == "1" for name, flag in re.findall(r"^AVAIL (\S+) ([01])$", out, re.M)}
    checks = {name: (status, detail) for name, status, detail in re.findall(r"^CHECK (\S+) (PASS|FAIL) ?(.*)$", out, re.M)}
    assert set(avail) == FAMILIES, shown
    assert re.search(r"^DONE 0 failed$", out, re.M) and r.returncode == 0, shown
    assert not [n for n, (s, _) in checks.items() if s != "PASS"], shown
    unchecked = [n for n, on in avail.items() if on and n not in checks]
    assert not unchecked, f"reported available but not checked: {unchecked}\n{shown}"
    return avail, checks, shown


@needs_cross
def test_every_kernel_the_neon_build_provides_passes_under_qemu(neon_report):
    target, _ = neon_report
    avail, checks, shown = _check(*neon_report)
    # The NEON branches: the panel GEMMs (fp32, bf16 widened, int8, 4/8-bit), SiLU and so the stack and
    # the experts' call.
    # (The bf16 dot-product GEMM is AVX512-BF16 only: reported unavailable, the widened one serves.)
    for name in ("gemm", "gemm_bf16w", "gemm_i8", "gemm_q", "silu", "prefill_attention_fp32", "step_layers",
                 "step_layers_bf16", "moe", "moe_bf16", "encoder_attention_fp32"):
        assert avail.get(name), f"the NEON build does not provide {name}\n{shown}"
    print(f"\nNEON ({' '.join(target)}) under qemu:\n" + "\n".join(
        f"  {n}: {checks[n][0]} {checks[n][1]}" if n in checks else f"  {n}: not in this build" for n in sorted(avail)))


@pytest.mark.skipif(not isa.host_isas() or isa.machine() != "x86_64", reason="no x86 build runs on this CPU")
@pytest.mark.parametrize("build", [b for b in isa.host_isas() if b != "neon"] or ["none"])
def test_the_driver_passes_on_this_hosts_builds(build, tmp_path):
    # The same driver on the x86 builds this CPU runs (no qemu): its references checked against
    # builds the other tests hold to torch and to each other.
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) on PATH")
    avail, checks, _ = _check(*_driver(cc, build, isa.compile_flags(build), tmp_path))
    assert avail["gemm"] and avail["silu"] and checks["step_layers"][0] == "PASS" and checks["moe"][0] == "PASS"
