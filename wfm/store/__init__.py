"""The store: the database engines, and the SQL of the server's tables, one module per
concern. `database` is the engine-neutral writer (durable group commit) both engines
implement (`sqlitedb`, `pgdb`); `opening` picks one; `schema` holds the numbered
migrations; `records` the rows devices report and the reads the HTTP edge makes;
`fleet_rows` the fleet's own rows (rollouts, the source's condition, the generation, the
gauges' reads); `lead_rows` what lead times are measured with; `identity_rows` the CA
replicas share; `client_rows` the client registry's rows; `replica_rows` what replicas
share (packs and refs per generation, the counters, the compile lease). No SQL is written
anywhere else in the server.
"""
