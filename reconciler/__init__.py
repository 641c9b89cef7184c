"""reconciler: device client (pull desired state, converge releases, report); to come."""
