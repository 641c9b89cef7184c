"""wfm: the Workload Fleet Manager server, as layers (docs/architecture.md, "The fleet
server"): `server` assembles it; `http` and `git` are its edges; `fleet` is fleet control;
`identity`, `admission` and `store` sit beneath; `telemetry` and `problems` at the bottom.
Each subpackage imports only those below it (`make lint` checks the order)."""
