"""How tasks reach workers and batches come back: typed messages over channels."""
