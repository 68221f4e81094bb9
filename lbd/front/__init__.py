"""``lbd broker``: a Pulsar binary-protocol broker governed by its sidecar.

- :mod:`.wire` frames to bytes and back; :mod:`.storage` the connections to the cluster's
  storage server; :mod:`.served` which bundle the front serves a topic in;
- :mod:`.handles` a client's producers and consumers, :mod:`.connection` one client connection,
  :mod:`.server` the listening ports and their limits;
- :mod:`.service` the serving core (the broker handler: Own, Release, Close; lookups;
  handovers), :mod:`.traffic` and :mod:`.usage` the load reports, :mod:`.metrics`;
- :mod:`.app` the composition root of ``lbd broker``.
"""
