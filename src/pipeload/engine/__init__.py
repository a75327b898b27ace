"""The loading engines: inline (num_workers=0) and pooled workers (processes or threads)."""
