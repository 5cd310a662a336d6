"""The docs stay true to the code while staying short.

docs/design.md names what a newcomer should find in backticks: every file path, module, function, class or member,
and every `milo` / `milo-store` subcommand and option it names that way must exist (a path in the tree; a name
defined in the code, read statically from its syntax trees, so this costs no import of torch; an option in the
CLI's argparse calls), and every relative link it has reaches a file (and heading). A backticked span that is no
name (a formula, a shape, a header line) is not checked.
docs/benchmarks.md's front page links each of today's figures to the dated section that measured it: each link
must reach one of its headings, as GitHub makes their anchors.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ("milo_format", "milo_store", "milo_kernels", "milo_infer", "tools", "tests")
PROGRAMS = {"milo": "milo_infer/cli", "milo-store": "milo_store/cli"}
FRONT_PAGE = "Today's figures"
SKIPPED = {".git", ".venv", ".venv-vllm", "__pycache__", ".hypothesis", ".pytest_cache", "node_modules"}

# Names design.md gives that are not milo's code, each with why.
NOT_CODE = {
    "scaled_dot_product_attention": "PyTorch's attention function, reached as an attribute of torch.nn.functional",
    "preadv": "the system call ChunkFiles reads with, reached as os.preadv",
    "flock": "the file lock StoreLock takes, reached as fcntl.flock",
    "do_kv_cache_update": "vLLM's attention backends' method the connector writes with",
    "--tensor-parallel-size": "vLLM's own flag, which milo_infer.vllm.launch passes through",
    "--pipeline-parallel-size": "vLLM's own flag, which milo_infer.vllm.launch passes through",
    "indexes/bm25": "a path inside a store (docs/format.md), not in the tree",
    "~/.cache/milo/models": "where converted models live at run time, not in the tree",
    ".venv-vllm": "the venv tools/setup_vllm.sh makes, not in the tree",
}

IDENTIFIER = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
WORDLIKE = re.compile(r"[\w.\-]+")  # hyphenated or dotted words: option values, method names, marker files
FILE_SUFFIXES = (".py", ".sh", ".md", ".toml", ".txt", ".json")
HTTP_METHODS = ("GET ", "POST ", "PUT ", "DELETE ")


@dataclass
class Scope:
    """What a module or class binds: its names, and for a class what its constructor takes."""
    names: set[str] = field(default_factory=set)
    classes: set[str] = field(default_factory=set)  # of ``names``, those bound to a class defined here
    params: dict[str, set[str]] = field(default_factory=dict)  # a function's (a class's "__call__": its constructor's)


@dataclass
class Code:
    modules: dict[str, Scope]  # dotted module name -> what it binds
    module_files: dict[str, str]  # repository path -> dotted module name
    classes: dict[str, Scope]  # class name -> its members (every class of that name)
    strings: set[str]  # every string constant: config fields, model types, choices, metric names the code reads
    parameters: set[str]  # every function's parameter names (a Triton kernel's constexpr switches among them)
    defined: set[str]  # every name a module or class defines, or imports from outside milo (transformers', vLLM's)
    paths: list[str]  # every file and directory in the tree


def _params(node) -> set[str]:
    a = node.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs} | {p.arg for p in (a.vararg, a.kwarg) if p}


def _targets(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # Assign, AnnAssign, AugAssign
    out = []
    for t in targets:
        out += [e.id for e in ast.walk(t) if isinstance(e, ast.Name)]
    return out


def _class_scope(node: ast.ClassDef) -> Scope:
    scope = Scope()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope.names.add(item.name)
            scope.params[item.name] = _params(item)
            for sub in ast.walk(item):  # self.x = ... in any method
                for t in getattr(sub, "targets", None) or [getattr(sub, "target", None)]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        scope.names.add(t.attr)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            scope.names.update(_targets(item))
        elif isinstance(item, ast.ClassDef):
            scope.names.add(item.name)
            scope.classes.add(item.name)
    fields = {n for n in scope.names if n not in scope.params}
    scope.params["__call__"] = (scope.params.get("__init__", set()) | fields) - {"self"}
    return scope


@functools.cache
def read_code() -> Code:
    modules, module_files, classes, strings, parameters, defined = {}, {}, {}, set(), set(), set()
    paths = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED]
        here = Path(top).relative_to(ROOT)
        paths += [(here / n).as_posix() for n in dirs + files]
    for package in CODE:
        for rel in sorted(Path(p) for p in paths if p.startswith(package + "/") and p.endswith(".py")):
            path = ROOT / rel
            if rel == Path(__file__).relative_to(ROOT):  # this file names missing things on purpose
                continue
            name = ".".join(rel.with_suffix("").parts)
            name = name.removesuffix(".__init__")
            tree = ast.parse(path.read_text(), str(rel))
            scope = modules.setdefault(name, Scope())
            module_files[rel.as_posix()] = name
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    scope.names.add(node.name)
                    defined.add(node.name)
                    scope.params[node.name] = _params(node)
                elif isinstance(node, ast.ClassDef):
                    scope.names.add(node.name)
                    defined.add(node.name)
                    scope.classes.add(node.name)
                    members = _class_scope(node)
                    known = classes.setdefault(node.name, Scope())
                    known.names |= members.names
                    known.classes |= members.classes
                    for f, p in members.params.items():
                        known.params[f] = known.params.get(f, set()) | p
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    scope.names.update(_targets(node))
                    defined.update(_targets(node))
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    bound = {(a.asname or a.name).split(".")[0] for a in node.names}
                    scope.names |= bound  # a package's __init__ re-exports: milo_kernels.reconstruct_layer
                    if isinstance(node, ast.Import) or not (node.level or node.module.startswith("milo")):
                        defined |= bound  # milo's own names count where they are defined, not where imported
            exports = {id(n) for a in tree.body if isinstance(a, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                       and "__all__" in _targets(a) for n in ast.walk(a)}  # names, not strings the code reads
            strings.update(n.value for n in ast.walk(tree)
                           if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in exports)
            parameters.update(p for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                              for p in _params(n))
    for name in list(modules):  # a package binds its submodules
        parent, _, leaf = name.rpartition(".")
        if parent in modules:
            modules[parent].names.add(leaf)
    for members in classes.values():
        defined |= members.names
    return Code(modules, module_files, classes, strings, parameters, defined, paths)


def _scopes_named(code: Code, head: str) -> list[tuple[str, str]]:
    """What a dotted name's first part can be: a module (by its dotted name or its last part) or a class."""
    found = [("module", m) for m in code.modules if m == head or m.endswith("." + head)]
    return found + ([("class", head)] if head in code.classes else [])


