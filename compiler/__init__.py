"""compiler: fleet compiler (intents x capabilities → per-device desired state in Git); to come."""
