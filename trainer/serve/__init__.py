"""Using what a run trained: scoring it on a split (``evaluate``), and its model on new data."""
