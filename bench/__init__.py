"""Benchmarks: ``make bench`` (``python -m bench``) runs them and prints one table."""
