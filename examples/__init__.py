"""The example fleet and the demo (`make demo`: `python -m examples.demo` from the root)."""
