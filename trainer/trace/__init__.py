"""Per-step sample provenance: which rows trained step N, which steps trained a row (``dutycycle trace``).

Nothing is logged per step to answer it. Each start of the Trainer (a launch, a resume, a restart at another world
size) writes one ``attempt`` row into ``metrics.jsonl`` with what it planned from (``step/provenance.py``: the
loader's plan inputs and position, the world size, the data-parallel ranks, the micro-batches); ``steps.py``
walks those starts to find which epoch, global batch, rank and micro-batch each step had; the plan (a pure
function, ``dutycycle.loader.plan``) gives the batch's split indices; ``rows.py`` turns them into the cache's and
the table's rows. ``losses.py`` reads the optional per-sample loss log (``run.record_sample_loss``, written by step/provenance.py), ``page.py``
the HTML page, ``command.py`` the command (its arguments: trainer/app/commands.py).
"""
