"""The documentation: `make docs` builds without a warning, the API reference covers the
public API, links between the pages resolve, and no user-facing text names a tracker issue.

The build runs Sphinx as `make docs` does (`-W --keep-going`, a fresh environment), into
a temporary folder; it needs the `[docs]` extra (Sphinx, MyST), which `make test` installs.
What the API reference must cover is counted here from the package itself (`__all__`, the
wrapper's methods, the exceptions the package defines), not from the reference's pages.
"""
import importlib
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys

import pytest
import torch.nn as nn

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def sphinx_build(source: pathlib.Path, out: pathlib.Path) -> subprocess.CompletedProcess:
    """`make docs`'s command on `source`, into `out` (html/ and doctrees/)."""
    return subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(out / "doctrees"), str(source), str(out / "html")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
    """The documentation built once for this module's tests; its html folder."""
    for package in ("sphinx", "myst_parser"):  # a failure, not a skip: `make test` installs them, so CI checks the docs
        if importlib.util.find_spec(package) is None:
            pytest.fail(f"{package} is not installed: the documentation cannot be checked (the [docs] extra: "
                        "pip install -e '.[docs]'; make test installs it)")
    out = tmp_path_factory.mktemp("docs")
    done = sphinx_build(DOCS, out)
    assert done.returncode == 0, f"the documentation build failed or warned:\n{done.stdout}\n{done.stderr}"
    return out / "html"


def test_docs_build_without_warnings(built_docs):
    for page in ("index", "user-guide", "porting", "design", "architecture", "results", "api/index"):
        assert (built_docs / f"{page}.html").is_file(), page


def _documented_objects(html: pathlib.Path) -> set:
    """id() of every Python object the built reference documents (read from its objects.inv)."""
    from sphinx.util.inventory import InventoryFile

    with open(html / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    found = set()
    for kind, entries in inventory.items():
        if not kind.startswith("py:"):
            continue
        for name in entries:
            obj = _resolve(name)
            if obj is not None:
                found.add(id(obj))
    return found


def _resolve(dotted: str):
    """The object a documented dotted name refers to (a module, or attributes of one), else None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = inspect.getattr_static(obj, attr) if isinstance(obj, type) else getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _public_api() -> dict:
    """{qualified name: object} of everything the reference must document, counted from the package."""
    import subnet_ext
    import subnet_ext.data
    import subnet_ext.models

    api = {}
    for name in subnet_ext.__all__:
        obj = getattr(subnet_ext, name)
        if inspect.ismodule(obj):  # checkpoint, ops, reference: their own public functions and classes
            listed = getattr(obj, "__all__", None)  # else what the module defines, not what it imports
            for member in listed or [n for n in vars(obj) if not n.startswith("_")]:
                value = getattr(obj, member)
                module = getattr(value, "__module__", None) or ""
                ours = module == obj.__name__ if listed is None else module.startswith("subnet_ext")
                if (inspect.isfunction(value) or inspect.isclass(value)) and ours:
                    api[f"subnet_ext.{name}.{member}"] = value
        else:
            api[f"subnet_ext.{name}"] = obj
    wrapper = subnet_ext.SubnetDataParallel
    for klass in wrapper.__mro__:
        if klass in (nn.Module, object):
            continue
        for member, value in vars(klass).items():
            if not member.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                api.setdefault(f"subnet_ext.SubnetDataParallel.{member}", value)
    for name in subnet_ext.models.__all__:
        value = getattr(subnet_ext.models, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            api[f"subnet_ext.models.{name}"] = value
    for path in sorted((ROOT / "subnet_ext" / "data").glob("[!_]*.py")):
        module = importlib.import_module(f"subnet_ext.data.{path.stem}")
        for member, value in vars(module).items():
            if not member.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value)) and \
                    value.__module__ == module.__name__:
                api[f"{module.__name__}.{member}"] = value
    for path in sorted((ROOT / "subnet_ext").rglob("*.py")):
        package = path.relative_to(ROOT).with_suffix("").parts
        if package[1] == "cli" or path.stem.startswith("__") or path.stem == "_build_info":
            continue  # the command line's own errors end the process with a message, not in a user's code
        module = importlib.import_module(".".join(package))
        for member, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == module.__name__:
                api[f"{module.__name__}.{member}"] = value  # an error a training script can meet
    return api


def test_api_reference_covers_the_public_api(built_docs):
    documented = _documented_objects(built_docs)
    api = _public_api()
    assert len(api) > 40, sorted(api)  # the count itself: __all__, the wrapper's methods, models, data, errors
    missing = sorted(name for name, obj in api.items() if id(obj) not in documented)
    assert not missing, (f"{len(missing)} public name(s) missing from the API reference (docs/api/*.rst): "
                         f"{missing}")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _user_pages() -> list:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted(DOCS.rglob("*.rst"))]


def test_relative_links_resolve():
    """Every relative link of README.md and docs/ names a file that exists (as GitHub shows them)."""
    broken = []
    for page in _user_pages():
        if "_build" in page.parts:
            continue
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


# "issue 5", "issues #12", "the porting issue", "the issue's targets": a tracker's words, not a user's.
TRACKER = re.compile(r"\bissues?\s*#?\d+|\bthe [\w-]+ issue\b|\bthe issue'?s\b", re.IGNORECASE)


def tracker_mentions(paths, root: pathlib.Path = ROOT) -> list:
    """'path:line: text' (path relative to `root`) of each mention of a tracker issue in `paths`."""
    out = []
    for path in paths:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if TRACKER.search(line):
                out.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return out


def test_no_tracker_numbers_in_user_facing_text():
    pages = [p for p in _user_pages() if "_build" not in p.parts]
    results = sorted((ROOT / "bench" / "results").glob("*.md")) + [ROOT / "bench" / "README.md"]
    code = sorted((ROOT / "subnet_ext").rglob("*.py")) + sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file())
    found = tracker_mentions(pages + results + code)
    assert not found, "user-facing text names tracker issues; say what is meant instead:\n  " + "\n  ".join(found)


def test_the_tracker_check_finds_issue_numbers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Targets (issue 5, CPU)\nas the porting issue says\nfine: the engine issues its buckets\n"
                    "see issues #12 and #13\n")
    assert [m.split(":", 2)[1] for m in tracker_mentions([page], tmp_path)] == ["1", "2", "4"]


CITATION = re.compile(r"docs/design\.md §(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.MULTILINE)


def test_design_citations_name_sections_that_exist():
    """Code cites the design document by section number (`docs/design.md §1.2`); each number
    is a heading there, and nothing cites the brief the project started from instead."""
    sections = set(HEADING.findall((DOCS / "design.md").read_text()))
    assert {"1", "1.1", "2", "3"} <= sections, sorted(sections)
    stale, unknown = [], []
    for path in sorted(ROOT.glob("subnet_ext/**/*.py")) + sorted(ROOT.glob("tests/**/*.py")) + \
            sorted(ROOT.glob("bench/*.py")) + sorted(p for p in ROOT.glob("csrc/**/*") if p.is_file()):
        text = path.read_text(errors="replace")
        if re.search(r"(?<![\w/])" + "DESIGN" + r"\.md", text):
            stale.append(str(path.relative_to(ROOT)))
        unknown += [f"{path.relative_to(ROOT)}: §{n}" for n in CITATION.findall(text) if n not in sections]
    assert not stale, f"cite docs/design.md, the project's design document: {stale}"
    assert not unknown, f"citations of sections docs/design.md does not have: {unknown}"
