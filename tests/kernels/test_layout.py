"""The CPU kernels' layout (docs/ARCHITECTURE.md, "The CPU room"): the C sources of each build (the generic
layer and one architecture folder) call each other in one direction only, read from their text: which
file defines each `lmi_*` function, which files call it; and only the vector-mapping header and the
architecture folders test which instruction set the compiler targets."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels import isa
from kernels.cpu import build as cpu_build

DEF = re.compile(r"^(?:int|void|float)\s+(lmi_\w+)\(", re.M)
CALL = re.compile(r"\b(lmi_\w+)\(")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def call_graph(sources: list[Path], root: Path | None = None) -> dict[str, set[str]]:
    """file (its path under `root`, or its name) -> the files whose `lmi_*` functions it calls (not itself)."""
    texts = {(p.relative_to(root).as_posix() if root else p.name): _strip_comments(p.read_text()) for p in sources}
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


FAMILIES = {isa.family(i): i for i in isa.ISAS}     # x86 -> avx512 (avx2 compiles the same folder), arm -> neon


def test_no_two_kernel_sources_call_each_other():
    for family, backend in FAMILIES.items():
        sources = [Path(src) for src, _ in cpu_build.sources(backend)]
        graph = call_graph(sources, Path(cpu_build.SRC_DIR))
        assert sum(len(v) for v in graph.values()) > 3, graph      # the graph was read (the stack calls the GEMMs)
        assert any(t.startswith(f"{family}/") for v in graph.values() for t in v), graph   # the generic layer calls it
        assert cycle(graph) is None, (f"the {family} build's sources call each other in a circle: "
                                      f"{' -> '.join(cycle(graph))}")


def test_every_c_source_in_kernels_is_built():
    root = Path(cpu_build.SRC_DIR)
    built = {Path(src).relative_to(root).as_posix() for backend in isa.ISAS for src, _ in cpu_build.sources(backend)}
    assert {p.relative_to(root).as_posix() for p in root.rglob("*.c")} == built
    for family, backend in FAMILIES.items():    # each build: the generic layer and its own folder only
        folders = {Path(src).relative_to(root).parent.as_posix() for src, _ in cpu_build.sources(backend)}
        assert folders == {".", family}, (backend, folders)


# The compiler's instruction-set macros: only the vector-mapping header (kernels/cpu_simd.h) and the
# architecture folders (kernels/x86/, kernels/arm/) may test them, or include an ISA's intrinsics.
ISA_MACRO = re.compile(r"\b(__AVX\w*|__SSE\w*|__FMA__|__F16C__|__ARM_\w+|__aarch64__|__x86_64__|__i386__)\b")
ISA_HEADER = re.compile(r"#\s*include\s*<(\w*intrin\.h|arm_neon\.h|arm_sve\.h)>")
VECTOR_MAPPING = "cpu_simd.h"


def isa_conditionals(text: str) -> list[str]:
    """The preprocessor conditionals of `text` that test an instruction-set macro, and the includes of
    an ISA's intrinsics header."""
    text = _strip_comments(text)
    conds = [ln.strip() for ln in re.findall(r"^[ \t]*#[ \t]*(?:if|elif|ifdef|ifndef)\b.*$", text, re.M)
             if ISA_MACRO.search(ln)]
    return conds + ISA_HEADER.findall(text)


def test_the_isa_scan_finds_conditionals_and_intrinsics():
    assert isa_conditionals("#if defined(__AVX512F__)\n#elif defined(__ARM_NEON)\n#endif\n") == [
        "#if defined(__AVX512F__)", "#elif defined(__ARM_NEON)"]
    assert isa_conditionals("#include <immintrin.h>\n#ifdef LMI_V8_GEMM\n/* #ifdef __AVX2__ */\n") == ["immintrin.h"]


def test_no_generic_source_tests_the_instruction_set():
    root = Path(cpu_build.SRC_DIR)
    generic = [p for p in sorted(root.glob("*.[ch]")) if p.name != VECTOR_MAPPING]
    assert {Path(src).name for src, _ in cpu_build.GENERIC} <= {p.name for p in generic}
    found = {p.name: isa_conditionals(p.read_text()) for p in generic}
    assert not {f: c for f, c in found.items() if c}, f"instruction-set code outside kernels/x86, kernels/arm: {found}"
    assert isa_conditionals((root / VECTOR_MAPPING).read_text())     # (where they are: the scan reads them)
    # and each folder tests its own family's instruction sets only
    other = {"x86": re.compile(r"__ARM_|__aarch64__|arm_neon"), "arm": re.compile(r"__AVX|__SSE|__FMA__|intrin\.h")}
    for family in FAMILIES:
        for p in sorted((root / family).glob("*.[ch]")):
            wrong = [c for c in isa_conditionals(p.read_text()) if other[family].search(c)]
            assert not wrong, f"{family}/{p.name} tests another family's instruction set: {wrong}"


def test_the_build_cache_key_covers_each_builds_sources_and_headers(tmp_path):
    # A changed source of a build's own folder, or any header, is a new build; another family's is not.
    import shutil
    cc = cpu_build.compiler()
    if cc is None:
        pytest.skip("no C compiler (cc/gcc) on PATH (its version is part of the key)")
    root = Path(cpu_build.SRC_DIR)
    copy = tmp_path / "kernels"
    for p in list(root.glob("*.[ch]")) + list(root.glob("*/*.[ch]")):
        (copy / p.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, copy / p.relative_to(root))
    keys = lambda: {b: cpu_build.cache_key(b, cc, str(copy)) for b in ("avx512", "avx2", "neon")}  # noqa: E731
    before = keys()
    assert before == {b: cpu_build.cache_key(b, cc) for b in before}       # the copy is the same build
    with open(copy / "x86" / "gemm.c", "a") as f:
        f.write("\n")
    after_x86 = keys()
    assert after_x86["avx512"] != before["avx512"] and after_x86["avx2"] != before["avx2"]
    assert after_x86["neon"] == before["neon"]
    with open(copy / "arm" / "gemm_q4.c", "a") as f:
        f.write("\n")
    assert keys()["neon"] != before["neon"]
    with open(copy / "cpu_v8.h", "a") as f:
        f.write("\n")
    assert all(keys()[b] != after_x86[b] for b in ("avx512", "avx2"))
    moved = keys()["avx512"]
    (copy / "x86" / "gemm.c").rename(copy / "x86" / "gemm_f32.c")        # the same bytes moved: a new build too
    assert keys()["avx512"] != moved


ORACLE_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(?:kernels|\.)[ \t]+import[ \t]+\(?[\w \t,]*\breference\b"
                           r"|(?:from|import)[ \t]+kernels\.reference\b)", re.M)


def test_the_oracle_import_scan_finds_each_spelling():
    for line in ("from kernels import reference", "from kernels import pool, reference as ref",
                 "from . import reference", "from kernels import (pool, reference)", "import kernels.reference", "    from kernels.reference import x"):
        assert ORACLE_IMPORT.search(line), line
    assert not ORACLE_IMPORT.search("from kernels import torch_paged  # the reference's twin")


def test_nothing_on_the_serving_path_imports_the_oracle():
    # kernels/reference.py is the tests' oracle; the serving path's torch math is kernels/torch_paged.py.
    root = Path(__file__).resolve().parents[2]
    found = [p.relative_to(root).as_posix() for d in ("handler", "kernels", "djl_python") for p in (root / d).rglob("*.py")
             if p.name != "reference.py" and ORACLE_IMPORT.search(p.read_text())]
    assert found == []
