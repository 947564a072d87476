"""Benchmarks of haiku_state: `python -m benchmarks.run`, `python -m benchmarks.plot`.

See benchmarks/README.md for what each figure means.
"""
