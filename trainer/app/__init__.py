"""The application at the top of the import graph: the ``dutycycle`` command for every package (``cli.py``, with
the training commands in ``commands.py``), the demo (``demo.py``), the fault it injects (``chaos.py``), the
cluster its ``--elastic`` run loses a node from and gets it back (``elastic.py``) and its page
(``demo_report.py``). Nothing below imports from here."""
