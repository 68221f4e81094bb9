"""What every sidecar runs for its own broker: lookups, the broker link, registration and
reconciliation, operations, splits, load reports, fencing, the session watcher."""
