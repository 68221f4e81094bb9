"""Services: the sidecar's long-running parts, written against the ports (never an adapter)."""
