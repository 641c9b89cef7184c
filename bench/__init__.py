"""Benchmarks, each run from the repository's root as `python -m bench.<name>` (`make bench`):
they import the installed packages, `tools` (the servers they start) and `bench.benchkit`."""
