"""Kubernetes clusters as Margo targets on the device side: a read-only API client, capability
discovery (nodes, requests, classes, API surface) and the capability provider that reports it.
See docs/kubernetes.md."""
