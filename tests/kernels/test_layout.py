"""The CPU kernels' layout (docs/ARCHITECTURE.md, "The CPU room"): the C sources call each other in one
direction only, read from their text: which file defines each `lmi_*` function, which files call it."""
from __future__ import annotations

import re
from pathlib import Path

from kernels.cpu import build as cpu_build

DEF = re.compile(r"^(?:int|void|float)\s+(lmi_\w+)\(", re.M)
CALL = re.compile(r"\b(lmi_\w+)\(")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def call_graph(sources: list[Path]) -> dict[str, set[str]]:
    """file -> the files whose `lmi_*` functions it calls (not itself)."""
    texts = {p.name: _strip_comments(p.read_text()) for p in sources}
    owner = {name: f for f, t in texts.items() for name in DEF.findall(t)}
    return {f: {owner[c] for c in CALL.findall(t) if c in owner and owner[c] != f} for f, t in texts.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path of files, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_chain():
    assert cycle({"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": {"a.c"}}) == ["a.c", "b.c", "c.c", "a.c"]
    assert cycle({"a.c": {"b.c", "c.c"}, "b.c": {"c.c"}, "c.c": set()}) is None


def test_the_graph_reads_definitions_and_calls_from_the_text(tmp_path):
    (tmp_path / "a.c").write_text("/* lmi_b() in a comment */\nint lmi_a(int x) { return lmi_b(x); }\n")
    (tmp_path / "b.c").write_text("int lmi_b(int x) { return x; }\n")
    assert call_graph(sorted(tmp_path.glob("*.c"))) == {"a.c": {"b.c"}, "b.c": set()}


def test_no_two_kernel_sources_call_each_other():
    sources = [Path(src) for src, _ in cpu_build.SOURCES]
    graph = call_graph(sources)
    assert sum(len(v) for v in graph.values()) > 3, graph      # the graph was read (the stack calls the GEMMs)
    assert cycle(graph) is None, f"kernels/*.c call each other in a circle: {' -> '.join(cycle(graph))}"


def test_every_c_source_in_kernels_is_built():
    built = {Path(src).name for src, _ in cpu_build.SOURCES}
    assert {p.name for p in Path(cpu_build.SRC_DIR).glob("*.c")} == built
