"""Who is training and whether they can: the ``World`` (rank, size, node layout) and object collectives
(``world.py``), where each rank runs as the ranks report it and what that layout allows (``topology.py``), the
pre-flight health check of every worker (``health.py``), and a local Ray cluster and free
ports for the demo, tests and benchmarks (``local.py``)."""
