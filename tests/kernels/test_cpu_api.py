"""kernels/cpu_api.h is the one declaration of the CPU kernels' entry points: the compiler holds every
definition to it, and kernels/cpu/'s ctypes bindings are derived from it."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from kernels import cpu as cpu_ext, isa
from kernels.cpu import bindings as cpu_bindings, build as cpu_build, lib as cpu_lib

HEADER = os.path.join(cpu_build.SRC_DIR, "cpu_api.h")
pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="needs a C compiler (cc/gcc) for the kernels")


@pytest.mark.parametrize("backend", isa.host_isas())
def test_every_exported_entry_point_is_declared_in_the_header(backend):
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) not installed")
    so = cpu_lib.build(isa=backend)
    out = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    exported = {ln.split()[-1] for ln in out.splitlines() if ln.split() and ln.split()[-1].startswith("lmi_")}
    assert exported == set(cpu_bindings.API), (exported ^ set(cpu_bindings.API))


def test_a_definition_that_differs_from_its_declaration_does_not_compile(tmp_path):
    src = tmp_path / "drift.c"
    src.write_text('#include "cpu_api.h"\nvoid lmi_pack_b(const float *W, int N, int64_t K, float *out) '
                   '{ (void)W; (void)N; (void)K; (void)out; }\n')
    r = subprocess.run([cpu_build.compiler(), "-c", "-I", os.path.dirname(HEADER), str(src), "-o", str(tmp_path / "d.o")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "conflicting types" in r.stderr


def test_the_derived_structures_have_the_c_layout(tmp_path):
    src = tmp_path / "layout.c"
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "cpu_api.h"\nint main(void) {\n'
                   '  printf("%zu %zu %zu %zu %zu %d\\n", sizeof(lmi_lin), sizeof(lmi_layer), offsetof(lmi_layer, down),\n'
                   '         offsetof(lmi_layer, kc), offsetof(lmi_layer, window), LIN_I8);\n  return 0;\n}\n')
    exe = tmp_path / "layout"
    subprocess.run([cpu_build.compiler(), "-I", os.path.dirname(HEADER), str(src), "-o", str(exe)], check=True)
    got = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    L = cpu_ext.Layer
    assert [int(x) for x in got] == [ctypes.sizeof(cpu_ext.Lin), ctypes.sizeof(L), L.down.offset, L.kc.offset,
                                     L.window.offset, cpu_ext.LIN_I8]


def test_the_parser_types_each_parameter():
    api, structs, enums = cpu_bindings.parse_api(
        "/* c */ enum { A = 0, B = 3 };\ntypedef struct { int64_t a, b; const float *p; } s;\n"
        "typedef struct { s x, y; void *q; } t;\n"
        "int lmi_f(const float *x, int64_t n, float eps, int k, const t *layers);\nvoid lmi_g(void);\n")
    assert api["lmi_f"] == (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                                           ctypes.c_void_p])
    assert api["lmi_g"] == (None, [])
    assert enums == {"A": 0, "B": 3}
    assert [f for f, _ in structs["t"]._fields_] == ["x", "y", "q"] and structs["t"]._fields_[0][1] is structs["s"]
    with pytest.raises(ValueError, match="no ctypes type"):
        cpu_bindings.parse_api("void lmi_h(size_t n);")