def _resolve(code: Code, dotted: str) -> list[tuple[str, str]]:
    """Every (kind, name) a dotted name can stand for: kind "module" or "class" (name: the module or class), or
    "member" (name: "<scope>:<member>"). Empty when it names nothing."""
    parts = dotted.split(".")
    current = _scopes_named(code, parts[0])
    for part in parts[1:]:
        following = []
        for kind, name in current:
            if kind == "module":
                scope = code.modules[name]
                if f"{name}.{part}" in code.modules:
                    following.append(("module", f"{name}.{part}"))
                elif part in scope.classes or part in scope.names and part in code.classes:  # defined or re-exported
                    following.append(("class", part))
                elif part in scope.names:
                    following.append(("member", f"{name}:{part}"))
            elif kind == "class" and part in code.classes[name].names:
                following.append(("class", part) if part in code.classes else ("member", f"{name}:{part}"))
        current = following
    return current


def _defined(code: Code, name: str) -> bool:
    """A bare name: bound by some module or class, a module's own name, a parameter, or a string the code reads by."""
    return bool(_scopes_named(code, name)) or name in code.defined or name in code.strings or name in code.parameters


def _call_keywords(code: Code, resolved: list[tuple[str, str]], keywords: list[str]) -> list[str]:
    """The keywords none of the callee's readings takes."""
    taken = set()
    for kind, name in resolved:
        if kind == "class":
            taken |= code.classes[name].params.get("__call__", set())
        elif kind == "member":
            scope_name, member = name.split(":")
            scope = code.modules.get(scope_name) or code.classes.get(scope_name)
            params = scope.params.get(member)
            if params is None and member in code.classes:  # a class bound at module level
                params = code.classes[member].params.get("__call__", set())
            taken |= params or set()
    return [k for k in keywords if k not in taken]


