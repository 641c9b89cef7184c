"""The fleet server assembled: the ASGI app and its lifespan (what opens, in which
order, and closes), the process's garbage-collector policy, and the lock that keeps one
server per data directory. The rest of `wfm` is wired together here and nowhere else.
"""
