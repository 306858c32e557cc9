"""The package's structure, enforced: no import cycle (function-local imports included), no private name
imported across modules, the environment read in one module, MLX never imported at module level where
``import recgen`` and ``recgen emit`` must work without it."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "recgen"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(name: str, path: Path):
    """(imported module, imported names, line) for every import statement in the file, at any depth."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            yield _resolve(name, is_pkg, node.level, node.module), tuple(a.name for a in node.names), node.lineno


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for mod, names, _ in _imports(name, path):
            if not mod.startswith("recgen"):
                continue
            targets = {f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES} or {mod}
            for t in targets:
                while t not in MODULES:  # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t != name and not (name.startswith(t + ".") and t in MODULES and MODULES[t].name == "__init__.py"
                                      and not names):
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_local_imports():
    graph = _graph()
    assert "recgen.chunked" in graph["recgen.ops"]  # imported inside a function only
    assert "recgen.spec.ir" in graph["recgen.spec.layouts"]


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_crosses_modules():
    bad = []
    for name, path in MODULES.items():
        for mod, names, line in _imports(name, path):
            if mod.startswith("recgen"):
                bad += [f"{path.name}:{line} imports {mod}.{n}" for n in names
                        if n.startswith("_") and not n.startswith("__")]
    assert bad == []


LAYERS = ["recgen.version", "recgen.errors", "recgen.hashing", "recgen.tuning", "recgen.spec", "recgen.specs",
          "recgen.math", "recgen.codegen", "recgen.key_blocks", "recgen.runtime", "recgen.chunked", "recgen.op_args",
          "recgen.ops", "recgen.integrations", "recgen.adapters", "recgen.testing", "recgen.emit", "recgen.verify",
          "recgen.bench", "recgen.cli"]


def layer(m: str) -> int:
    """The index of ``m``'s layer in ``LAYERS`` (a package's modules and ``recgen.cli_*`` belong to it); the package
    root and modules of no layer (standalone scripts) sit on top."""
    hits = [i for i, p in enumerate(LAYERS) if m == p or m.startswith(p + ".") or m.startswith(p + "_")]
    return max(hits) if hits else len(LAYERS)


def test_layers_are_told_apart():
    assert layer("recgen.spec.ir") < layer("recgen.codegen.lower") < layer("recgen.ops") < layer("recgen.bench")
    assert layer("recgen.cli_kernels") == layer("recgen.cli") < layer("recgen")


def test_layers_point_down():
    """spec -> math -> codegen -> runtime -> chunked -> ops -> tools: no module imports a layer above its own."""
    bad = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts
           if t != "recgen" and layer(t) > layer(m) and m != "recgen"]
    # the spec layer resolves built-in names from recgen.specs, which is spec-layer content
    assert [b for b in bad if b != "recgen.spec.resolve -> recgen.specs"] == []


def test_environment_is_read_in_one_module():
    readers = sorted(str(p.relative_to(PKG.parent)) for p in MODULES.values() if "os.environ" in p.read_text())
    assert readers == ["recgen/tuning.py"]


def test_codegen_and_spec_layers_import_no_mlx():
    bad = []
    for name, path in MODULES.items():
        if name.startswith(("recgen.spec", "recgen.codegen", "recgen.math")) or name in ("recgen.emit", "recgen.errors"):
            bad += [f"{name}:{line}" for mod, _, line in _imports(name, path) if mod.startswith("mlx")]
    assert bad == []
