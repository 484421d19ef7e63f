"""The package's layering, as a test (pure Python, ast only).

Layers, lowest first: vocabulary < ops < planning < comm < state < engine < integrations < cli. A
module may import its own layer and lower ones. models/ and data/ are leaves: planning,
engine and cli may import them; they import nothing of ours but each other. subnet_ext/__init__.py and
testing.py are the top. Also: no import cycle between modules; a module over 400 lines names its parts in
its docstring (a "Parts:" paragraph of at least two "- " lines that, with the rest of the
docstring, names every public class and function it defines: one concept, read in
sections, instead of a concept split to fit a cap), none over 800; no function over 60
lines unless its first body line or the line above its `def` is a comment saying why.

Signatures count as dependencies too (`signature_errors`): a parameter or field annotated
with a class that only a higher layer defines, a Callable parameter in ops, planning or
comm (a callback from above), a parameter named for the engine (`sdp`, `engine`) below
it, and an unannotated constructor parameter in comm (which would hide any of these).
What ast cannot see (an unannotated function argument that is a higher-layer object or
a bound method) is the README's rule (Architecture).

One source per concept (`concept_copies`): the closed sets of names (levels, regimes, unit
kinds, assignments) are spelled out only in subnet_ext/vocabulary.py, in the package and in
bench/, and a dtype's size is vocabulary.dtype_size, never a tensor built to ask it.
"""
import ast
import pathlib

PACKAGE = "subnet_ext"
ROOT = pathlib.Path(__file__).resolve().parents[2] / PACKAGE
LAYERS = ["vocabulary", "measure", "ops", "planning", "comm", "state", "engine", "integrations", "jobs", "cli"]
LEAVES = {"models", "data"}
LEAF_USERS = {"planning", "engine", "jobs", "cli"}
TOP = {PACKAGE, f"{PACKAGE}.testing"}
PARTS_LINES, MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 800, 60
NO_CALLBACK_LAYERS = {"ops", "planning", "comm"}  # take data and typed objects from above, never behaviour
TYPED_CONSTRUCTOR_LAYERS = {"comm"}  # every constructor parameter annotated, so the checks see it
ENGINE_NAMES = {"sdp", "engine"}  # parameter names that say "the whole engine"
# Violations found by this test and not fixed yet: listed so that any new one
# fails, and fixing one fails until it is removed from here.
KNOWN_CYCLES = []
KNOWN_LONG_FUNCTIONS = []
# File names two modules may share, each with why. cli/ names its command modules after the
# command (`subnet-plan` is cli/plan.py, as `subnet-train` is cli/train.py), and a plan is what
# planning/plan.py defines: both names say what the file holds, in the package that holds it.
SHARED_FILE_NAMES = {"plan.py": ("cli/plan.py", "planning/plan.py")}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(name: str, source: str, is_package: bool) -> set:
    """Modules of the package that `source` imports, anywhere (functions included)."""
    out = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            if target and target.split(".")[0] == PACKAGE:
                if node.module:  # `from .. import ops`: the dependency is ops, not the package top
                    out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)  # `from . import guard`
    return out


def section(name: str):
    """The layer or leaf a module belongs to ('top' for the package root and testing)."""
    if name in TOP:
        return "top"
    if name == f"{PACKAGE}._build_info":
        return "ops"  # generated build metadata, read by ops/build_info.py
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "top"


def layering_errors(modules: dict) -> list:
    """[message] for each import that goes up a layer or into/out of a leaf wrongly.

    Args: modules: {module name: set of imported module names of the package}."""
    errors = []
    for name, imported in modules.items():
        here = section(name)
        for target in imported:
            if target not in modules:
                continue  # `from pkg import name` where name is not a module
            there = section(target)
            if here == "top" or there == here:
                continue
            if there == "top":
                errors.append(f"{name} imports the package top {target}")
            elif here in LEAVES:
                if there not in LEAVES:
                    errors.append(f"leaf {name} imports {target}")
            elif there in LEAVES:
                if here not in LEAF_USERS:
                    errors.append(f"{name} ({here}) imports leaf {target}")
            elif LAYERS.index(there) > LAYERS.index(here):
                errors.append(f"{name} ({here}) imports higher layer {target} ({there})")
    return sorted(errors)


