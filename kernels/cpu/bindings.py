"""The C kernels' entry points, structs and constants as ctypes types, parsed once from kernels/cpu_api.h
(declared once, compiler-checked by every source that includes it). Plain Python: no torch."""
from __future__ import annotations

import ctypes
import os
import re

from kernels.cpu.build import SRC_DIR

_C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "float": ctypes.c_float,
            "double": ctypes.c_double}


def parse_api(text: str) -> tuple[dict, dict, dict]:
    """kernels/cpu_api.h -> ({entry point: (restype, argtypes)}, {struct name: ctypes.Structure},
    {enum constant: value}). Pointers of any type are c_void_p (callers pass data_ptr()s)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    enums = {k: int(v) for body in re.findall(r"enum\s*\{([^}]*)\}", text)
             for k, v in re.findall(r"(\w+)\s*=\s*(-?\d+)", body)}
    structs: dict = {}

    def ctype(decl: str):
        words = decl.replace("const ", " ").split()
        if "*" in decl:
            return ctypes.c_void_p
        base = words[0]
        if base in structs:
            return structs[base]
        if base not in _C_TYPES:
            raise ValueError(f"kernels/cpu_api.h: no ctypes type for {decl!r}")
        return _C_TYPES[base]

    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+);", text, flags=re.S):
        fields = []
        for line in body.split(";"):
            line = line.strip()
            if not line:
                continue
            base, _, names = line.replace("const ", "").partition(" ")
            for n in names.split(","):
                n = n.strip()
                fields.append((n.lstrip("*"), ctype(f"{base} {n}")))
        structs[name] = type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"kernels/cpu_api.h's {name}"})
    api = {}
    for ret, name, args in re.findall(r"^\s*(int|void|float)\s+(lmi_\w+)\(([^)]*)\);", text, flags=re.M):
        params = [a.strip() for a in args.split(",") if a.strip() not in ("", "void")]
        api[name] = (None if ret == "void" else _C_TYPES[ret], [ctype(a) for a in params])
    return api, structs, enums


with open(os.path.join(SRC_DIR, "cpu_api.h")) as _f:
    API, STRUCTS, ENUM = parse_api(_f.read())

LIN_F32, LIN_BF16, LIN_BF16W, LIN_I8 = (ENUM[k] for k in ("LIN_F32", "LIN_BF16", "LIN_BF16W", "LIN_I8"))
LIN_Q = ENUM["LIN_Q"]          # grouped 4/5/6/8-bit codes (handler/model/quant_int4.py GroupedPack)
QS_F32, QS_F16, QS_I8 = (ENUM[k] for k in ("QS_F32", "QS_F16", "QS_I8"))   # lmi_gemm_q's scale modes
QK_NONE, QK_HEAD, QK_FULL = (ENUM[k] for k in ("QK_NONE", "QK_HEAD", "QK_FULL"))   # lmi_layer.qk_norm
Lin = STRUCTS["lmi_lin"]        # one packed linear layer
Layer = STRUCTS["lmi_layer"]    # a decoder layer's weights and KV pools (q|k|v and gate|up fused: k, v, up n = 0)
