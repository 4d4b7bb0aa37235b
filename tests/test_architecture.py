"""Rules the house depends on, as tests (torchtitan's habit): who may import what.

* Only the process boundary, ``cluster_fl/distributed/``, imports ``torch.distributed``.
* Only ``cluster_fl/distributed/`` reads the launcher's variables (torchrun's ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; SLURM's ``SLURM_*``): launchers and the engine
  ask :mod:`cluster_fl.distributed.launch`.
* Model code (``cluster_fl/models/``) and privacy code (``cluster_fl/privacy/``) never mention
  devices of other ranks: they import nothing from ``cluster_fl.distributed``.
* The command layer (``cluster_fl/commands/``, ``cluster_fl/cli.py``, ``cluster_fl/__main__.py``)
  is the top: no module below it imports ``cluster_fl.commands`` or ``cluster_fl.cli``.
* The layers of ARCHITECTURE.md: a package imports only from its own layer or the layers below,
  and privacy, models and data know nothing of one another.

Imports are read from the syntax tree, wherever they stand (a lazy import inside a function
counts), so a rule cannot be dodged by moving an import into a function.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cluster_fl"
LAUNCH_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT"
                         r"|SLURM_\w+)$")


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(PACKAGE.parent)), ast.parse(p.read_text(), str(p)))
            for p in sorted(PACKAGE.rglob("*.py"))]


def _imports(tree: ast.Module) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
            out += [f"{node.module}.{a.name}" for a in node.names]
    return out


def _outside(path: str, folder: str) -> bool:
    return not path.startswith(f"cluster_fl/{folder}/")


COMMAND_LAYER = ("cluster_fl/commands/", "cluster_fl/cli.py", "cluster_fl/__main__.py")


def _imports_command_layer(tree: ast.Module) -> list[str]:
    return [m for m in _imports(tree)
            if m in ("cluster_fl.cli", "cluster_fl.commands")
            or m.startswith(("cluster_fl.cli.", "cluster_fl.commands."))]


def _relative_imports(tree: ast.Module) -> list[str]:
    """``from . import x`` style imports: the rules above read absolute names only."""
    return [f"line {n.lineno}" for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level > 0]


def test_only_the_process_boundary_imports_torch_distributed():
    offenders = [path for path, tree in _modules() if _outside(path, "distributed")
                 and any(m == "torch.distributed" or m.startswith("torch.distributed.")
                         for m in _imports(tree))]
    assert offenders == []


def test_only_the_process_boundary_reads_launcher_variables():
    offenders = []
    for path, tree in _modules():
        if not _outside(path, "distributed"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and LAUNCH_VARS.match(node.value):
                offenders.append(f"{path}:{node.lineno} {node.value}")
    assert offenders == []


def test_model_and_privacy_code_know_nothing_of_ranks():
    offenders = [path for path, tree in _modules()
                 if (path.startswith("cluster_fl/models/") or path.startswith("cluster_fl/privacy/"))
                 and any(m.startswith("cluster_fl.distributed") for m in _imports(tree))]
    assert offenders == []


def test_nothing_imports_deepspeed():
    """DeepSpeed was driven through private hooks that broke across its releases; it was
    removed in favour of FSDP2 (ARCHITECTURE.md). A return must come through its
    public API and a decision recorded there, not a quiet import."""
    bad = [path for path, tree in _modules()
           if any(m == "deepspeed" or m.startswith("deepspeed.") for m in _imports(tree))]
    assert bad == []


def test_no_module_below_the_command_layer_imports_it():
    offenders = [f"{path}: {', '.join(_imports_command_layer(tree))}"
                 for path, tree in _modules()
                 if not path.startswith(COMMAND_LAYER) and _imports_command_layer(tree)]
    assert offenders == []


# ARCHITECTURE.md's layers, top (5) to bottom (0); every top-level module or package is listed
LAYERS = {"cli": 5, "__main__": 5, "commands": 5,
          "sweep": 4, "report": 4, "audit": 4,
          "engine": 3, "training": 3,
          "sizing": 2, "privacy": 2, "models": 2, "data": 2, "eval": 2, "secure_sum": 2,
          "distributed": 1,
          "config": 0, "errors": 0, "groups": 0, "seeding": 0, "precision": 0,
          "transfer": 0, "malloc": 0, "progress": 0,
          "__init__": 0}
INDEPENDENT = ("privacy", "models", "data")


def _edges() -> list[tuple[str, str, str]]:
    """(file, its part, the part it imports) for every import between two parts of the package."""
    out = []
    for path, tree in _modules():
        parts = path.split("/")
        mine = parts[1].removesuffix(".py")
        for m in _imports(tree):
            bits = m.split(".")
            if bits[0] == "cluster_fl" and len(bits) > 1 and bits[1] in LAYERS and bits[1] != mine:
                out.append((path, mine, bits[1]))
    return out


def test_every_part_of_the_package_has_a_layer():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file())}
    assert parts == set(LAYERS)


def test_a_layer_imports_only_its_own_layer_and_the_layers_below():
    upward = [f"{path} imports cluster_fl.{theirs}" for path, mine, theirs in _edges()
              if LAYERS[theirs] > LAYERS[mine]]
    assert upward == []


def test_privacy_models_and_data_know_nothing_of_one_another():
    crossed = [f"{path} imports cluster_fl.{theirs}" for path, mine, theirs in _edges()
               if mine in INDEPENDENT and theirs in INDEPENDENT]
    assert crossed == []


def test_every_command_of_the_cli_is_a_module_of_the_command_layer():
    from cluster_fl.cli import COMMANDS, command_module

    for command in COMMANDS:
        path = PACKAGE.parent / (command_module(command).replace(".", "/") + ".py")
        assert path.is_file(), (command, path)


def test_the_package_uses_absolute_imports_only():
    offenders = [f"{path} {where}" for path, tree in _modules() for where in _relative_imports(tree)]
    assert offenders == []


def test_the_rules_see_a_planted_violation(tmp_path):
    # the scanners must find what they look for, or the tests above prove nothing
    tree = ast.parse("import torch.distributed as d\nx = os.environ['SLURM_PROCID']\n")
    assert "torch.distributed" in _imports(tree)
    assert any(isinstance(n, ast.Constant) and LAUNCH_VARS.match(str(n.value))
               for n in ast.walk(tree))
    lazy = ast.parse("def f():\n    from cluster_fl.cli import main\n    import cluster_fl.commands.train\n"
                     "from torch.distributed import all_reduce\nfrom cluster_fl import commands\n")
    assert set(_imports_command_layer(lazy)) == {"cluster_fl.cli", "cluster_fl.cli.main",
                                                 "cluster_fl.commands.train", "cluster_fl.commands"}
    assert "torch.distributed" in _imports(lazy)
    assert _relative_imports(ast.parse("from . import x\n")) == ["line 1"]


def _import_time_edges() -> dict[str, set[str]]:
    """module -> the package modules it imports when it is imported: top-level import statements
    (not those inside functions, nor under ``if TYPE_CHECKING``). A parent package's
    ``__init__``, which importing ``a.b.c`` runs first, is not an edge: Python has it in
    ``sys.modules`` before its submodules run, so only modules that name each other cycle."""
    names = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = p
    edges: dict[str, set[str]] = {}
    for mod, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        body = [n for n in tree.body if not (isinstance(n, ast.If)
                                             and "TYPE_CHECKING" in ast.unparse(n.test))]
        targets = set()
        for node in body:
            found = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                found = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            targets.update(name for name in found if name in names)
        edges[mod] = targets - {mod}
    return edges


def test_no_import_cycle_in_the_package():
    edges = _import_time_edges()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == []


# the entrances of a run, the only modules that resolve a config (models.registry.resolve_shapes):
# everything below them is handed the resolved config
RESOLVER_CALLERS = {"cluster_fl/commands/__init__.py", "cluster_fl/sweep/gridspec.py",
                    "cluster_fl/engine/train.py", "cluster_fl/models/registry.py"}


def _calls(tree: ast.Module, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
            and ((isinstance(n.func, ast.Name) and n.func.id == name)
                 or (isinstance(n.func, ast.Attribute) and n.func.attr == name))]


def test_the_config_is_resolved_only_at_the_entrance_of_a_run():
    offenders = [f"{path}:{line}" for path, tree in _modules() if path not in RESOLVER_CALLERS
                 for line in _calls(tree, "resolve_shapes")]
    assert offenders == []
    train = ast.parse((PACKAGE / "engine" / "train.py").read_text())
    assert len(_calls(train, "resolve_shapes")) == 1  # run_training, once
    assert _calls(ast.parse("x = registry.resolve_shapes(cfg)\nresolve_shapes(c)\n"),
                  "resolve_shapes") == [1, 2]


def _all_edges() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere (lazy imports inside functions and
    ``TYPE_CHECKING`` blocks included): the house's real dependencies."""
    names = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = p
    edges = {}
    for mod, path in names.items():
        targets = {m for m in _imports(ast.parse(path.read_text(), str(path))) if m in names}
        edges[mod] = {t for t in targets if t != mod and not mod.startswith(t + ".")}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_even_through_lazy_imports():
    """A lazy import does not break at import time, but it is still a circle in the house's map
    (grid and pack once imported each other for a requeue helper)."""
    assert _circles(_all_edges()) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_MODULE_LINES = 600


def test_no_module_over_600_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n}" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []


# ARCHITECTURE.md's table "what each room may import", room by room (layer 0 below everyone)
LAYER0 = {p for p, layer in LAYERS.items() if layer == 0}
MAY_IMPORT = {
    "sweep": {"engine", "sizing", "models", "data", "distributed"},
    "report": {"sweep", "engine", "privacy", "eval"},
    "audit": {"engine", "privacy", "secure_sum", "models", "data", "eval"},
    "engine": {"privacy", "models", "data", "eval", "secure_sum", "distributed"},
    "training": {"engine", "privacy", "models", "data", "eval", "distributed"},
    "sizing": {"models", "distributed"},
    "eval": {"data", "models"},
    "secure_sum": {"distributed"},
    "privacy": set(), "models": set(), "data": set(), "distributed": set(),
}


def test_each_room_imports_only_what_its_line_in_the_architecture_allows():
    bad = [f"{path} imports cluster_fl.{theirs}" for path, mine, theirs in _edges()
           if mine in MAY_IMPORT and theirs not in MAY_IMPORT[mine] | LAYER0]
    assert bad == []
    assert set(MAY_IMPORT) | LAYER0 | {"cli", "__main__", "commands"} == set(LAYERS)
