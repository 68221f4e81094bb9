"""lbd: a load-balancer sidecar for Pulsar-style message brokers."""

__version__ = "0.1.0"
