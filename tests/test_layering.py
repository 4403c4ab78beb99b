"""What may import what, read from the source with `ast` (nothing here imports jax or
any module under test).

Every `import` and `from ... import` in `jaxllm/` and `pallas_kernels/` counts, at module
level or inside a function (a lazy import still runs). Relative imports are resolved;
`from X import Y` where `X.Y` is a module is an import of `X.Y`, otherwise of `X`.
Imports under `if TYPE_CHECKING:` never run and are left out. An import names one module:
the ancestor packages' `__init__`s that Python also runs are not added as edges (they
are nodes like any other, with their own imports).

Rules (issue 16):
- the scheduler, block pool, request, KV cache manager, engine core and output
  processor import no jax / jaxlib / flax, directly or through any jaxllm module they
  import, transitively;
- `pallas_kernels/` imports nothing from `jaxllm`;
- `jaxllm/models/` and `jaxllm/layers/` import neither `jaxllm.engine` nor
  `jaxllm.entrypoints`;
- `jaxllm/engine/` imports no `jaxllm.models`;
- no import cycle between jaxllm modules;
- no file under `jaxllm/` or `pallas_kernels/` over 400 lines;
- no script under `scripts/` imports a private name of the package or reaches into a
  private attribute (`x._name`).
"""
from __future__ import annotations

import ast
import functools
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxllm", "pallas_kernels")
JAX_ROOTS = frozenset({"jax", "jaxlib", "flax"})
JAX_FREE = ("jaxllm.engine.scheduler", "jaxllm.engine.block_pool", "jaxllm.engine.request",
            "jaxllm.engine.kv_cache_manager", "jaxllm.engine.core",
            "jaxllm.engine.output_processor")
MAX_LINES = 400


