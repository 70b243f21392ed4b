"""Starting a run: in this process or on Ray Train (``train.py``), under torchrun (``torchrun.py``), and getting
its results back to the driver through Ray Train's storage (``results.py``)."""
