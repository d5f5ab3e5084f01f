"""Sphinx configuration of zeroth's documentation (``make docs``: warnings are errors).

The build reads only this tree and the installed packages: no extension fetches anything
(no intersphinx), so it builds offline.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
# autodoc imports the modules: keep jax on the host CPU, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "zeroth"
author = "The zeroth authors"
copyright = "The zeroth authors"
release = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_generated"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# An "Attributes:" section becomes fields of its class (:ivar:), not attribute entries of their
# own: NamedTuple fields are class members already, and two entries for one name is a duplicate.
napoleon_use_ivar = True

html_theme = "alabaster"
html_title = "zeroth"
html_static_path = []


def _write_config_fields(app):
    """docs/_generated/config_fields.txt: every config field, from the schema (``zeroth run --help-config``)."""
    from zeroth import config, marsit

    out = os.path.join(app.srcdir, "_generated")
    os.makedirs(out, exist_ok=True)
    text = (
        config.describe() + "\n\nA Marsit experiment (a config with a top-level `runs:` list) has instead a base "
        "of the fields below and `runs:`, a list of partial overrides of them, one per run:\n"
        + config.describe(marsit.config.RunSpec)
        + "\n"
    )
    path = os.path.join(out, "config_fields.txt")
    if not os.path.exists(path) or open(path).read() != text:  # rewritten only when it changed
        with open(path, "w") as f:
            f.write(text)


def setup(app):
    app.connect("builder-inited", _write_config_fields)
