"""One training step and what surrounds it on a rank: the loop (``loop.py``), its time account (``timing.py``,
``steplog.py``), batch sources (``data.py``), models and optimizers, metrics and the run report. The same code
runs under every launcher in ``launch/``."""
