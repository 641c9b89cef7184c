"""Git hosting: each device's desired state over Git smart HTTP (read-only, one branch
per device), and the fleet-source repository platform engineers push to, with its
pre-receive hook.
"""
