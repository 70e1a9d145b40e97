"""`python -m handler <command>`: each command lives in its own module, imported lazily."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("handler.server", "start the HTTP server (gunicorn + Flask)"),
    "config": ("handler.config", "print the resolved configuration as JSON (--explain: its KV arithmetic)"),
    "build-demo-model": ("handler.tools.demo_model", "build a tiny demo model + tokenizer locally"),
    "bench": ("handler.tools.bench.cli", "load client and strategy comparison"),
    "deploy": ("handler.tools.deploy", "SageMaker deployment tooling"),
    "tune": ("handler.tools.tune", "measure candidate serving.properties files, recommend one"),
    "quality": ("handler.tools.quality", "perplexity and greedy agreement of a quantized model against fp32"),
    "quantize-checkpoint": ("handler.tools.quantize_checkpoint", "make an AWQ / GPTQ checkpoint from a float one (RTN)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m handler <command> [options]\n\ncommands:")
        for name, (_, desc) in COMMANDS.items():
            print(f"  {name:<18}{desc}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = COMMANDS[argv[0]][0]
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name) and name.startswith("handler.tools"):
            # The serving image ships the server only; the tools are client-side.
            print(f"error: `{argv[0]}` is a client-side tool ({name}), not installed here (the serving image "
                  f"leaves handler/tools out); run it from a checkout: pip install -e '.[bench]'", file=sys.stderr)
            return 2
        raise
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
