"""``lbd load``: real Pulsar clients producing and consuming through a cluster's brokers.

One producer (``send_async``) and consumers (acknowledging each message) per topic, topics
spread over the namespaces given, each at its rate; a line of figures every ``--report-every``
seconds, and at the end what the clients saw: failed sends, acknowledged messages never received
(lost), duplicates, reordering, send latency and the longest gap in delivery. Runs until
``--duration`` is up or SIGINT/SIGTERM. ``lbd dev up --traffic`` runs it against the dev cluster.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from lbd.core.errors import InvalidInputError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd load``."""
    p = sub.add_parser(
        "load",
        help="drive a cluster with real Pulsar producers and consumers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--service-url", metavar="URL", help="pulsar://host:port[,host:port...] of the brokers"
    )
    where.add_argument(
        "--state-dir", type=Path, metavar="DIR", help="a dev cluster's (its brokers and TLS files)"
    )
    p.add_argument("--topics", type=int, default=8, metavar="N", help="topics (default 8)")
    p.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="TENANT/NS",
        help="namespace the topics are spread over (repeatable; default public/default)",
    )
    p.add_argument("--prefix", default="load", help="topic name prefix (default load)")
    p.add_argument("--rate", type=float, default=20.0, help="messages/s per topic (default 20)")
    p.add_argument("--size", type=int, default=256, help="bytes per message (default 256)")
    p.add_argument(
        "--subscription-type",
        default="failover",
        choices=("exclusive", "failover", "shared", "key_shared"),
    )
    p.add_argument("--consumers-per-topic", type=int, default=1, metavar="N")
    p.add_argument(
        "--hot-fraction", type=float, default=0.0, metavar="F", help="share of hot topics"
    )
    p.add_argument(
        "--hot-factor", type=float, default=5.0, metavar="X", help="a hot topic's rate factor"
    )
    p.add_argument("--duration", type=float, default=0.0, metavar="S", help="0: until stopped")
    p.add_argument("--report-every", type=float, default=10.0, metavar="S")
    p.add_argument("--tls-ca", metavar="FILE", help="CA the brokers' certificates chain to")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", metavar="FILE", help="key of --tls-cert")
    p.set_defaults(func=run)


class _Stop(BaseException):
    pass


def run(args: argparse.Namespace) -> int:
    """Drive the traffic; 0, or 1 when an acknowledged message was lost."""
    from lbd.traffic.clients import ClientTls, ClientTraffic, TrafficSpec, topics_for
    from lbd.traffic.records import summarize

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    url, tls = args.service_url, None
    if args.state_dir is not None:
        from lbd.devcluster.cluster import load_cluster

        cluster = load_cluster(args.state_dir)
        url = cluster.service_url
        if not url:
            raise InvalidInputError(f"the dev cluster in {args.state_dir} has no broker fronts")
        c = cluster.pulsar_client
        if c:
            tls = ClientTls(c["ca_file"], c.get("cert_file"), c.get("key_file"))
    if args.tls_ca is not None:
        tls = ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    try:
        spec = TrafficSpec(
            service_url=url,
            topics=topics_for(args.namespaces or ["public/default"], args.topics, args.prefix),
            rate=args.rate,
            size=args.size,
            subscription_type=args.subscription_type,
            consumers_per_topic=args.consumers_per_topic,
            hot_fraction=args.hot_fraction,
            hot_factor=args.hot_factor,
            tls=tls,
        )
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    traffic = ClientTraffic(spec)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    started = time.monotonic()
    try:
        traffic.start()
        print(
            f"load: {len(spec.topics)} topics at {spec.rate:g} msg/s each through {url}", flush=True
        )
        _report(traffic, started, args.duration, args.report_every)
    except _Stop:
        pass
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        traffic.stop(drain_s=10.0)
    summary = summarize(traffic.record)
    print(f"load: {summary.line()}", flush=True)
    for failure in summary.failures:
        print(f"load: failed sends: {failure}", flush=True)
    return 1 if summary.lost else 0


def _report(traffic: object, started: float, duration: float, every: float) -> None:
    from lbd.traffic.clients import ClientTraffic

    assert isinstance(traffic, ClientTraffic)
    record = traffic.record
    last = (time.monotonic(), 0, 0, 0)
    wake = threading.Event()
    while duration <= 0 or time.monotonic() - started < duration:
        left = every if duration <= 0 else min(every, duration - (time.monotonic() - started))
        wake.wait(max(left, 0.0))
        now = time.monotonic()
        sends = [s for p in record.producers for s in list(p.sends)]
        acked = sum(1 for s in sends if s.ended_ns is not None and s.error is None)
        failed = sum(1 for s in sends if s.error is not None)
        received = len(record.deliveries)
        span = max(now - last[0], 1e-3)
        print(
            f"load: {(len(sends) - last[1]) / span:.0f} sent/s, {(received - last[2]) / span:.0f} "
            f"received/s, {failed} failed, {len(sends) - acked - failed} pending",
            flush=True,
        )
        last = (now, len(sends), received, failed)