@dataclass(frozen=True)
class Import:
    src: str        # importing module
    path: str       # its file, relative to the repository root
    line: int
    target: str     # the module imported (a jaxllm / pallas_kernels module, or external)
    internal: bool  # target is a module of this repository
    lazy: bool      # inside a function

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _skip_dir(name: str) -> bool:
    return name == "__pycache__" or name.startswith(".")


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, Path]:
    """Module name -> file, for every .py under the packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(ROOT / pkg):
            dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
            for fn in filenames:
                if not fn.endswith(".py"):
                    continue
                rel = (Path(dirpath) / fn).relative_to(ROOT).with_suffix("")
                parts = list(rel.parts)
                if parts[-1] == "__init__":
                    parts.pop()
                out[".".join(parts)] = Path(dirpath) / fn
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST):
    """(node, lazy) for each Import / ImportFrom, skipping `if TYPE_CHECKING:` bodies."""
    def handle(node, lazy):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for sub in node.orelse:
                yield from handle(sub, lazy)
        else:
            yield from visit(node, lazy or isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    def visit(node, lazy):
        for child in ast.iter_child_nodes(node):
            yield from handle(child, lazy)

    yield from visit(tree, False)


def _resolve(name: str, modules) -> tuple[str, bool]:
    """The longest prefix of `name` that is a repository module, else the name itself."""
    parts = name.split(".")
    if parts[0] in PACKAGES:
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in modules:
                return cand, True
    return name, False


@functools.lru_cache(maxsize=None)
def _imports() -> tuple[Import, ...]:
    modules = _modules()
    out = []
    for mod, file in sorted(modules.items()):
        rel = str(file.relative_to(ROOT))
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=rel)
        is_pkg = file.name == "__init__.py"
        for node, lazy in _import_nodes(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                for a in node.names:
                    sub = f"{base_name}.{a.name}"
                    targets.append(sub if a.name != "*" and sub in modules else base_name)
            for t in dict.fromkeys(targets):
                target, internal = _resolve(t, modules)
                if internal and target == mod:
                    continue
                out.append(Import(mod, rel, node.lineno, target, internal, lazy))
    return tuple(out)


def _edges() -> dict[str, list[Import]]:
    graph: dict[str, list[Import]] = {m: [] for m in _modules()}
    for imp in _imports():
        graph[imp.src].append(imp)
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _fmt(imp: Import) -> str:
    return f"{imp.where()} -> {imp.target}{' (lazy)' if imp.lazy else ''}"


def _fail(title: str, lines: list[str]) -> None:
    if lines:
        raise AssertionError(f"{title} ({len(lines)}):\n  " + "\n  ".join(lines))


def _jax_chain(start: str, graph) -> list[Import] | None:
    """Shortest chain of imports from `start` to jax/jaxlib/flax, or None."""
    prev: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        mod = queue.popleft()
        for imp in graph.get(mod, ()):
            if not imp.internal:
                if imp.target.split(".")[0] in JAX_ROOTS:
                    chain = [imp]
                    while prev[chain[0].src] is not None:
                        chain.insert(0, prev[chain[0].src])
                    return chain
            elif imp.target not in prev:
                prev[imp.target] = imp
                queue.append(imp.target)
    return None


def test_engine_core_imports_no_jax():
    graph = _edges()
    bad = []
    for mod in JAX_FREE:
        if mod not in graph:
            continue
        for imp in graph[mod]:
            if not imp.internal:
                if imp.target.split(".")[0] in JAX_ROOTS:
                    bad.append(_fmt(imp))
                continue
            chain = _jax_chain(imp.target, graph)
            if chain is not None:
                via = ", then ".join(_fmt(c) for c in chain)
                bad.append(f"{_fmt(imp)}, which reaches jax: {via}")
    _fail("jax-free engine modules import jax/jaxlib/flax (directly or transitively)", bad)


def test_pallas_kernels_import_nothing_from_jaxllm():
    bad = [_fmt(i) for i in _imports()
           if _in(i.src, "pallas_kernels") and _in(i.target, "jaxllm")]
    _fail("pallas_kernels imports jaxllm", bad)


def test_models_and_layers_import_no_engine_or_entrypoints():
    bad = [_fmt(i) for i in _imports()
           if (_in(i.src, "jaxllm.models") or _in(i.src, "jaxllm.layers"))
           and (_in(i.target, "jaxllm.engine") or _in(i.target, "jaxllm.entrypoints"))]
    _fail("jaxllm.models / jaxllm.layers import jaxllm.engine / jaxllm.entrypoints", bad)


def test_engine_imports_no_models():
    bad = [_fmt(i) for i in _imports()
           if _in(i.src, "jaxllm.engine") and _in(i.target, "jaxllm.models")]
    _fail("jaxllm.engine imports jaxllm.models", bad)


def _sccs(nodes, succ) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    graph = _edges()
    nodes = sorted(m for m in graph if _in(m, "jaxllm"))
    succ = {m: sorted({i.target for i in graph[m] if i.internal and _in(i.target, "jaxllm")})
            for m in nodes}
    bad = []
    for comp in sorted(c for c in _sccs(nodes, succ) if len(c) > 1):
        members = set(comp)
        inner = [_fmt(i) for m in comp for i in graph[m] if i.internal and i.target in members]
        bad.append("cycle: " + ", ".join(comp) + "\n      "
                   + "\n      ".join(inner))
    _fail("import cycles between jaxllm modules", bad)


def test_no_file_over_400_lines():
    bad = []
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(ROOT / pkg):
            dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
            for fn in sorted(filenames):
                if fn.endswith((".pyc", ".pyo")):
                    continue
                path = Path(dirpath) / fn
                try:
                    n = len(path.read_text(encoding="utf-8").splitlines())
                except UnicodeDecodeError:
                    continue
                if n > MAX_LINES:
                    bad.append(f"{path.relative_to(ROOT)}: {n} lines")
    _fail(f"files over {MAX_LINES} lines", bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _script_violations(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
    bad = []
    # Names bound to modules outside the package (os, sys, jax, a sibling script):
    # `os._exit` is not a private of jaxllm.
    foreign, own = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                ours = a.name.split(".")[0] in PACKAGES
                (own if ours else foreign).add(a.asname or a.name.split(".")[0])
                if ours and any(_private(p) for p in a.name.split(".")):
                    bad.append(f"{rel}:{node.lineno} imports {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            ours = node.level == 0 and mod.split(".")[0] in PACKAGES
            for a in node.names:
                (own if ours else foreign).add(a.asname or a.name)
                if ours and (_private(a.name) or any(_private(p) for p in mod.split("."))):
                    bad.append(f"{rel}:{node.lineno} imports {a.name} from {mod}")
    foreign -= own

    def visit(node, in_class):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Attribute) and _private(child.attr):
                root = child.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                root_name = root.id if isinstance(root, ast.Name) else None
                # The script's own classes may use their own privates.
                if not ((in_class and root_name in ("self", "cls"))
                        or root_name in foreign):
                    bad.append(f"{rel}:{child.lineno} accesses "
                               f"{ast.unparse(child.value)}.{child.attr}")
            visit(child, in_class or isinstance(child, ast.ClassDef))

    visit(tree, False)
    return sorted(set(bad), key=lambda s: (s.split(" ")[0].rsplit(":", 1)[0],
                                           int(s.split(" ")[0].rsplit(":", 1)[1]), s))


def test_scripts_use_no_private_names():
    bad = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        if not any(_skip_dir(p) for p in path.relative_to(ROOT).parts):
            bad.extend(_script_violations(path))
    _fail("scripts use private names of the package", bad)
