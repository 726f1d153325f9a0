"""CI tooling for ddp-lab (the notebook runner lives in ``ci/run_notebooks.py``)."""
