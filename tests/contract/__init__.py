"""Contract suites: one abstract suite per port, run against the in-memory and the real adapter."""
