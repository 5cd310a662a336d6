"""The packages' import structure, read from the source (ast), every import counted (also those inside
functions, which would otherwise hide a circle):

* no import circle between modules;
* the flow is one-way, tools -> milo_infer -> {milo_store, milo_kernels} -> milo_format: milo_store
  and milo_kernels import neither milo_infer nor tools, nor each other (the store knows nothing about
  kernels, the kernels nothing about stores); both may import milo_format (the format's numeric
  facts), which imports none of them;
* inside milo_infer, the rooms import one way (docs/design.md's map): `models` and `tasks` import no
  other room; `runtime` and `building` only those two; `evaluation` and `bench` those and `runtime` and
  `building`; `server` and `vllm` (milo's HTTP front and vLLM's connector, two front ends of `runtime`)
  only `models`, `tasks` and `runtime`, never each other; `cli` any room;
* no module imports another package's CLI modules (a CLI only parses and prints; what two packages
  share lives in a library module);
* inside milo_store, two rooms (docs/design.md's map): the storage room reaches the codec room
  (`milo_store.codecs`) only through the names its package exports, never a codec's module, and the codec
  room imports of storage only `format` and `layout` (the value types and segment layout it encodes into).
"""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("milo_format", "milo_store", "milo_kernels", "milo_infer", "tools")
FORBIDDEN = {  # package -> packages it must not import
    "milo_format": {"milo_store", "milo_kernels", "milo_infer", "tools"},
    "milo_store": {"milo_infer", "tools", "milo_kernels"},
    "milo_kernels": {"milo_infer", "tools", "milo_store"},
    "milo_infer": {"tools"},
}
LEAVES = {"models": set(), "tasks": set()}
ROOMS = {  # milo_infer's room -> the rooms it may import; a room not named here (cli) may import any
    **LEAVES,
    "runtime": {"models", "tasks"},
    "building": {"models", "tasks"},
    "evaluation": {"models", "tasks", "runtime", "building"},
    "bench": {"models", "tasks", "runtime", "building"},
    "server": {"models", "tasks", "runtime"},
    "vllm": {"models", "tasks", "runtime"},
}


CODEC_ROOM = "milo_store.codecs"
CODEC_ROOM_READS = {"milo_store.format", "milo_store.layout"}  # the storage modules the codec room may import


