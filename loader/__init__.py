"""dutycycle.loader: turn a transformed-sample cache into deterministic, resumable per-rank torch batches."""
