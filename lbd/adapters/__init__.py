"""Adapters: the ports implemented for each outside system, one module per system.

Only an adapter imports its system's client: ``etcd*`` modules import ``aetcd``, the Pulsar adapter
imports ``pulsar``; nothing else in lbd does. :mod:`lbd.adapters.memory` holds deterministic
in-memory twins for unit tests and the simulator, and :mod:`lbd.adapters.clock` the clocks.
"""
