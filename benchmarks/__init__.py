"""dutycycle's benchmarks: side-by-side measurements against peers, each writing JSON to benchmarks/results/.

Run one from a checkout as ``python benchmarks/<name>.py`` (``--help`` for its options). The modules import each
other as ``benchmarks.<name>``: a script run that way puts the checkout's root on ``sys.path`` first (one guarded
line under its imports). The tools the tests own (the local S3 server, the peak-memory reading) live in tests/support/ and the
benchmarks import them from there; the tests never import the benchmarks (they run them as scripts). Not installed
with the package.
"""
