"""The metadata table: ``catalog`` ingests it, ``format`` defines its on-disk layout, ``commit`` writes a version,
``split`` assigns train/val/test, ``table`` opens it as a lazy Daft-backed object, ``curate`` filters, dedupes,
samples and saves it.

Empty on purpose: public names live in ``dutycycle.engine`` (lazy), so importing this package loads nothing heavy.
"""