@dataclass(frozen=True)
class Options:
    """One subcommand's command line, read from its module's add_argument calls."""
    options: frozenset[str]  # every option string, "--tier" and its aliases
    flags: frozenset[str]  # options that take no value
    choices: frozenset[str]  # the positional arguments' and options' choices


def _argument_calls(tree) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "add_argument"]


@functools.cache
def read_commands(program: str) -> dict[str, Options]:
    """A program's subcommands (its cli/main.py's COMMANDS) and each one's options, its module's add_argument calls
    and those of the cli package's helpers it calls (``add_tier_arguments``)."""
    cli = ROOT / PROGRAMS[program]
    main = ast.parse((cli / "main.py").read_text())
    table = next(n.value for n in main.body if isinstance(n, ast.Assign) and _targets(n) == ["COMMANDS"])
    helpers = {f.name: f for f in ast.parse((cli / "__init__.py").read_text()).body if isinstance(f, ast.FunctionDef)}
    commands = {}
    for key, value in zip(table.keys, table.values):
        tree = ast.parse((cli / f"{value.id}.py").read_text())
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        calls = _argument_calls(tree) + [c for h in called & set(helpers) for c in _argument_calls(helpers[h])]
        options, flags, choices = set(), set(), set()
        for call in calls:
            names = {a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
            options |= names
            for kw in call.keywords:
                if kw.arg == "action" and isinstance(kw.value, ast.Constant) and kw.value.value in (
                        "store_true", "store_false", "count", "help"):
                    flags |= names
                if kw.arg == "choices" and isinstance(kw.value, (ast.Tuple, ast.List)):
                    choices |= {e.value for e in kw.value.elts if isinstance(e, ast.Constant)}
        options |= {"--help", "-h"}  # argparse's own
        commands[key.value] = Options(frozenset(options), frozenset(flags | {"--help", "-h"}),
                                      frozenset(map(str, choices)))
    return commands


def _command_problems(span: str) -> list[str]:
    """A `milo ...` or `milo-store ...` span: its subcommand(s), options and the words among their choices."""
    words = span.split()
    program, rest = words[0], words[1:]
    commands = read_commands(program)
    if not rest:
        return []
    subcommands, rest = rest[0].split("|"), rest[1:]
    problems = [f"`{program} {s}`: no such subcommand" for s in subcommands if s not in commands]
    for sub in subcommands:
        known = commands.get(sub)
        if known is None:
            continue
        takes_value = False
        for word in rest:
            if word.startswith("--"):
                option = word.split("=")[0]
                if option not in known.options:
                    problems.append(f"`{program} {sub}`: no option {option}")
                takes_value = "=" not in word and option not in known.flags
            elif takes_value or word == "..." or not word[0].islower():  # an option's value, or a metavar
                takes_value = False
            elif not set(word.split("|")) <= known.choices:
                problems.append(f"`{program} {sub}`: {word!r} is no subcommand or choice")
    return problems


def _path_problems(code: Code, span: str) -> list[str]:
    path, _, name = span.partition("::")
    path = path.rstrip("/")
    if "*" in path:
        found = [p for p in code.paths if fnmatch.fnmatch(p, path)]
    else:
        found = [p for p in code.paths if p == path or p.endswith("/" + path)]
    if not found:
        return [f"`{span}`: no such file or directory"]
    if name:
        defined = any(name in code.modules[code.module_files[p]].names for p in found if p in code.module_files)
        return [] if defined else [f"`{span}`: {name} is not defined there"]
    return []


def _call(span: str) -> tuple[str, list[str]] | None:
    """A span written as a call, ``Engine(max_rows=)`` or ``reconstruct_layer(..., backend=)``: the callee's dotted
    name and the keywords named."""
    try:
        node = ast.parse(re.sub(r"(\w+)=\s*(?=[,)])", r"\1=None", span), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    callee = ast.unparse(node.func)
    if not IDENTIFIER.fullmatch(callee):
        return None
    return callee, [k.arg for k in node.keywords if k.arg]


def span_problems(span: str) -> list[str]:
    """Why a backticked span names something the code does not have (empty: it exists, or it is no name)."""
    code = read_code()
    span = span.replace("\\|", "|").strip()
    if span in NOT_CODE or span.split()[0] in NOT_CODE:
        return []
    words = span.split()
    if words[0] in PROGRAMS:
        return _command_problems(span)
    if "-m" in words[:-1]:  # python -m MODULE ..., torchrun ... -m MODULE ...
        module, rest = words[words.index("-m") + 1], words[words.index("-m") + 2:]
        if module not in code.modules:
            return [f"`{span}`: no module {module}"]
        program = next((p for p, d in PROGRAMS.items() if module == d.replace("/", ".") + ".main"), None)
        return _command_problems(" ".join([program] + rest)) if program and rest else []
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        return [f"`{span}`: no make target {t}" for t in words[1:] if t not in targets]
    if words[0].endswith(".py") and len(words) > 1:  # a tool's command line: the script, and its options
        problems = _path_problems(code, words[0])
        if problems:
            return problems
        script = next(p for p in code.paths if p == words[0] or p.endswith("/" + words[0]))
        options = {n.value for n in ast.walk(ast.parse((ROOT / script).read_text())) if isinstance(n, ast.Constant)}
        return [f"`{span}`: {script} has no {w}" for w in words[1:] if w.startswith("--") and w not in options]
    if re.fullmatch(r'"[^"]*"', span):  # a string the code reads
        return [] if span[1:-1] in code.strings else [f"`{span}`: not in the code"]
    if span.startswith("--"):
        option = span.split()[0].split("=")[0]
        everywhere = {o for p in PROGRAMS for c in read_commands(p).values() for o in c.options}
        return [] if option in everywhere else [f"`{span}`: no milo or milo-store command has {option}"]
    if re.fullmatch(r"\w+://", span):  # a store URL's scheme
        return [] if span[:-3] in code.strings or span in code.strings else [f"`{span}`: no such URL scheme"]
    if span.startswith(HTTP_METHODS) or span.startswith("/"):  # an HTTP route
        route = span.split()[-1]
        return [] if route in code.strings else [f"`{span}`: no such route"]
    if " " not in span and ("/" in span or "::" in span or span.endswith(FILE_SUFFIXES)):
        return _path_problems(code, span)
    if re.fullmatch(r"(milo|vllm):[\w*]+", span):  # a metric, counters named without prometheus' _total
        name = span.removesuffix("_total")
        return [] if any(fnmatch.fnmatch(s, name) or fnmatch.fnmatch(s, span) for s in code.strings) else [
            f"`{span}`: no such metric"]
    if re.fullmatch(r"\$?[A-Z_][A-Z0-9_]*(=[\w|]+)?", span):  # an environment variable, and its values
        variable, _, values = span.lstrip("$").partition("=")
        missing = [v for v in [variable] + [v for v in values.split("|") if v and not v.isdigit()]
                   if not _defined(code, v)]
        return [f"`{span}`: {v} is not in the code" for v in missing]
    call = _call(span)
    if call:
        callee, keywords = call
        if callee in NOT_CODE:
            return []
        resolved = _resolve(code, callee) if "." in callee else [("class", callee)] if callee in code.classes else [
            ("member", f"{m}:{callee}") for m, s in (*code.modules.items(), *code.classes.items()) if callee in s.names]
        if not resolved:
            return [f"`{span}`: {callee} is not defined"]
        return [f"`{span}`: {callee} takes no {k}=" for k in _call_keywords(code, resolved, keywords)]
    if IDENTIFIER.fullmatch(span):
        if "." in span:
            return [] if _resolve(code, span) else [f"`{span}`: not defined"]
        return [] if _defined(code, span) else [f"`{span}`: not defined"]
    if WORDLIKE.fullmatch(span) and not span[0].isdigit():
        return [] if span in code.strings else [f"`{span}`: not in the code"]
    return []


def inline_code(text: str) -> list[str]:
    """The backticked spans of a Markdown text, outside fenced blocks."""
    spans, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            spans += re.findall(r"`([^`]+)`", line)
    return spans


def doc_problems(text: str) -> list[str]:
    return [p for span in dict.fromkeys(inline_code(text)) for p in span_problems(span)]


def link_problems(text: str, folder: Path) -> list[str]:
    """Relative Markdown links that reach no file, or no heading of it."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = folder / path if path else None
        if file is not None and not file.exists():
            problems.append(f"link to {target}: no such file")
        elif anchor and anchor not in anchors(file.read_text() if file else text):
            problems.append(f"link to {target}: no such heading")
    return problems


def test_everything_design_md_names_exists_in_the_code():
    text = (ROOT / "docs/design.md").read_text()
    problems = doc_problems(text) + link_problems(text, ROOT / "docs")
    assert not problems, "docs/design.md names what the code does not have:\n" + "\n".join(problems)


def test_a_renamed_name_or_option_is_caught():
    """The check is strict enough to see a function, member, module, path, subcommand or option renamed."""
    for missing in ("plan_stores", "families.layer_spec", "MiloStore.opened", "Engine(max_row=)",
                    "milo_store/stager.py", "milo-store compact", "milo serve --kv-cache-mem", "--no-such-option",
                    "milo_infer.runtime.engines", "test_store.py::test_no_such_test", "make no-such-target",
                    "bench_serve.py --no-such-option", "python -m milo_infer.vllm.no_such_launcher",
                    "torchrun ... -m milo_infer.cli.main builds", "Attention.no_such_field", '"no such string"'):
        assert span_problems(missing), missing
    for present in ("plan_store", "families.layer_specs", "MiloStore.open", "Engine(max_rows=)",
                    "milo_store/staging.py", "milo-store gc", "milo serve --kv-cache-memory", "--device-cache",
                    "milo_infer.runtime.engine", "make demo", "bench_serve.py --shared-blocks on,off",
                    "torchrun ... -m milo_infer.cli.main build", "Attention.query_turns"):
        assert not span_problems(present), present


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation and symbols dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.lower() if unicodedata.category(c)[0] in "LMN" or c in " -_")
    return kept.replace(" ", "-")


def headings(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def anchors(text: str) -> set[str]:
    """Every heading's anchor, a repeated one numbered as GitHub numbers it (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        anchor = github_anchor(heading)
        out.add(f"{anchor}-{seen[anchor]}" if anchor in seen else anchor)
        seen[anchor] = seen.get(anchor, 0) + 1
    return out


def test_github_anchor():
    assert github_anchor("`milo serve` under load (issue 21)") == "milo-serve-under-load-issue-21"
    assert github_anchor("MLA: a store (issue 62; 22:58–23:15 UTC, ρ 0.5)") == "mla-a-store-issue-62-22582315-utc-ρ-05"
    assert anchors("# A\n## A\n## A\n") == {"a", "a-1", "a-2"}


def test_the_benchmarks_front_page_links_every_figure_to_a_heading():
    text = (ROOT / "docs/benchmarks.md").read_text()
    lines = text.splitlines()
    start = lines.index(f"## {FRONT_PAGE}")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    front = lines[start:end]
    separators = [i for i, line in enumerate(front) if re.fullmatch(r"\|[\s|:-]+\|", line)]
    assert len(separators) >= 5, "one table per area: compression, first token, batch and load, peers, GPU"
    not_data = set(separators) | {i - 1 for i in separators}  # a table's separator and its header
    unlinked = [line for i, line in enumerate(front) if line.startswith("|") and i not in not_data and "](#" not in line]
    assert not unlinked, "rows without a link to the section that measured them:\n" + "\n".join(unlinked)
    known = anchors(text)
    broken = [a for a in re.findall(r"\]\(#([^)]+)\)", text) if a not in known]
    assert not broken, f"links to no heading of docs/benchmarks.md: {broken}"
