"""Helpers that build and run the project's test dependencies (a Kubernetes control plane,
a Docker engine) and what tests, benchmarks and the demo share (`polling`)."""