def cycles(modules: dict) -> list:
    """Strongly connected components of more than one module (or self-imports)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in modules.get(v, ()):
            if w not in modules or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return out


def _parents_of_package(modules: dict) -> dict:
    """The same graph without the edge a module has to its own package's __init__ (a
    package importing its children and a child importing a sibling through the package
    is Python's normal structure, not a cycle of ideas)."""
    return {n: {t for t in imp if not n.startswith(t + ".")} for n, imp in modules.items()}


def long_functions(name: str, source: str) -> list:
    """[message] for each function over MAX_FUNCTION_LINES without a 'why' comment."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        first = node.body[0].lineno
        if isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant) \
                and len(node.body) > 1:
            first = node.body[1].lineno  # after the docstring
        above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        # A comment on the first body line, on the line just before it, or above the def.
        candidates = [lines[first - 1], lines[first - 2] if first >= 2 else "", above]
        if not any(c.strip().startswith("#") or " # " in c for c in candidates):
            out.append(f"{name}.{node.name}: {length} lines (max {MAX_FUNCTION_LINES} without a comment why)")
    return out


def annotation_names(node) -> set:
    """Every name an annotation mentions (Name ids, Attribute attrs, inside strings too)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                out |= annotation_names(ast.parse(n.value, mode="eval"))
            except SyntaxError:
                pass
    return out


def _callable_aliases(tree) -> set:
    """Module-level names bound to a Callable type (`Resolver = Callable[[Piece], tuple]`)."""
    return {t.id for node in tree.body if isinstance(node, ast.Assign) and "Callable" in annotation_names(node.value)
            for t in node.targets if isinstance(t, ast.Name)}


