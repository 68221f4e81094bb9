"""The pure core: names, bundles, the state machine, load models and strategies.

Nothing here does I/O or imports asyncio, grpc, pulsar or etcd (import-linter enforces it).
Every function is deterministic given its inputs: clocks are passed in as milliseconds and
randomness as a `random.Random`.
"""
