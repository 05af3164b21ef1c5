"""The layout stays layered: no import from a lower room to a higher one, none between the two
planes, no cycle between files, and a control plane that starts without torch.

    floor 3   pagedkv/         the app: CLI, serve + supervisor, client, offline LLM, HTTP front
    floor 2   control_plane/   worker/       (the two planes: neither imports the other)
    floor 1                    kernels/      (the worker's kernels; the control plane never)
    floor 0   base/            the contract (plan, codec, v1 stubs) and shared plumbing
    beside    bench/ deploy/   tools over the whole house; nothing imports them

Every import counts, including those inside functions (a lazy import is still a
dependency) and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# room -> the rooms its modules may import (besides its own).
ALLOWED = {
    "base": set(),
    "kernels": {"base"},
    "control_plane": {"base"},
    "worker": {"base", "kernels"},
    "pagedkv": {"base", "kernels", "control_plane", "worker"},
    "bench": {"base", "kernels", "control_plane", "worker", "pagedkv"},
    "deploy": {"base"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for room in ALLOWED:
        for path in (ROOT / room).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts[:2] and room == "base":
                continue  # generated stubs: they import only protobuf/grpc and each other
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """First-party modules `name` imports (a `from pkg import mod` names the submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and target.partition(".")[0] in ALLOWED:
                target = target.rpartition(".")[0]  # `from base.v1 import x`: the package
            if target in known or target.startswith("base.v1"):
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) - {name} for name, path in known.items()}


def test_no_import_climbs_or_crosses_between_planes():
    bad = []
    for name, targets in _graph().items():
        room = name.partition(".")[0]
        for target in targets:
            other = target.partition(".")[0]
            if other != room and other not in ALLOWED[room]:
                bad.append(
                    f"{name} imports {target} ({room} may import {sorted(ALLOWED[room]) or 'nothing'})"
                )
    assert not bad, "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_cycle_between_files():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_cycles():
    """The check above can fail: a planted two- and three-module cycle are reported."""
    graph = defaultdict(set, {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": {"a"}})
    assert sorted(_cycles(dict(graph))) == [["a", "b"], ["c", "d", "e"]]


def test_the_layering_check_sees_lazy_and_relative_imports(tmp_path):
    source = "def f():\n    from control_plane.plan_x import y\nfrom . import sibling\n"
    path = tmp_path / "mod.py"
    path.write_text(source)
    known = {"control_plane.plan_x": path, "worker.sibling": path, "worker.mod": path}
    assert _imports("worker.mod", path, known) == {"control_plane.plan_x", "worker.sibling"}


BLOCK_TORCH = """
import importlib, pkgutil, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} imported by the control plane")

sys.meta_path.insert(0, NoTorch())
import control_plane
for info in pkgutil.walk_packages(control_plane.__path__, "control_plane."):
    importlib.import_module(info.name)
import base.plan, base.plan_codec, base.tokenizer, base.grpc_util, base.security
print("torch" in sys.modules)
"""


def test_control_plane_imports_without_torch():
    """Every control_plane module (and the base it stands on) imports with torch made
    unimportable: the control plane starts on a machine without torch."""
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