def _signatures(tree):
    """(function or class name, parameter or field name, annotation or None, public constructor?)
    for every parameter of every function and every annotated field of every class."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    yield node.name, item.target.id, item.annotation, False
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
                    for a in item.args.posonlyargs + item.args.args[1:] + item.args.kwonlyargs:
                        yield f"{node.name}.__init__", a.arg, a.annotation, not node.name.startswith("_")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__init__":
            args = node.args
            for a in args.posonlyargs + args.args + args.kwonlyargs + [x for x in (args.vararg, args.kwarg) if x]:
                if a.arg not in ("self", "cls"):
                    yield node.name, a.arg, a.annotation, False


def signature_errors(sources: dict) -> list:
    """[message] for each dependency a signature carries up the layers (see the module docstring).

    Args: sources: {module name: source text}."""
    defined = {}
    trees = {name: ast.parse(src) for name, src in sources.items()}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and section(name) in LAYERS:
                defined.setdefault(node.name, set()).add(LAYERS.index(section(name)))
    callables = {"Callable"}.union(*(_callable_aliases(tree) for tree in trees.values()))  # aliases are imported
    errors = []
    for name, tree in trees.items():
        here = section(name)
        if here not in LAYERS:
            continue
        level = LAYERS.index(here)
        for owner, param, annotation, constructor in _signatures(tree):
            names = annotation_names(annotation) if annotation is not None else set()
            for t in sorted(names):
                if t in defined and min(defined[t]) > level:
                    errors.append(f"{name} ({here}): {owner}({param}) is annotated with {t} of higher layer "
                                  f"{LAYERS[min(defined[t])]}")
            if here in NO_CALLBACK_LAYERS and names & callables:
                errors.append(f"{name} ({here}): {owner}({param}) takes a callable: pass data or a typed object")
            if level < LAYERS.index("engine") and param in ENGINE_NAMES:
                errors.append(f"{name} ({here}): {owner}({param}) takes the engine: pass what it needs")
            if here in TYPED_CONSTRUCTOR_LAYERS and constructor and annotation is None:
                errors.append(f"{name} ({here}): {owner}({param}) is not annotated")
    return sorted(errors)


def _vocabulary() -> dict:
    """{frozenset of names: its name in subnet_ext/vocabulary.py} for every closed set defined there."""
    tree = ast.parse((ROOT / "vocabulary.py").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            values = frozenset(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            out.update({values: t.id for t in node.targets if isinstance(t, ast.Name)})
    return out


def concept_copies(sources: dict, vocabulary: dict) -> list:
    """[message] for each copy of a concept vocabulary.py defines: a tuple, list or set literal of
    the strings of one of its closed sets (in any order), or a dtype's size read off a tensor made
    for the purpose (`torch.empty(...).element_size()`).

    Args: sources: {module or file name: source text}; vocabulary: as _vocabulary() returns."""
    errors = []
    for name, source in sources.items():
        if name.endswith("vocabulary"):
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 \
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                if values in vocabulary and len(values) == len(node.elts):
                    errors.append(f"{name}:{node.lineno} spells out {vocabulary[values]} (import it from "
                                  "subnet_ext.vocabulary)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "element_size" and isinstance(node.func.value, ast.Call) \
                    and getattr(node.func.value.func, "attr", None) == "empty":
                errors.append(f"{name}:{node.lineno} builds a tensor to read a dtype's size (vocabulary.dtype_size)")
    return sorted(errors)


def scan():
    """({module: imports}, {module: source})."""
    modules, sources = {}, {}
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        source = path.read_text()
        sources[name] = source
        modules[name] = imports_of(name, source, path.name == "__init__.py")
    return modules, sources


# ----------------------------------------------------------------------------- the package
def test_layers_respected():
    modules, _ = scan()
    assert layering_errors(modules) == []


def test_signatures_carry_no_higher_layer():
    _, sources = scan()
    assert signature_errors(sources) == []


def test_no_import_cycles():
    modules, _ = scan()
    assert cycles(_parents_of_package(modules)) == KNOWN_CYCLES


def unnamed_parts(name: str, source: str) -> list:
    """[message] when a module over PARTS_LINES lines does not name its parts (module docstring)."""
    if len(source.splitlines()) <= PARTS_LINES:
        return []
    tree = ast.parse(source)
    doc = ast.get_docstring(tree) or ""
    parts = doc.split("Parts:", 1)[1] if "Parts:" in doc else ""
    if sum(line.lstrip().startswith("- ") for line in parts.splitlines()) < 2:
        return [f"{name}: {len(source.splitlines())} lines and no 'Parts:' paragraph of '- ' lines in its docstring"]
    public = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and not n.name.startswith("_")]
    return [f"{name}: its docstring does not name {n}" for n in public if n not in doc]


def test_module_and_function_sizes():
    _, sources = scan()
    too_long = [f"{n}: {len(s.splitlines())} lines" for n, s in sources.items()
                if len(s.splitlines()) > MAX_MODULE_LINES]
    assert too_long == []
    assert [m for n, s in sources.items() for m in unnamed_parts(n, s)] == []
    assert sorted(m for n, s in sources.items() for m in long_functions(n, s)) == KNOWN_LONG_FUNCTIONS


def test_each_concept_is_defined_once():
    _, sources = scan()
    bench = ROOT.parent / "bench"
    sources.update({path.relative_to(ROOT.parent).as_posix(): path.read_text() for path in sorted(bench.rglob("*.py"))})
    assert concept_copies(sources, _vocabulary()) == []


def shared_file_names(root: pathlib.Path = ROOT) -> dict:
    """{file name: (its paths under root, sorted)} for each name two or more modules share
    (__init__.py aside): a name that says "sharding" or "checkpoint" in two packages with two
    meanings makes a reader open the wrong one."""
    by_name = {}
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            by_name.setdefault(path.name, []).append(path.relative_to(root).as_posix())
    return {name: tuple(paths) for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_modules_share_a_file_name():
    assert shared_file_names() == SHARED_FILE_NAMES, (
        "modules sharing a file name (rename one so each name says what it holds, or add the pair to "
        f"SHARED_FILE_NAMES with why): {shared_file_names()}")


# ----------------------------------------------------------------------------- the checker
def test_the_file_name_check_finds_a_shared_name(tmp_path):
    for path in ("engine/sharding.py", "planning/sharding.py", "engine/__init__.py", "planning/__init__.py",
                 "state/layout.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert shared_file_names(tmp_path) == {"sharding.py": ("engine/sharding.py", "planning/sharding.py")}


def test_checker_catches_violations():
    synthetic = {
        "subnet_ext.ops.a": {"subnet_ext.state.b"},          # up two layers
        "subnet_ext.state.b": {"subnet_ext.ops.a"},
        "subnet_ext.models.m": {"subnet_ext.planning.p"},    # a leaf importing a layer
        "subnet_ext.planning.p": {"subnet_ext.models.m"},    # allowed
        "subnet_ext.comm.c": {"subnet_ext.data.d"},          # comm may not use a leaf
        "subnet_ext.data.d": set(),
        "subnet_ext.cli.x": {"subnet_ext.engine.y"},         # allowed
        "subnet_ext.engine.y": set(),
    }
    errors = layering_errors(synthetic)
    assert errors == sorted(["subnet_ext.ops.a (ops) imports higher layer subnet_ext.state.b (state)",
                             "leaf subnet_ext.models.m imports subnet_ext.planning.p",
                             "subnet_ext.comm.c (comm) imports leaf subnet_ext.data.d"])
    assert cycles(synthetic) == [["subnet_ext.models.m", "subnet_ext.planning.p"],
                                 ["subnet_ext.ops.a", "subnet_ext.state.b"]]
    filler = "\n".join(f"x{i} = {i}" for i in range(PARTS_LINES))
    assert unnamed_parts("m", f'"""M."""\ndef f():\n    pass\n{filler}\n') == [
        f"m: {PARTS_LINES + 3} lines and no 'Parts:' paragraph of '- ' lines in its docstring"]
    assert unnamed_parts("m", f'"""M.\n\nParts:\n- a\n- b\n"""\ndef f():\n    pass\n{filler}\n') == [
        "m: its docstring does not name f"]
    assert unnamed_parts("m", f'"""M.\n\nParts:\n- f: one\n- the rest\n"""\ndef f():\n    pass\n{filler}\n') == []
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    assert long_functions("m", f"def f():\n{body}\n") == ["m.f: 62 lines (max 60 without a comment why)"]
    assert long_functions("m", f"def f():\n    # why: one table, read top to bottom\n{body}\n") == []
    src = "def g():\n    from ..engine import data_parallel\n"
    assert imports_of("subnet_ext.state.z", src, False) == {"subnet_ext.engine", "subnet_ext.engine.data_parallel"}


def test_concept_checker_finds_copies():
    vocabulary = _vocabulary()
    assert set(vocabulary.values()) >= {"LEVELS", "REGIMES", "KINDS", "ASSIGNMENTS", "BLOCK_ASSIGNMENTS"}
    synthetic = {"m": 'A = ("neuron", "block")\nB = ["forward", "backward"]\nC = ("block", "other")\n'
                      'n = torch.empty((), dtype=d).element_size()\nok = t.element_size()\n'}
    assert concept_copies(synthetic, vocabulary) == [
        "m:1 spells out LEVELS (import it from subnet_ext.vocabulary)",
        "m:2 spells out REGIMES (import it from subnet_ext.vocabulary)",
        "m:4 builds a tensor to read a dtype's size (vocabulary.dtype_size)"]


def test_signature_checker_catches_callbacks_and_higher_types():
    comm_bad = (
        "from typing import Callable\n"
        "Resolver = Callable[[int], tuple]\n"
        "class Averager:\n"
        "    def __init__(self, resolve: Resolver, layout: 'RankLayout', device, size: int):\n"
        "        pass\n"
        "class Place:\n"
        "    layout: RankLayout\n"
        "def hook(sdp, done: Callable[[], None]) -> None:\n"
        "    pass\n")
    synthetic = {
        "subnet_ext.state.layout": "class RankLayout:\n    pass\n",
        "subnet_ext.engine.data_parallel": "class SubnetDataParallel:\n    pass\n",
        "subnet_ext.comm.bad": comm_bad,
        "subnet_ext.comm.good": "class Fine:\n    def __init__(self, size: int, places: dict):\n        pass\n",
        "subnet_ext.comm.user": "from .bad import Resolver\ndef refresh(resolve: Resolver):\n    pass\n",
        "subnet_ext.state.user": "def save(where: 'SubnetDataParallel', engine):\n    pass\n",
        "subnet_ext.engine.free": "from typing import Callable\ndef f(layout: 'RankLayout', hook: Callable, sdp):\n"
                                  "    pass\n",
    }
    assert signature_errors(synthetic) == sorted([
        "subnet_ext.comm.bad (comm): Averager.__init__(resolve) takes a callable: pass data or a typed object",
        "subnet_ext.comm.bad (comm): Averager.__init__(layout) is annotated with RankLayout of higher layer state",
        "subnet_ext.comm.bad (comm): Averager.__init__(device) is not annotated",
        "subnet_ext.comm.bad (comm): Place(layout) is annotated with RankLayout of higher layer state",
        "subnet_ext.comm.bad (comm): hook(sdp) takes the engine: pass what it needs",
        "subnet_ext.comm.bad (comm): hook(done) takes a callable: pass data or a typed object",
        "subnet_ext.comm.user (comm): refresh(resolve) takes a callable: pass data or a typed object",
        "subnet_ext.state.user (state): save(where) is annotated with SubnetDataParallel of higher layer engine",
        "subnet_ext.state.user (state): save(engine) takes the engine: pass what it needs",
    ])
