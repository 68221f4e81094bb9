"""The deterministic simulation: real sidecars under a virtual clock with seeded faults."""
