"""``python -m bench [--quick] [--only SUITE | --figures]``: run the benchmarks, print their tables.

Suites: ``core`` (the pure core's hot paths), ``channel`` (publish and catch-up rates and read
barriers on a pulsar-lite it starts itself), ``startup`` (checkpoint + tail vs full replay, on an
etcd and a pulsar-lite it starts itself), ``sidecar`` (lookup and assignment latency, failover after
kill -9, on a dev cluster it starts itself), ``outages`` (etcd paused, etcd and pulsar-lite killed
and restarted: what closed or moved, and the recovery time, on a dev cluster it starts itself),
``sim`` (seeds per second of the deterministic simulation), ``security`` (owned Lookups through
a plain and a ``--secure`` dev cluster: what mutual TLS and roles cost), ``balance`` (every
shedding strategy on the standard balancing scenarios, as ``lbd bench balance``), ``operating``
(per-transfer unavailability over 60 transfers under traffic, and the drain of 200 bundles under
the default execution governor, on a dev cluster it starts itself), ``lookup`` (owned Lookups on a
sidecar beside a trivial grpc.aio server answering the same bytes: the ratio to the gRPC
ceiling), ``recovery`` (a broker with 10,000 bundles killed: each phase of their repair),
``failover`` (a broker with 10, 1,000 and 10,000 bundles killed, every setting at its default:
seconds to all Owned again, beside Pulsar's and KRaft's detection times), ``etcd_lease`` (etcd's
keepalive round trip and lease expiry, idle and under writes: what the 3 s lease rests on),
``broker_cache`` (the broker-side ownership cache's topic lookups, in process), ``clients``
(the official Pulsar client through broker fronts while a dev cluster goes through transfers,
an unload, a split, a drain, a rolling restart, kills, pauses and outages: failed, lost and
duplicated messages, latencies, lookups per event; and one front's overhead), ``assign``
(new-bundle assignments one at a time and in bulk, on a dev cluster it starts itself), ``split``
(one bundle split into 5,000 children, against the split's deadline), ``scale`` (100 brokers with
1k, 10k and 100k bundles, dev and default timings: lookups, memory, idle CPU, catch-up),
``partitions`` (one broker host's links cut, slowed or made flaky under real clients: a sidecar
from etcd only and from the channel only, a broker from its sidecar, the leader from the channel,
a host from the servers, flaky links; what the clients lost and how soon the cluster was whole
again), ``rest`` (HTTP lookups on a broker's web port, Pulsar's REST API, against gRPC Lookups on
its sidecar, same cluster, same run), ``balance-live`` (5 brokers under real producers and
consumers, then 5 more: the std of the load the brokers carry every 10 s from their load
reports, cycles and minutes until it is under target beside Pulsar's published 5 minutes, the
moves, the moved topics' send latency; every interval a fifth of the default, stated).

The suites in ``FIGURE_SUITES`` also give figures, each set against a baseline: measured in the
same run where there is one (the lookup suite's trivial grpc.aio server), else the goal. After
the suites' own tables one more lists them, with each ratio and whether it meets its goal;
``--figures`` runs only those suites.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from bench import (
    assign_bench,
    balance_live_bench,
    broker_cache_bench,
    channel_bench,
    clients_bench,
    core,
    etcd_lease_bench,
    failover_bench,
    lookup_bench,
    operating_bench,
    outage_bench,
    partitions_bench,
    recovery_bench,
    rest_bench,
    scale_bench,
    security_bench,
    sidecar_bench,
    sim_bench,
    split_bench,
    startup_bench,
)
from bench.report import Figure, figures_table, measurements_table
from lbd.workload.suite import run_suite
from lbd.workload.suite import table as balance_table

SUITES = (
    "core",
    "broker_cache",
    "balance",
    "channel",
    "startup",
    "sidecar",
    "lookup",
    "assign",
    "recovery",
    "failover",
    "etcd_lease",
    "split",
    "scale",
    "operating",
    "outages",
    "sim",
    "security",
    "clients",
    "partitions",
    "rest",
    "balance-live",
)
FIGURE_SUITES = (
    "lookup",
    "assign",
    "recovery",
    "failover",
    "broker_cache",
    "split",
    "scale",
    "clients",
    "partitions",
    "rest",
    "balance-live",
)
"""The suites with a ``figures(result)``, which ``--figures`` runs. A suite joins with its name
here and, after its own table in :func:`main`, ``figures += <its module>.figures(result)``."""


def main() -> None:
    """Run the chosen suites, print a table for each, then their figures against baselines."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller inputs (smoke run)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only", choices=SUITES, action="append", help="run only these suites")
    which.add_argument(
        "--figures",
        action="store_const",
        dest="only",
        const=FIGURE_SUITES,
        help=f"run only the suites with figures against a baseline ({', '.join(FIGURE_SUITES)})",
    )
    args = parser.parse_args()
    suites = args.only or SUITES
    console = Console()
    figures: list[Figure] = []
    if "core" in suites:
        table = Table(title="core")
        for column in ("benchmark", "ops", "seconds", "rate"):
            table.add_column(column, justify="left" if column == "benchmark" else "right")
        with console.status("core..."):
            for r in core.run(quick=args.quick):
                table.add_row(r.name, f"{r.ops:,}", f"{r.seconds:.3f}", f"{r.rate:,.0f} {r.unit}/s")
        console.print(table)
    if "broker_cache" in suites:
        with console.status("broker_cache: topic lookups from the ownership cache..."):
            result = broker_cache_bench.run(rounds=10 if args.quick else 100)
        console.print(measurements_table("broker-side ownership cache, in process", result))
        figures += broker_cache_bench.figures(result)
    if "balance" in suites:
        with console.status("balance: every strategy on every scenario..."):
            console.print(balance_table(run_suite()))
    if "channel" in suites:
        n = 10_000 if args.quick else 100_000
        with console.status(f"channel: {n:,} messages on pulsar-lite..."):
            result = channel_bench.run(messages=n, sequential=500 if args.quick else 2_000)
        console.print(measurements_table("state channel on pulsar-lite (rates per second)", result))
    if "startup" in suites:
        n = 10_000 if args.quick else 100_000
        with console.status(f"startup: {n:,} bundles..."):
            result = startup_bench.run(bundles=n, tail=1_000)
        console.print(measurements_table("sidecar start: checkpoint + tail vs full replay", result))
    if "sidecar" in suites:
        lookups = 1_000 if args.quick else 5_000
        with console.status(f"sidecar: a dev cluster, {lookups:,} lookups, kill -9..."):
            result = sidecar_bench.run(bundles=32 if args.quick else 128, lookups=lookups)
        console.print(measurements_table("sidecar on a 3-broker dev cluster", result))
    if "rest" in suites:
        pairs = 2 if args.quick else 8
        with console.status(f"rest: a dev cluster, {pairs} pairs of HTTP and gRPC passes..."):
            rest = rest_bench.run(pairs=pairs)
        console.print(rest_bench.table(rest))
        figures += rest_bench.figures(rest)
    if "lookup" in suites:
        pairs = 4 if args.quick else 16
        with console.status(f"lookup: {pairs} pairs of passes, lbd and a trivial server..."):
            medians = lookup_bench.run(pairs=pairs)
        console.print(lookup_bench.table(medians))
        figures += lookup_bench.figures(medians)
    if "assign" in suites:
        # A third of what is left after the one-at-a-time ones goes each bulk way: about 1,900
        # here, enough for LookupMany's calls of 256 not to end on one call alone.
        bundles = 1_000 if args.quick else 6_000
        with console.status(f"assign: {bundles:,} new bundles, one at a time then in bulk..."):
            result = assign_bench.run(bundles=bundles)
        console.print(measurements_table("new-bundle assignment on a dev cluster", result))
        figures += assign_bench.figures(result)
    if "recovery" in suites:
        orphans = 1_000 if args.quick else 10_000
        with console.status(f"recovery: a broker with {orphans:,} bundles killed..."):
            result = recovery_bench.run(bundles=orphans)
        console.print(measurements_table("orphans owned again after kill -9", result))
        figures += recovery_bench.figures(result)
    if "failover" in suites:
        sizes = (10, 1_000) if args.quick else failover_bench.SIZES
        with console.status(f"failover: kill -9 with {', '.join(f'{n:,}' for n in sizes)} bundles"):
            results = failover_bench.run(sizes)
        console.print(failover_bench.table(results))
        figures += failover_bench.figures(results)
    if "etcd_lease" in suites:
        with console.status("etcd_lease: keepalives and expiries, idle and under writes..."):
            result = etcd_lease_bench.run(samples=50 if args.quick else 200)
        console.print(measurements_table("etcd lease: keepalive and expiry", result))
    if "split" in suites:
        children = 200 if args.quick else split_bench.CHILDREN
        with console.status(f"split: one bundle into {children:,} children..."):
            result = split_bench.run(children=children)
        console.print(measurements_table("a split on a dev cluster", result))
        figures += split_bench.figures(result)
    if "scale" in suites:
        sizes = (1_000, 10_000) if args.quick else (1_000, 10_000, 100_000)
        with console.status(
            f"scale: 100 brokers, {' / '.join(f'{n:,}' for n in sizes)} bundles..."
        ):
            result = scale_bench.run(sizes=sizes, idle_s=10 if args.quick else 20)
        console.print(
            measurements_table("100 brokers: lookups, memory, idle CPU, catch-up", result)
        )
        figures += scale_bench.figures(result)
    if "operating" in suites:
        transfers, drained = (50, 50) if args.quick else (60, 200)
        with console.status(f"operating: {transfers} transfers, a drain of {drained} bundles..."):
            result = operating_bench.run(transfers=transfers, drain=drained)
        console.print(measurements_table("operating a 3-broker dev cluster", result))
    if "outages" in suites:
        etcd_s, pulsar_s = (10.0, 10.0) if args.quick else (60.0, 20.0)
        with console.status(f"outages: etcd {etcd_s:g} s (twice), pulsar-lite {pulsar_s:g} s..."):
            reports = outage_bench.run(etcd_outage_s=etcd_s, pulsar_outage_s=pulsar_s)
        console.print(outage_bench.reports_table(reports))
    if "sim" in suites:
        seeds = 20 if args.quick else 200
        with console.status(f"simulation: {seeds} seeds of 10 virtual minutes..."):
            result = sim_bench.run(seeds=seeds)
        console.print(measurements_table("deterministic simulation (lbd sim check)", result))
        with console.status("simulation: searching for each planted bug..."):
            found = sim_bench.mutations(limit=20 if args.quick else 200)
        console.print(measurements_table("planted bugs: first seed that finds each", found))
    if "security" in suites:
        lookups = 1_000 if args.quick else 4_000
        with console.status(f"security: {lookups:,} lookups through a plain and a secure cluster"):
            console.print(security_bench.table(security_bench.run(lookups=lookups)))
    if "clients" in suites:
        with console.status("clients: real clients through a dev cluster, event by event..."):
            clients = clients_bench.run(
                events=clients_bench.QUICK_EVENTS if args.quick else clients_bench.EVENTS,
                transfers=5 if args.quick else 50,
            )
        console.print(clients_bench.events_table(clients))
        if clients.overhead is not None:
            console.print(clients_bench.overhead_table(clients.overhead))
        figures += clients_bench.figures(clients)
    if "partitions" in suites:
        scale = 0.25 if args.quick else 1.0
        with console.status("partitions: links cut one scenario at a time under real clients..."):
            partitions = partitions_bench.run(scale=scale)
        console.print(partitions_bench.table(partitions))
        figures += partitions_bench.figures(partitions)
    if "balance-live" in suites:
        with console.status("balance-live: 5 brokers under real clients, then 5 more..."):
            live = balance_live_bench.run(quick=args.quick)
        console.print(balance_live_bench.samples_table(live))
        console.print(balance_live_bench.table(live))
        figures += balance_live_bench.figures(live)
    if figures:
        console.print(figures_table("figures against their baselines", figures))


if __name__ == "__main__":
    main()
