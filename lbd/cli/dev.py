"""``lbd dev``: a local cluster on loopback ports, for trying lbd out and for end-to-end tests.

``lbd dev up`` starts etcd, pulsar-lite (the state channel), a storage pulsar-lite (the brokers'
topics), N sidecars (``lbd serve``) and N broker fronts (``lbd broker``: Pulsar clients produce
and consume through them) in the background and returns once every broker is registered; ``lbd
dev down`` stops them all. Everything (records, data, logs) lives in the state directory.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from lbd.core.errors import InvalidInputError
from lbd.devcluster.cluster import (
    DEFAULT_NAMESPACE,
    DevCluster,
    DevClusterSpec,
    add_brokers,
    down,
    load_cluster,
    up,
)
from lbd.devcluster.links import Mode, link_status, set_links


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lbd dev up``, ``lbd dev add``, ``lbd dev down``, ``lbd dev addr`` and ``lbd dev
    env``."""
    group = sub.add_parser("dev", help="a local cluster for trying lbd out", description=__doc__)
    verbs = group.add_subparsers(dest="dev_command", metavar="VERB", required=True)

    p = verbs.add_parser("up", help="start a local cluster in the background")
    p.add_argument("--brokers", type=int, default=3, metavar="N", help="sidecars and brokers")
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.add_argument(
        "--traffic",
        action="store_true",
        help="real clients produce and consume on 32 topics of public/demo (16 bundles, all "
        "assigned); with --sim-brokers, the brokers make up synthetic load instead",
    )
    p.add_argument(
        "--sim-brokers",
        action="store_true",
        help="simulated brokers (synthetic load, no clients) instead of broker fronts: for "
        "benchmarks of thousands of bundles",
    )
    p.add_argument(
        "--secure",
        action="store_true",
        help="a throwaway CA; TLS and auth for etcd, mutual TLS and roles for the sidecars' API",
    )
    p.add_argument(
        "--links",
        action="store_true",
        help="every link between the processes behind a proxy that `lbd dev link` can cut, "
        "slow or make flaky (network partitions)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="settings",
        metavar="SECTION.KEY=VALUE",
        help="a sidecar setting on top of the dev cluster's settings (repeatable)",
    )
    p.set_defaults(func=run_up)

    p = verbs.add_parser(
        "link",
        help="cut, slow, stall or restore links of a cluster started with --links",
        description="Without a mode, print every link. A cut link passes nothing either way "
        "and closes nothing, as a network partition; a slow one delays every chunk; a flaky "
        "one passes for a period, then stalls for as long, in turn.",
    )
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.add_argument("names", nargs="*", metavar="LINK", help="e.g. broker-1/etcd (see the list)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--cut", action="store_true", help="pass nothing either way")
    mode.add_argument("--restore", action="store_true", help="pass everything again")
    mode.add_argument("--slow", type=float, metavar="SECONDS", help="delay every chunk")
    mode.add_argument("--flaky", type=float, metavar="SECONDS", help="pass, then stall, in turn")
    p.set_defaults(func=run_link)

    p = verbs.add_parser(
        "add",
        help="add brokers (a sidecar and a broker front each) to the running local cluster",
        description="The new brokers join empty, as when a cluster scales out: the leader's "
        "shedding moves bundles to them. Not for a --secure or --links cluster.",
    )
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.add_argument("--brokers", type=int, default=1, metavar="N", help="how many (default 1)")
    p.set_defaults(func=run_add)

    p = verbs.add_parser("down", help="stop the local cluster (idempotent)")
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.set_defaults(func=run_down)

    p = verbs.add_parser("addr", help="print a sidecar's gRPC address (for scripts)")
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.add_argument("--broker", metavar="ID", help="whose sidecar (default: the first)")
    p.set_defaults(func=run_addr)

    p = verbs.add_parser(
        "web", help="print a broker's web service URL: Pulsar's REST API (for curl, scripts)"
    )
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.add_argument("--broker", metavar="ID", help="whose broker (default: the first)")
    p.set_defaults(func=run_web)

    p = verbs.add_parser(
        "url", help="print the Pulsar service URL of the brokers (for clients, scripts)"
    )
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.set_defaults(func=run_url)

    p = verbs.add_parser(
        "env", help="print the shell exports that give `lbd ctl` the admin's credentials"
    )
    p.add_argument("--state-dir", type=Path, required=True, metavar="DIR")
    p.set_defaults(func=run_env)


