"""The transformed-sample cache: ``materialize`` writes it (Daft UDF in ``udf``), ``write`` writes one from samples
already in memory, ``format`` defines and reads it, ``view`` shows it in a notebook, ``cli`` is
``dutycycle materialize``.

Empty on purpose: public names live in ``dutycycle.engine`` (lazy), so importing this package loads nothing heavy.
"""
