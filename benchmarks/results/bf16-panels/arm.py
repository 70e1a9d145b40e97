"""One arm of the bf16 engine A/B (run.sh): handler/tools/bench/engine_loop.py's main, with
--fp32-copy hiding kernels/cpu_gemm_bf16.c's in-register widening, so LMI_CPU_BF16_GEMM=fp32
widens into an fp32 copy for kernels/cpu_gemm.c as before it. Every arm runs through here (same
process shape; run.sh sets LD_PRELOAD for all)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
argv = sys.argv[1:]
if "--fp32-copy" in argv:
    argv.remove("--fp32-copy")
    from kernels import cpu as cpu_ext
    cpu_ext.gemm_bf16w_available = lambda: False
from handler.model import cpu  # noqa: E402
from handler.tools.bench import engine_loop  # noqa: E402

_prepack = cpu.prepack_linears


def _said(model, *a, **k):      # which layer classes this arm serves with, on stdout
    n = _prepack(model, *a, **k)
    from collections import Counter
    print("linears:", dict(Counter(type(m).__name__ + ("(widen)" if getattr(m, "widen", False) else "")
                                   for m in model.modules() if hasattr(m, "in_features"))), flush=True)
    return n


cpu.prepack_linears = _said

sys.exit(engine_loop.main(argv))
