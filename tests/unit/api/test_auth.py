"""Identities and roles on a real gRPC server: every role against every RPC, by token and by
client certificate; mutual TLS refusing expired, foreign and missing certificates; certificate
reload; the broker-identity binding of BrokerSession; the audit log."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lbd.api import tokens
from lbd.api.auth import ANONYMOUS_CALLER, AuthConfig, Role
from lbd.api.tls import ReloadingServerTls, ServerTlsFiles
from lbd.broker.credentials import ClientCredentials
from lbd.devcluster.pki import DevPki
from lbd.gen.v1 import lbd_pb2, lbd_pb2_grpc
from tests.unit.api.served import serve_api, until
from tests.unit.services.harness import Harness

TOPIC = "persistent://public/default/t"
SESSION_WAIT_S = 2.0
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

Caller = Callable[[lbd_pb2_grpc.LoadBalancerStub, lbd_pb2_grpc.AdminStub], Awaitable[None]]


async def _session(lb: lbd_pb2_grpc.LoadBalancerStub, broker_id: str) -> None:
    """Open a BrokerSession as ``broker_id``; raises the refusal, returns if none comes."""
    hello = lbd_pb2.BrokerMessage(
        hello=lbd_pb2.BrokerInfo(broker_id=broker_id, service_url=f"pulsar://{broker_id}:6650")
    )
    done = asyncio.Event()

    async def messages() -> AsyncIterator[lbd_pb2.BrokerMessage]:
        yield hello
        await done.wait()

    call = lb.BrokerSession(messages())
    try:
        async with asyncio.timeout(SESSION_WAIT_S):
            async for _ in call:
                return  # the sidecar spoke: the session is accepted
    except TimeoutError:
        return  # accepted and quiet
    finally:
        done.set()
        call.cancel()


RPCS: dict[str, Caller] = {
    "Lookup": lambda lb, a: lb.Lookup(lbd_pb2.LookupRequest(topic=TOPIC, read_only=True)),
    "LookupMany": lambda lb, a: lb.LookupMany(
        lbd_pb2.LookupManyRequest(lookups=[lbd_pb2.LookupRequest(topic=TOPIC, read_only=True)])
    ),
    "WatchOwnership": lambda lb, a: _first(lb.WatchOwnership(lbd_pb2.WatchOwnershipRequest())),
    "BrokerSession(own id)": lambda lb, a: _session(lb, "broker-a"),
    "Assign": lambda lb, a: a.Assign(lbd_pb2.AssignRequest(topic=TOPIC)),
    "Transfer": lambda lb, a: a.Transfer(lbd_pb2.TransferRequest()),
    "Unload": lambda lb, a: a.Unload(lbd_pb2.UnloadRequest()),
    "Split": lambda lb, a: a.Split(lbd_pb2.SplitRequest()),
    "ListBrokers": lambda lb, a: a.ListBrokers(lbd_pb2.ListBrokersRequest()),
    "GetLeader": lambda lb, a: a.GetLeader(lbd_pb2.GetLeaderRequest()),
    "ListBundles": lambda lb, a: a.ListBundles(lbd_pb2.ListBundlesRequest()),
    "GetNamespace": lambda lb, a: a.GetNamespace(lbd_pb2.GetNamespaceRequest()),
    "CreateNamespace": lambda lb, a: a.CreateNamespace(lbd_pb2.CreateNamespaceRequest()),
    "SetNamespacePolicies": lambda lb, a: a.SetNamespacePolicies(
        lbd_pb2.SetNamespacePoliciesRequest()
    ),
    "GetLoad": lambda lb, a: a.GetLoad(lbd_pb2.GetLoadRequest()),
    "Rebalance": lambda lb, a: a.Rebalance(lbd_pb2.RebalanceRequest(dry_run=True)),
    "Snapshot": lambda lb, a: a.Snapshot(lbd_pb2.SnapshotRequest()),
    "ListDecisions": lambda lb, a: a.ListDecisions(lbd_pb2.ListDecisionsRequest()),
    "Audit": lambda lb, a: a.Audit(lbd_pb2.AuditRequest()),
    "Cordon": lambda lb, a: a.Cordon(lbd_pb2.CordonRequest()),
    "Uncordon": lambda lb, a: a.Uncordon(lbd_pb2.UncordonRequest()),
    "Drain": lambda lb, a: a.Drain(lbd_pb2.DrainRequest()),
    "Decommission": lambda lb, a: a.Decommission(lbd_pb2.DecommissionRequest()),
    "Execute": lambda lb, a: a.Execute(lbd_pb2.ExecuteRequest()),
    "ListOperations": lambda lb, a: a.ListOperations(lbd_pb2.ListOperationsRequest()),
    "GetOperation": lambda lb, a: a.GetOperation(lbd_pb2.GetOperationRequest()),
    "WatchOperation": lambda lb, a: _first(a.WatchOperation(lbd_pb2.WatchOperationRequest())),
    "CancelOperation": lambda lb, a: a.CancelOperation(lbd_pb2.CancelOperationRequest()),
}


async def _first(call: object) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        break
    call.cancel()  # type: ignore[attr-defined]


READS = {
    "Lookup",
    "LookupMany",
    "WatchOwnership",
    "ListBrokers",
    "GetLeader",
    "ListBundles",
    "GetNamespace",
    "GetLoad",
    "ListDecisions",
    "Audit",
    "ListOperations",
    "GetOperation",
    "WatchOperation",
}
UN, PD, OK = "UNAUTHENTICATED", "PERMISSION_DENIED", "allowed"


def expected(caller: str, rpc: str) -> str:
    """The specification the table is checked against (docs/security.md)."""
    if caller in ("anonymous", "bad credential"):
        return UN
    if caller == "admin":
        return OK
    if rpc in READS:
        return OK
    if rpc == "BrokerSession(own id)" and caller == "broker broker-a":
        return OK
    return PD


async def outcome(
    lb: lbd_pb2_grpc.LoadBalancerStub, admin: lbd_pb2_grpc.AdminStub, rpc: str
) -> str:
    try:
        await asyncio.wait_for(RPCS[rpc](lb, admin), 10)
    except grpc.aio.AioRpcError as e:
        return e.code().name if e.code() in REFUSED else OK
    return OK


async def role_table(channels: dict[str, grpc.aio.Channel]) -> dict[str, dict[str, str]]:
    table: dict[str, dict[str, str]] = {}
    for caller, channel in channels.items():
        lb, admin = lbd_pb2_grpc.LoadBalancerStub(channel), lbd_pb2_grpc.AdminStub(channel)
        table[caller] = {rpc: await outcome(lb, admin, rpc) for rpc in RPCS}
    return table


def mismatches(table: dict[str, dict[str, str]]) -> list[str]:
    return [
        f"{caller} x {rpc}: got {got}, want {expected(caller, rpc)}"
        for caller, row in table.items()
        for rpc, got in row.items()
        if got != expected(caller, rpc)
    ]


CALLERS = ("anonymous", "bad credential", "reader", "broker broker-b", "broker broker-a", "admin")


@dataclass
class Pki:
    dir: Path
    pki: DevPki
    server: ServerTlsFiles

    def client(self, stem: str, name: str, role: str | None) -> ClientCredentials:
        files = self.pki.issue(stem, name, role=role)
        return ClientCredentials(ca_file=self.pki.ca_file, cert_file=files.cert, key_file=files.key)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = DevPki(tmp_path / "ca")
    server = ca.issue("sidecar", "broker-a", role="admin", server=True)
    return Pki(tmp_path, ca, ServerTlsFiles(server.cert, server.key, ca.ca_file))


CERT_ROLES = {r.label: r for r in Role}


async def test_every_role_against_every_rpc_by_token(harness: Harness, tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(
        "# role name token\n"
        "reader ops-reader tok-reader\n"
        "broker broker-a tok-broker-a\n"
        "broker broker-b tok-broker-b\n"
        "admin ops tok-admin\n"
    )
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, auth=AuthConfig(tokens_file=tokens_file)) as api:
        await until(lambda: api.elector.is_leader)
        channel = api.channel
        by_token = {
            "anonymous": None,
            "bad credential": "nope",
            "reader": "tok-reader",
            "broker broker-b": "tok-broker-b",
            "broker broker-a": "tok-broker-a",
            "admin": "tok-admin",
        }
        table = {}
        for caller, token in by_token.items():
            md = () if token is None else (("authorization", f"Bearer {token}"),)
            table[caller] = await _table_row(channel, md)
    assert mismatches(table) == []


async def _table_row(channel: grpc.aio.Channel, md: tuple[tuple[str, str], ...]) -> dict[str, str]:
    lb = _WithMetadata(lbd_pb2_grpc.LoadBalancerStub(channel), md)
    admin = _WithMetadata(lbd_pb2_grpc.AdminStub(channel), md)
    return {rpc: await outcome(lb, admin, rpc) for rpc in RPCS}  # type: ignore[arg-type]


class _WithMetadata:
    """A stub whose every call carries ``metadata``."""

    def __init__(self, stub: object, metadata: tuple[tuple[str, str], ...]) -> None:
        self._stub = stub
        self._metadata = metadata

    def __getattr__(self, name: str) -> Callable[..., object]:
        method = getattr(self._stub, name)
        return lambda request: method(request, metadata=self._metadata)


async def test_every_role_against_every_rpc_by_certificate(harness: Harness, pki: Pki) -> None:
    sidecar = await harness.add("broker-a")
    await harness.ready()
    auth = AuthConfig(cert_roles=CERT_ROLES)
    admin = pki.client("admin", "ops", "admin")
    async with serve_api(
        harness, sidecar, auth=auth, tls=ReloadingServerTls(pki.server), credentials=admin
    ) as api:
        await until(lambda: api.elector.is_leader)
        creds = {
            "bad credential": pki.client("stranger", "someone", "operators"),
            "reader": pki.client("reader", "ops-reader", "reader"),
            "broker broker-b": pki.client("broker-b", "broker-b", "broker"),
            "broker broker-a": pki.client("broker-a", "broker-a", "broker"),
            "admin": admin,
        }
        channels = {caller: c.aio_channel(api.addr) for caller, c in creds.items()}
        try:
            table = await role_table(channels)
        finally:
            for channel in channels.values():
                await channel.close()
    # A certificate naming no known role is a credential that grants nothing: refused as such.
    assert table["bad credential"] == dict.fromkeys(RPCS, PD)
    del table["bad credential"]
    assert mismatches(table) == []


async def test_a_call_for_an_anonymous_caller_carries_no_right_of_the_connection_s_certificate(
    harness: Harness, pki: Pki
) -> None:
    """A broker's REST API calls the sidecar on its own certificate for callers who presented
    nothing: marked so, the call has an anonymous caller's rights, not the certificate's."""
    sidecar = await harness.add("broker-a")
    await harness.ready()
    tokens_file = pki.dir / "tokens"
    tokens_file.write_text("reader ops-reader tok-reader\n")
    auth = AuthConfig(cert_roles=CERT_ROLES, tokens_file=tokens_file)
    admin = pki.client("admin", "ops", "admin")
    async with serve_api(
        harness, sidecar, auth=auth, tls=ReloadingServerTls(pki.server), credentials=admin
    ) as api:
        await until(lambda: api.elector.is_leader)
        anonymous = ((ANONYMOUS_CALLER, "true"),)
        request = lbd_pb2.ListBrokersRequest()
        await api.admin.ListBrokers(request)  # the certificate's own right
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.admin.ListBrokers(request, metadata=anonymous)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "reader role" in (refused.value.details() or "")
        reader = (*anonymous, ("authorization", "Bearer tok-reader"))
        await api.admin.ListBrokers(request, metadata=reader)  # a token still counts
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await api.admin.Unload(lbd_pb2.UnloadRequest(), metadata=reader)
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED


async def test_signed_tokens_name_their_holder_and_expire(harness: Harness, tmp_path: Path) -> None:
    key = b"k" * 32
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, auth=AuthConfig(token_key_file=key_file)) as api:
        await until(lambda: api.elector.is_leader)
        reader = tokens.sign(key, "dash", "reader")
        md = (("authorization", f"Bearer {reader}"),)
        leader = await api.admin.GetLeader(lbd_pb2.GetLeaderRequest(), metadata=md)
        assert leader.broker_id == "broker-a"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.admin.Unload(lbd_pb2.UnloadRequest(bundle="x"), metadata=md)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.details() == (
            "dash (role reader, by signed token) may not call lbd.v1.Admin/Unload: "
            "it needs the admin role"
        )
        expired = tokens.sign(key, "dash", "admin", expires_at=1.0)
        forged = tokens.sign(b"x" * 32, "dash", "admin")
        for bad, why in ((expired, "expired"), (forged, "signature")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await api.admin.GetLeader(
                    lbd_pb2.GetLeaderRequest(), metadata=(("authorization", f"Bearer {bad}"),)
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert why in (refused.value.details() or "")


async def test_a_broker_cannot_hijack_another_brokers_session(harness: Harness, pki: Pki) -> None:
    sidecar = await harness.add("broker-a")
    await harness.ready()
    auth = AuthConfig(cert_roles=CERT_ROLES)
    outsider = pki.client("outsider", "broker-9", "broker")
    async with serve_api(
        harness, sidecar, auth=auth, tls=ReloadingServerTls(pki.server), credentials=outsider
    ) as api:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _session(api.lb, "broker-a")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details() == (
        "broker-9 (role broker, by certificate) may open a BrokerSession only for broker "
        "broker-9, not for 'broker-a'"
    )


async def _tls_refuses(creds: ClientCredentials, addr: str) -> grpc.StatusCode:
    channel = creds.aio_channel(addr)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await lbd_pb2_grpc.AdminStub(channel).GetLeader(lbd_pb2.GetLeaderRequest(), timeout=5)
        return refused.value.code()
    finally:
        await channel.close()


async def test_mutual_tls_refuses_expired_foreign_and_missing_certificates(
    harness: Harness, pki: Pki, tmp_path: Path
) -> None:
    sidecar = await harness.add("broker-a")
    await harness.ready()
    admin = pki.client("admin", "ops", "admin")
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=10)
    expired_files = pki.pki.issue(
        "expired", "ops", role="admin", not_before=past, not_after=past + datetime.timedelta(days=1)
    )
    expired = ClientCredentials(
        ca_file=pki.pki.ca_file, cert_file=expired_files.cert, key_file=expired_files.key
    )
    other_ca = DevPki(tmp_path / "other-ca")
    foreign_files = other_ca.issue("foreign", "ops", role="admin")
    foreign = ClientCredentials(
        ca_file=pki.pki.ca_file, cert_file=foreign_files.cert, key_file=foreign_files.key
    )
    no_cert = ClientCredentials(ca_file=pki.pki.ca_file)
    plaintext = ClientCredentials()
    async with serve_api(
        harness,
        sidecar,
        auth=AuthConfig(cert_roles=CERT_ROLES),
        tls=ReloadingServerTls(pki.server),
        credentials=admin,
    ) as api:
        await until(lambda: api.elector.is_leader)
        ok = await api.admin.GetLeader(lbd_pb2.GetLeaderRequest(), timeout=5)
        assert ok.broker_id == "broker-a"
        for creds in (expired, foreign, no_cert, plaintext):
            # The handshake fails: the call never reaches the server's handlers.
            assert await _tls_refuses(creds, api.addr) == grpc.StatusCode.UNAVAILABLE


async def test_a_renewed_server_certificate_is_served_without_a_restart(
    harness: Harness, pki: Pki, tmp_path: Path
) -> None:
    sidecar = await harness.add("broker-a")
    await harness.ready()
    new_ca = DevPki(tmp_path / "new-ca")
    renewed = new_ca.issue("sidecar", "broker-a", role="admin", server=True)
    tls = ReloadingServerTls(
        ServerTlsFiles(pki.server.cert_file, pki.server.key_file), check_interval_s=0
    )
    old_trust = ClientCredentials(ca_file=pki.pki.ca_file)
    new_trust = ClientCredentials(ca_file=new_ca.ca_file)
    async with serve_api(harness, sidecar, tls=tls, credentials=old_trust) as api:
        assert (await api.admin.GetLeader(lbd_pb2.GetLeaderRequest(), timeout=5)) is not None
        assert await _tls_refuses(new_trust, api.addr) == grpc.StatusCode.UNAVAILABLE
        # Replace the files the way a certificate manager does: write aside, rename over.
        for source, target in (
            (renewed.cert, pki.server.cert_file),
            (renewed.key, pki.server.key_file),
        ):
            aside = target.with_suffix(".new")
            shutil.copyfile(source, aside)
            aside.replace(target)
        channel = new_trust.aio_channel(api.addr)
        try:
            reply = await lbd_pb2_grpc.AdminStub(channel).GetLeader(
                lbd_pb2.GetLeaderRequest(), timeout=5
            )
        finally:
            await channel.close()
        assert reply is not None
        assert tls.reloads == 1
        assert await _tls_refuses(old_trust, api.addr) == grpc.StatusCode.UNAVAILABLE


async def test_admin_actions_leave_one_audit_line_each(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("admin alice tok-a\nreader bob tok-b\n")
    sidecar = await harness.add("broker-a")
    await harness.ready()
    async with serve_api(harness, sidecar, auth=AuthConfig(tokens_file=tokens_file)) as api:
        await until(lambda: api.elector.is_leader)
        with caplog.at_level(logging.INFO, logger="lbd.audit"):
            alice = (("authorization", "Bearer tok-a"),)
            bob = (("authorization", "Bearer tok-b"),)
            await api.admin.CreateNamespace(
                lbd_pb2.CreateNamespaceRequest(namespace="t/ns", bundles=4), metadata=alice
            )
            with pytest.raises(grpc.aio.AioRpcError):
                await api.admin.Unload(lbd_pb2.UnloadRequest(bundle="nonsense"), metadata=alice)
            with pytest.raises(grpc.aio.AioRpcError):
                await api.admin.Unload(lbd_pb2.UnloadRequest(bundle="t/ns/x"), metadata=bob)
            await api.admin.ListBrokers(lbd_pb2.ListBrokersRequest(), metadata=alice)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "lbd.audit"]
    assert [(line["who"], line["what"], line["outcome"]) for line in lines] == [
        ("alice", "lbd.v1.Admin/CreateNamespace", "OK"),
        ("alice", "lbd.v1.Admin/Unload", "INVALID_ARGUMENT"),
        ("bob", "lbd.v1.Admin/Unload", "PERMISSION_DENIED"),
    ]
    assert 'namespace: "t/ns"' in lines[0]["request"]
    assert lines[2]["role"] == "reader" and "needs the admin role" in lines[2]["details"]


def test_tokens_file_errors_name_the_line(tmp_path: Path) -> None:
    from lbd.api.auth import parse_tokens_file
    from lbd.core.errors import InvalidInputError

    bad = tmp_path / "tokens"
    bad.write_text("admin ops t1\nroot x t2\n")
    with pytest.raises(InvalidInputError, match=r"line 2: unknown role 'root'"):
        parse_tokens_file(bad)
    bad.write_text("admin ops\n")
    with pytest.raises(InvalidInputError, match=r"line 1: expected '<role> <name> <token>'"):
        parse_tokens_file(bad)
