"""Tools for application vendors who write Margo packages: checks that run on a developer's
machine or in a vendor's CI, before anything reaches a fleet (`margo lint-chart`).

Kept out of `compiler/` and the device client: they need the Helm engine to load and
render charts, which a fleet compile never does.
"""
