"""Admission: what a request may bring in before anyone reads it, and where it waits. Each
body is capped while it streams, and budgets bound the bytes of all bodies in flight
together, per route class and per client address; a request held until its answer changes
waits outside the ASGI stack (`parking`).
"""
