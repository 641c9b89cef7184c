"""wfm: Workload Fleet Manager server (Margo API, Git hosting, webhooks); to come."""
