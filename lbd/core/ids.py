"""Typed identifiers shared by every layer."""

from typing import NewType

BrokerId = NewType("BrokerId", str)
"""A broker's id: unique in a cluster, stable across its sidecar's restarts (e.g. ``host:port``)."""

BundleId = NewType("BundleId", str)
"""A bundle id, ``tenant/namespace/0x%08x_0x%08x`` (see :mod:`lbd.core.bundles`)."""
