"""``lbd ctl``: the operator's client of a sidecar's gRPC API (calls, tables, the live view)."""
