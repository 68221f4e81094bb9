"""Ports: the small interfaces the services need from the outside world.

Each port's docstrings are its contract: what is atomic, what is compare-and-swap, which exception
means "unavailable". Adapters (:mod:`lbd.adapters`) implement them for etcd, Pulsar and memory, and
one abstract contract suite per port (``tests/contract``) runs against every implementation.
"""
