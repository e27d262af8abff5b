"""The import floors: what a fork can import without the rest, and no import that runs back up.

FLOORS lists earl_jax's modules bottom to top. A module may import its own floor and the floors below it, never a
floor above; imports inside functions count (they run too), `if TYPE_CHECKING:` blocks do not (they never run).
Within a floor the graph must still have no cycle. A new top-level module or package must be given a floor here.
"""
import ast
import pathlib
import subprocess
import sys

import pytest

FLOORS = (
    # what every floor may use: errors, caches, processes, meshes, the command line, watchdog, progress
    ("earl_jax", "earl_jax.errors", "earl_jax.compile_cache", "earl_jax.distributed", "earl_jax.sharding",
     "earl_jax.cli", "earl_jax.watchdog", "earl_jax.progress"),
    ("earl_jax.envs", "earl_jax.tasks"),  # games and text tasks as Gymnasium environments: no model, no JAX program
    ("earl_jax.models", "earl_jax.kernels"),  # the decoder and its kernels
    ("earl_jax.rollout",),  # sampler, agent loop
    ("earl_jax.parallel",),  # memory model, profile, selector, planner, dispatcher
    # the RL job, by concern: the algorithm and who plays whom, the stages, a supervised start, the loop, the job
    ("earl_jax.rl", "earl_jax.rl.algorithm", "earl_jax.rl.matchups"),
    ("earl_jax.rl.stages",),
    ("earl_jax.rl.supervised",),
    ("earl_jax.rl.loop",),
    ("earl_jax.rl.job",),
)
NO_OPENSPIEL = ("earl_jax.rollout.sampler", "earl_jax.rollout.agent_loop", "earl_jax.parallel.planner",
                "earl_jax.parallel.memory", "earl_jax.envs.env_config", "earl_jax.envs.games")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted((ROOT / "earl_jax").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def floor_of(module: str) -> int:
    """The floor of the longest FLOORS prefix naming `module` or a package above it ("earl_jax" names only itself)."""
    best, depth = None, -1
    for level, names in enumerate(FLOORS):
        for name in names:
            covers = module == name or (name != "earl_jax" and module.startswith(name + "."))
            if covers and name.count(".") > depth:
                best, depth = level, name.count(".")
    if best is None:
        raise AssertionError(f"{module} has no floor: add it (or its package) to FLOORS in tests/test_layering.py")
    return best


def _runtime_nodes(tree: ast.AST, typing_too: bool = False):
    """Every node except those under `if TYPE_CHECKING:` (those too with `typing_too`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not typing_too:
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports(known: dict[str, pathlib.Path], typing_too: bool = False) -> dict[str, dict[str, int]]:
    """module -> {earl_jax module it imports: the line}. `from pkg import name` is an edge to pkg.name where that
    is a module, else to pkg; the packages above a module (run first by Python) are not edges. `typing_too`: the
    imports under `if TYPE_CHECKING:` count too."""

    def resolve(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path)), typing_too):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "earl_jax":
                        edges.setdefault(resolve(alias.name), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}".rstrip(".")
                if base.split(".")[0] != "earl_jax":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.setdefault(full if full in known else resolve(base), node.lineno)
        edges.pop(module, None)
        graph[module] = edges
    return graph


def test_every_import_stays_on_its_floor_or_goes_down():
    known = modules()
    graph = imports(known)
    up = [f"{m}:{line} imports {target} (floor {floor_of(target)} above {floor_of(m)})"
          for m, edges in graph.items() for target, line in edges.items() if floor_of(target) > floor_of(m)]
    assert not up, "imports that run back up a floor:\n" + "\n".join(up)


@pytest.mark.parametrize("typing_too", [False, True], ids=["runtime", "with TYPE_CHECKING imports"])
def test_the_import_graph_has_no_cycle(typing_too):
    """Not even through annotations: a circle hidden under TYPE_CHECKING still ties two modules into one."""
    graph = imports(modules(), typing_too)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path + [module, target]
            if target not in state:
                found = visit(target, path + [module])
                if found:
                    return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):])


def test_the_check_sees_lazy_imports_and_refuses_an_upward_one(tmp_path):
    """The checker itself: an import inside a function is an edge, and rollout -> rl is caught."""
    fake = {"earl_jax.rollout.x": tmp_path / "x.py", "earl_jax.rl.y": tmp_path / "y.py"}
    fake["earl_jax.rollout.x"].write_text("def f():\n    from earl_jax.rl import y\n")
    fake["earl_jax.rl.y"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    import earl_jax.rollout.x\n")
    graph = imports(fake)
    assert graph == {"earl_jax.rollout.x": {"earl_jax.rl.y": 2}, "earl_jax.rl.y": {}}
    assert floor_of("earl_jax.rl.y") > floor_of("earl_jax.rollout.x")
    with pytest.raises(AssertionError, match="no floor"):
        floor_of("earl_jax.newpackage.z")


def test_sampler_agent_loop_planner_memory_and_game_specs_import_without_openspiel():
    """A GPU image without OpenSpiel benchmarks the sampler and plans layouts; the games' rules, text and batched
    opponents (every registered spec, loaded) need it only to check a game against OpenSpiel."""
    code = (f"import sys\nimport {', '.join(NO_OPENSPIEL)}\n"
            "from earl_jax.envs.games import game_names, get_game\n[get_game(n) for n in game_names()]\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('pyspiel', 'open_spiel'))\n"
            "assert not loaded, loaded")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
