"""Sphinx configuration of the subnet_ext documentation (`make docs`).

The pages are Markdown (MyST) beside this file; the API reference (api/) is generated
from the package's docstrings by autodoc, so the package must be importable (built):
`make docs` builds it first. Warnings are errors there (`-W --keep-going`), and
tests/project/test_docs.py runs the same build.
"""
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's package, as an editable install sees it

project = "subnet_ext"
author = "subnet_ext developers"
release = version = next(line.split('"')[1] for line in (ROOT / "subnet_ext" / "__init__.py").read_text().splitlines()
                         if line.startswith("__version__"))

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" / "Returns:" / "Raises:" sections
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# Generated reports shown through wrapper pages under results/ (which add a title and
# fix their relative links), so not documents of their own.
exclude_patterns = ["_build", "demo-cpu.md", "study-cpu.md", "study-cpu-quick.md", "study-schedules.md"]

# Docstrings write `name` for code, as Markdown does.
default_role = "literal"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as fields, so a documented property is not described twice

myst_heading_anchors = 3  # `[text](page.md#a-heading)` links resolve
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = f"subnet_ext {release}"
html_static_path = []