def run_up(args: argparse.Namespace) -> int:
    """Start the cluster and print how to use it."""
    spec = DevClusterSpec(
        brokers=args.brokers,
        traffic=args.traffic,
        secure=args.secure,
        sim_brokers=args.sim_brokers,
        links=args.links,
    ).with_overrides(args.settings)
    print(f"starting {spec.brokers} sidecars and brokers in {args.state_dir} ...", flush=True)
    cluster = up(args.state_dir, spec)
    print(usage(cluster, args.state_dir))
    return 0


def run_add(args: argparse.Namespace) -> int:
    """Add brokers to the running cluster and print them."""
    cluster = add_brokers(args.state_dir, args.brokers)
    for node in cluster.nodes[-args.brokers :]:
        print(f"{node.broker_id}: sidecar {node.grpc_addr}  broker {node.service_url or '-'}")
    return 0


def run_link(args: argparse.Namespace) -> int:
    """Set the named links' mode, or print every link."""
    cluster = load_cluster(args.state_dir)
    if not cluster.links_control:
        raise InvalidInputError(
            f"the dev cluster in {args.state_dir} has no links to cut: start it with "
            "`lbd dev up --links`"
        )
    chosen = args.cut or args.restore or args.slow is not None or args.flaky is not None
    if chosen and not args.names:
        raise InvalidInputError("name the links to change (e.g. broker-1/etcd)")
    if args.names and not chosen:
        raise InvalidInputError("choose --cut, --restore, --slow SECONDS or --flaky SECONDS")
    if chosen:
        mode: Mode = (
            "cut" if args.cut else "up" if args.restore else "slow" if args.slow else "flaky"
        )
        status = set_links(
            cluster.links_control,
            args.names,
            mode,
            delay_s=args.slow or 0.0,
            period_s=args.flaky or 1.0,
        )
    else:
        status = link_status(cluster.links_control)
    for name, link in status.items():
        extra = {"slow": f" {link.get('delay_s')} s", "flaky": f" {link.get('period_s')} s"}
        mode_text = f"{link['mode']}{extra.get(str(link['mode']), '')}"
        print(
            f"{name:<20} {mode_text:<12} -> {link['target']:<21} "
            f"{link['connections']} connections, {link['bytes']} bytes"
        )
    return 0


def run_down(args: argparse.Namespace) -> int:
    """Stop the cluster."""
    if down(args.state_dir):
        print(f"dev cluster in {args.state_dir} stopped")
    else:
        print(f"no dev cluster running in {args.state_dir}")
    return 0


def run_addr(args: argparse.Namespace) -> int:
    """Print the gRPC address of a sidecar."""
    print(load_cluster(args.state_dir).node(args.broker).grpc_addr)
    return 0


def run_web(args: argparse.Namespace) -> int:
    """Print the web service URL of a broker front."""
    node = load_cluster(args.state_dir).node(args.broker)
    if not node.web_url:
        raise InvalidInputError(
            f"the dev cluster in {args.state_dir} runs simulated brokers: they serve no REST API"
        )
    print(node.web_url)
    return 0


def run_url(args: argparse.Namespace) -> int:
    """Print the service URL naming every broker front."""
    cluster = load_cluster(args.state_dir)
    if not cluster.service_url:
        raise InvalidInputError(
            f"the dev cluster in {args.state_dir} runs simulated brokers: no client can connect"
        )
    print(cluster.service_url)
    return 0


