"""Real client traffic: the official Pulsar client producing and consuming through the brokers,
every message recorded, and the figures a user judges a cluster by (:mod:`.records`).

The only part of lbd besides the Pulsar adapters that imports ``pulsar``: it *is* a Pulsar
client application, used by ``lbd load``, the end-to-end suite and the ``clients`` benchmark.
"""
