"""dutycycle's benchmarks: side-by-side measurements against peers, each writing JSON to benchmarks/results/.

Run one from a checkout as ``python benchmarks/<name>.py`` (``--help`` for its options). Each that writes a results
file has ``run(args)``, which measures and returns the JSON it writes (``_common.write_result``, to ``--out``, by
default benchmarks/results/<name>.json), and ``render(result)``, its block of the docs (``render_docs.py`` assembles
the pages from them; numbers are formatted by ``docs_format``). The modules import each other as
``benchmarks.<name>``: a script run that way puts the checkout's root on ``sys.path`` first (one guarded line under
its imports). The tools the tests own (the local S3 server, the peak-memory reading) live in tests/support/ and the
benchmarks import them from there; the tests never import the benchmarks (they run them as scripts). Not installed
with the package.
"""