def room(module: str) -> str | None:
    """The milo_infer room a module is in (its first name under milo_infer), None outside milo_infer."""
    parts = module.split(".")
    return parts[1] if parts[0] == "milo_infer" and len(parts) > 1 else None


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the packages under ``root``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that the file imports; `from a import b` counts a.b when b is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in names:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle once, as the modules along it (first repeated at the end)."""
    found, state = [], {}  # state: 1 on the current path, 2 finished

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def is_cli(module: str) -> bool:
    return ".cli." in f".{module}." and not module.startswith("tools")


def import_problems(root: Path) -> list[str]:
    """One line per broken rule, empty when the structure holds."""
    graph = import_graph(root)
    problems = [f"import circle: {' -> '.join(c)}" for c in circles(graph)]
    for module, targets in sorted(graph.items()):
        top = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other in FORBIDDEN.get(top, ()):
                problems.append(f"{module} imports {target}: {top} must not import {other}")
            if is_cli(target) and other != top:
                problems.append(f"{module} imports {target}: another package's CLI module")
            problems += store_room_problems(module, target)
            mine, theirs = room(module), room(target)
            if mine in ROOMS and theirs is not None and theirs != mine and theirs not in ROOMS[mine]:
                problems.append(f"{module} imports {target}: the {mine} room must not import the {theirs} room")
    return problems


def store_room_problems(module: str, target: str) -> list[str]:
    """The milo_store rooms' rule for one import: storage uses the codec room's package, codecs read format and layout."""
    def in_codecs(name):
        return name == CODEC_ROOM or name.startswith(CODEC_ROOM + ".")

    if not (module.startswith("milo_store.") and target.startswith("milo_store.")) or in_codecs(module) == in_codecs(target):
        return []
    if in_codecs(target) and target != CODEC_ROOM:
        return [f"{module} imports {target}: the storage room reaches codecs only through {CODEC_ROOM}"]
    if in_codecs(module) and target not in CODEC_ROOM_READS:
        return [f"{module} imports {target}: the codec room reads only {', '.join(sorted(CODEC_ROOM_READS))} of storage"]
    return []


def test_the_packages_import_structure_holds():
    assert import_problems(REPO) == []


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for package in PACKAGES:
        (root / package).mkdir(exist_ok=True)
    return root


@pytest.mark.parametrize("files, expected", [
    ({"milo_infer/__init__.py": "", "milo_infer/a.py": "from . import b\n",
      "milo_infer/b.py": "def f():\n    from .a import x\n"},
     ["import circle: milo_infer.a -> milo_infer.b -> milo_infer.a"]),
    ({"milo_store/__init__.py": "", "milo_store/x.py": "from milo_infer.runtime.session import MiloSession\n",
      "milo_infer/__init__.py": "", "milo_infer/runtime/session.py": ""},
     ["milo_store.x imports milo_infer.runtime.session: milo_store must not import milo_infer"]),
    ({"milo_kernels/__init__.py": "", "milo_kernels/k.py": "import milo_store.layout\n",
      "milo_store/__init__.py": "", "milo_store/layout.py": ""},
     ["milo_kernels.k imports milo_store.layout: milo_kernels must not import milo_store"]),
    ({"milo_format/__init__.py": "from milo_store.layout import Layout\n",
      "milo_store/__init__.py": "", "milo_store/layout.py": ""},
     ["milo_format imports milo_store.layout: milo_format must not import milo_store"]),
    ({"milo_format/__init__.py": "", "milo_store/__init__.py": "",
      "milo_store/layout.py": "from milo_format import RAW_RANK\n",
      "milo_kernels/__init__.py": "", "milo_kernels/naive.py": "import milo_format\n"},
     []),  # the store and the kernels share the format's facts through milo_format
    ({"milo_store/__init__.py": "", "milo_store/cli/__init__.py": "", "milo_store/cli/common.py": "",
      "milo_infer/__init__.py": "", "milo_infer/evaluation/demo.py": "from milo_store.cli.common import human_bytes\n",
      "tools/t.py": "from milo_store.cli import common\n"},
     ["milo_infer.evaluation.demo imports milo_store.cli.common: another package's CLI module",
      "tools.t imports milo_store.cli.common: another package's CLI module"]),
    ({"milo_store/__init__.py": "from .codecs import lowrank\n", "milo_store/store.py": "from .codecs.bits import X\n",
      "milo_store/writer.py": "from .codecs import open_codec\n", "milo_store/codecs/__init__.py": "",
      "milo_store/codecs/bits.py": "from ..writer import StoreWriter\nfrom ..layout import Layout\n",
      "milo_store/codecs/lowrank.py": "from .. import format as fmt\n", "milo_store/format.py": "",
      "milo_store/layout.py": ""},
     ["milo_store.codecs.bits imports milo_store.writer: the codec room reads only milo_store.format, milo_store.layout "
      "of storage", "milo_store.store imports milo_store.codecs.bits: the storage room reaches codecs only through "
      "milo_store.codecs"]),  # the package itself may name its modules; the codec room reads format and layout
    ({"milo_infer/__init__.py": "", "milo_infer/cli/__init__.py": "", "milo_infer/cli/main.py": "from . import bench\n",
      "milo_infer/cli/bench.py": "from .. import models\n", "milo_infer/models.py": "import torch\n"},
     []),  # a package's CLI modules may import each other and the library below them
])
def test_each_rule_finds_what_it_names(tmp_path, files, expected):
    assert import_problems(write_tree(tmp_path, files)) == expected


@pytest.mark.parametrize("files, expected", [
    ({"milo_infer/__init__.py": "", "milo_infer/runtime/__init__.py": "", "milo_infer/building/__init__.py": "",
      "milo_infer/runtime/engine.py": "from ..building import config\n", "milo_infer/building/config.py": ""},
     ["milo_infer.runtime.engine imports milo_infer.building.config: the runtime room must not import the building room"]),
    ({"milo_infer/__init__.py": "", "milo_infer/vllm/__init__.py": "", "milo_infer/server/__init__.py": "",
      "milo_infer/vllm/engine.py": "from milo_infer.server.scheduler import UpstreamError\n",
      "milo_infer/server/scheduler.py": ""},
     ["milo_infer.vllm.engine imports milo_infer.server.scheduler: the vllm room must not import the server room"]),
    ({"milo_infer/__init__.py": "", "milo_infer/tasks/__init__.py": "", "milo_infer/tasks/corpus.py": "",
      "milo_infer/cli/__init__.py": "", "milo_infer/cli/main.py": "from ..tasks import corpus\n",
      "milo_infer/evaluation/__init__.py": "", "milo_infer/evaluation/demo.py": "from ..tasks.corpus import x\n"},
     []),  # cli imports any room; evaluation imports tasks
])
def test_each_room_rule_finds_what_it_names(tmp_path, files, expected):
    assert import_problems(write_tree(tmp_path, files)) == expected


def test_every_room_is_named_in_the_rules():
    """A new room must say what it may import: milo_infer's subpackages are the rules' rooms and cli."""
    packages = {p.parent.name for p in (REPO / "milo_infer").glob("*/__init__.py")}
    assert packages == set(ROOMS) | {"cli"}


def test_only_the_connector_imports_vllm():
    """vLLM lives in a venv of its own: the rest of milo (the vLLM client side included) must import without it."""
    importers = set()
    for name, path in module_files(REPO).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(r.split(".")[0] == "vllm" for r in roots):
                importers.add(name)
    assert importers == {"milo_infer.vllm.connector"}
