"""Make an AWQ or GPTQ checkpoint locally from a float Hugging Face directory, by round-to-nearest.

    python -m handler quantize-checkpoint --method awq|gptq [--group-size 128] [--asym] SRC DST

Every linear layer of the decoder layers (q/k/v/o, gate/up/down; phi3's fused qkv_proj and
gate_up_proj) is rounded per output channel and group of `group-size` inputs, and written in the
method's own packing (handler/model/quant_formats.py): AWQ GEMM (asymmetric: scale (max - min) / 15,
zero round(-min / scale)), GPTQ v1 (symmetric by default: scale 2 max|w| / 15, zero 8; --asym as
AWQ's, zero kept >= 1 as v1's "minus one" storage needs). Scales are rounded to fp16 before the
codes are computed, so the stored scale is the one the codes were rounded with. No calibration:
this is the formats' packing with RTN values (the activation-aware search of AutoAWQ and GPTQ's
error feedback are not run), for serving tests and measurements. Embeddings, norms and the output
head are copied as they are; config.json gains the `quantization_config` the serving side reads.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys

LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight$")


class QuantizeError(ValueError):
    pass


def rtn(w, group: int, sym: bool, min_zero: int = 0):
    """w [N, K] float -> (codes uint8 [N, K], zeros int [N, G], scales fp16-exact fp32 [N, G])."""
    import torch
    n, k = w.shape
    g = w.double().reshape(n, k // group, group)
    if sym:
        amax = g.abs().amax(-1)
        s = (2 * amax / 15).clamp_min(1e-8)
        s = s.half().float().double().clamp_min(2 ** -24)
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        s = ((hi - lo) / 15).clamp_min(1e-8).half().float().double().clamp_min(2 ** -24)
        z = (-lo / s).round().clamp(min_zero, 15)
    q = (g / s[..., None]).round().add(z[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), z.to(torch.int16), s.float()


def quantize_checkpoint(src: str, dst: str, method: str, group: int = 128, sym: bool | None = None) -> dict:
    """Write DST (see the module doc); returns the quantization_config written."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from handler.model.quant_formats import awq_pack, gptq_pack

    if method not in ("awq", "gptq"):
        raise QuantizeError(f"--method {method!r}: allowed awq, gptq")
    if sym is None:
        sym = method == "gptq"
    if method == "awq" and sym:
        raise QuantizeError("--method awq is asymmetric (zero points); drop --sym")
    files = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    if not files or not os.path.isfile(os.path.join(src, "config.json")):
        raise QuantizeError(f"{src} is not a Hugging Face model directory (config.json + *.safetensors)")
    out: dict = {}
    count = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if not LINEAR.match(key):
                    out[key] = t.contiguous()
                    continue
                n, k = t.shape
                if k % group or n % 8 or k % 8:
                    raise QuantizeError(f"{key}: [{n}, {k}] does not split into groups of {group} inputs "
                                        f"(and 8-code packs); allowed: a --group-size dividing {k} (e.g. "
                                        f"{next(g for g in (128, 64, 32, 16, 8) if k % g == 0)})")
                q, z, s = rtn(t, group, sym, min_zero=1 if method == "gptq" else 0)
                packed = awq_pack(q, z, s) if method == "awq" else gptq_pack(q, z, s, group)
                prefix = key.removesuffix(".weight")
                out.update({f"{prefix}.{part}": v for part, v in packed.items()})
                count += 1
    if not count:
        raise QuantizeError(f"{src}: no decoder linear layers (model.layers.N.*_proj.weight) to quantize")
    os.makedirs(dst, exist_ok=True)
    for path in glob.glob(os.path.join(src, "*")):
        name = os.path.basename(path)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy2(path, os.path.join(dst, name))
    qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
           "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "quantized_from.json"), "w") as f:
        json.dump({"source": os.path.abspath(src), "method": method, "group_size": group, "sym": sym,
                   "rounding": "round-to-nearest", "built_by": "handler.tools.quantize_checkpoint"}, f, indent=2)
    for stale in ("converted_from.json", "provenance.json"):    # describe the source, not this copy
        if os.path.exists(os.path.join(dst, stale)):
            os.unlink(os.path.join(dst, stale))
    del torch
    return {"layers": count, **qc}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m handler quantize-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--method", required=True, choices=["awq", "gptq"])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="gptq: zero points per group (default symmetric)")
    p.add_argument("src")
    p.add_argument("dst")
    a = p.parse_args(argv)
    try:
        r = quantize_checkpoint(a.src, a.dst, a.method, a.group_size, sym=False if a.asym else None)
    except QuantizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.dst}: {r['layers']} linear layers as {a.method} (4-bit, group {a.group_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
