"""Simulations of a cluster, for the demo, tests and benchmarks."""
