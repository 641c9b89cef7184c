"""Telemetry: the process's Prometheus metric families and OpenTelemetry spans.
It imports nothing else of the server, so every layer can count and trace.
"""
