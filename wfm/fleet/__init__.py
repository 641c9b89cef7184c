"""Fleet control: what devices should run and how far they got. Compiles on triggers,
the desired state served per client, staged rollouts, freshness, lead times, where the
fleet source comes from, and replicas' coordination and replication on one database.
"""
