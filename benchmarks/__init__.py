"""dutycycle's benchmarks: side-by-side measurements against peers, each writing JSON to benchmarks/results/.

Run one from a checkout as ``python benchmarks/<name>.py`` (``--help`` for its options). The modules import each
other as ``benchmarks.<name>``: a script run that way puts the checkout's root on ``sys.path`` first (one guarded
line under its imports). Tests import the shared helpers (``benchmarks._common``: the local S3 server, peak RSS,
the row runner) from here; the benchmarks never import the tests. Not installed with the package.
"""
