"""Sphinx settings of the course site; ``ci/site.py`` copies this file into the staged source as ``conf.py``.

The site renders the notebooks' stored outputs (the main job's executed notebooks), never runs them.
"""

project = "ddp-lab"
html_title = "ddp-lab: DDP vs DP, a course in notebooks"
author = "ddp-lab"
root_doc = "index"  # the README, staged as index.md by ci/site.py
extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# myst-nb: render what the run stored; cells tagged hide-input (ci/site.py maps `check` to it) collapse
nb_execution_mode = "off"
nb_merge_streams = True
nb_output_stderr = "show"
myst_enable_extensions = ["dollarmath", "html_image"]
# `#heading-slug` links between pages resolve (the glossary's own terms are <a id> anchors)
myst_heading_anchors = 3
# MyST cannot see raw-HTML anchors (the glossary's <a id="rank">) and warns about every link to one, though the
# link it writes is right; `python3 -m ci.site --check` is the link gate instead: it opens every link in a browser
# (a link to a page missing from the site is written as `#path` and reported there as a missing anchor)
suppress_warnings = ["myst.xref_missing"]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "use_download_button": True,  # the page's .ipynb (ci/site.py puts the notebook there)
    "use_fullscreen_button": False,
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
# the download button then links `_sources/notebooks/<stem>.ipynb`, not `<stem>.ipynb.txt`
html_sourcelink_suffix = ""
html_show_sphinx = False
html_last_updated_fmt = "%Y-%m-%d"
