"""The architecture holds: import-linter's contracts (pyproject.toml: layers, a torch-free engine core and
protocol, an ingress without torch), no import cycle between modules (lazy and TYPE_CHECKING imports
included), a docstring on every folder, no Python file over 400 lines, tests that mirror rayllm/, and every test
file where pytest collects it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rayllm"


def test_import_linter_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles_lazy_imports_included():
    graph = grimp.build_graph("rayllm", exclude_type_checking_imports=False, cache_dir=None)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_every_folder_says_what_it_is_for():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 8, f"{init.relative_to(ROOT)} needs a one-paragraph docstring"


def test_no_python_file_over_400_lines():
    """The project's own files (git's view: the benchmarks' peer virtualenvs are ignored, not ours)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    long = [f"{name}: {n}" for name in listed if (ROOT / name).exists()
            and (n := len((ROOT / name).read_text().splitlines())) > 400]
    assert long == []


def test_tests_mirror_the_package():
    """Every test folder but the GPU lane and repository-level ones names a folder of rayllm/."""
    extra = {"gpu", "deploy", "benchmarks", "__pycache__"}
    for folder in (p for p in (ROOT / "tests").rglob("*") if p.is_dir() and p.name not in extra):
        rel = folder.relative_to(ROOT / "tests")
        if rel.parts[0] in extra or "__pycache__" in rel.parts:
            continue
        assert (PACKAGE / rel).is_dir(), f"tests/{rel} mirrors no rayllm/{rel}"


def test_test_file_names_are_unique():
    """pytest imports test files by their base name (no packages under tests/): two of one name fail
    collection of the whole suite."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert not {n for n in names if names.count(n) > 1}


def test_every_test_file_is_under_testpaths():
    """pytest collects only pyproject.toml's testpaths (their order is the suite's): a test file outside them
    would never run in `make test`."""
    import tomllib

    paths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    tracked = subprocess.run(["git", "ls-files", "tests"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    outside = [f for f in tracked if Path(f).name.startswith("test_") and f.endswith(".py")
               and not any(f == p or f.startswith(p.rstrip("/") + "/") for p in paths)]
    assert not outside, outside
