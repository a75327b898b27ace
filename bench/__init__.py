"""Side-by-side benchmarks of pipeload against torch.utils.data; run ``python -m bench.run``.

Not installed with the package and never run as timed tests.
"""