def run_env(args: argparse.Namespace) -> int:
    """Print ``export LBD_CTL_...=...`` lines for the cluster's admin credentials."""
    for line in env_lines(load_cluster(args.state_dir)):
        print(line)
    return 0


_ENV_OF = {
    "ca_file": "LBD_CTL_TLS_CA",
    "cert_file": "LBD_CTL_TLS_CERT",
    "key_file": "LBD_CTL_TLS_KEY",
    "token": "LBD_CTL_TOKEN",
}


def env_lines(cluster: DevCluster) -> list[str]:
    """The shell exports of the cluster's admin credentials (none for an open cluster)."""
    return [
        f"export {_ENV_OF[key]}={shlex.quote(value)}"
        for key, value in cluster.client.items()
        if key in _ENV_OF
    ]


def usage(cluster: DevCluster, state_dir: Path) -> str:
    """What to tell the operator once the cluster is up."""
    first = cluster.nodes[0].grpc_addr
    lines = [
        f"dev cluster {cluster.cluster!r} is up ({len(cluster.nodes)} brokers; records, data and "
        f"logs in {state_dir})",
        f"  etcd         {cluster.etcd_endpoint}",
        f"  pulsar-lite  {cluster.pulsar_url}  (state channel, load topics)",
    ]
    if cluster.storage_url:
        lines.append(f"  storage      {cluster.storage_url}  (the brokers' topics)")
    for n in cluster.nodes:
        broker = f"  broker {n.service_url}" if n.service_url else ""
        if n.web_url:
            broker += f"  REST {n.web_url}"
        lines.append(
            f"  {n.broker_id:<12} sidecar {n.grpc_addr}  metrics http://{n.metrics_addr}/metrics"
            + broker
        )
    if cluster.load is not None:
        lines.append(f"  clients      lbd load (log: {cluster.load.log})")
    topic = f"persistent://{DEFAULT_NAMESPACE}/my-topic"
    c = cluster.client
    grpcurl = "grpcurl -plaintext"
    if "ca_file" in c:
        grpcurl = f"grpcurl -cacert {c['ca_file']} -cert {c['cert_file']} -key {c['key_file']}"
    if "token" in c:
        grpcurl += " -H 'authorization: Bearer '\"$LBD_CTL_TOKEN\""
    lines += ["", "Try:"]
    if c:
        lines.append(f'  eval "$(lbd dev env --state-dir {state_dir})"   # lbd ctl as the admin')
    lines += [
        f"  lbd ctl --server {first} watch",
        f"  lbd ctl --server {first} lookup {topic}",
        f"  lbd ctl --server {first} bundles",
        f'  {grpcurl} -d \'{{"topic": "{topic}"}}\' {first} lbd.v1.LoadBalancer/Lookup',
        f"  {grpcurl} {first} lbd.v1.Admin/ListBrokers",
    ]
    if cluster.service_url:
        lines += ["", "A Pulsar client (pip install pulsar-client):", _client_snippet(cluster)]
    lines += ["", f"Stop it with: lbd dev down --state-dir {state_dir}"]
    return "\n".join(lines)


def _client_snippet(cluster: DevCluster) -> str:
    """A client session to paste into a shell."""
    tls = ""
    c = cluster.pulsar_client
    if c:
        tls = (
            f", tls_trust_certs_file_path='{c['ca_file']}', authentication="
            f"pulsar.AuthenticationTLS('{c['cert_file']}', '{c['key_file']}')"
        )
    return (
        '  python -c "import pulsar; '
        f"c = pulsar.Client('{cluster.service_url}'{tls}); "
        "p = c.create_producer('my-topic'); p.send(b'hello'); "
        "s = c.subscribe('my-topic', 'my-sub', initial_position=pulsar.InitialPosition.Earliest); "
        'm = s.receive(); print(m.data()); s.acknowledge(m); c.close()"'
    )
