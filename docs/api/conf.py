"""Sphinx configuration of dsched's API reference, built from the docstrings (numpydoc).

Build: ``python -m sphinx -W -b html docs/api build/api`` (CI builds it with warnings as errors).
"""

project = "dsched"
author = "the dsched developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.autosummary", "numpydoc", "sphinx.ext.intersphinx"]
autosummary_generate = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_typehints = "none"  # the docstrings' Parameters sections say the types
numpydoc_show_class_members = False  # members are listed by autodoc, once
numpydoc_class_members_toctree = False
intersphinx_mapping = {}
html_theme = "alabaster"
exclude_patterns = ["_build"]
nitpicky = False
