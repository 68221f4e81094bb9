"""The gRPC API (DESIGN §6): thin servicers over the services, and the interceptors around them.

:mod:`lbd.api.server` puts it together: ``lbd.v1.LoadBalancer`` (:mod:`lbd.api.loadbalancer`),
``lbd.v1.Admin`` (:mod:`lbd.api.admin`, forwarding with :mod:`lbd.api.forwarding`), server
reflection and ``grpc.health.v1``, behind the tracing (:mod:`lbd.api.tracing`), admin-token
(:mod:`lbd.api.auth`) and error-mapping (:mod:`lbd.api.errors`) interceptors. Conversions between
protobuf and the core types live in :mod:`lbd.api.convert` only.
"""
