"""zero-lab's command-line tools (each run as `python tools/NAME.py`) and the virtual cluster (`tools.vcluster`).
"""
