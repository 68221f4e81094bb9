"""The etcd adapters against an etcd requiring TLS, client certificates and a password.

One secure etcd serves the module (as ``[etcd]`` settings would point lbd at it); tests that restart
it or wait for tokens to expire take one of their own. Each way a client can be misconfigured
(plaintext, no client certificate, a foreign CA, a wrong password, no credentials) must end in an
lbd error that says what to check, not in a raw gRPC status.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from lbd.adapters.etcd import EtcdConnection, EtcdOptions, EtcdSecurity
from lbd.adapters.etcd_session import EtcdLeaseBackend
from lbd.adapters.etcd_store import EtcdMetadataStore
from lbd.adapters.session import SessionPolicy
from lbd.config import load_settings
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId
from lbd.devcluster import EtcdServer
from lbd.devcluster.pki import CertFiles, DevPki
from lbd.ports.errors import UnavailableError
from lbd.ports.metadata import MetadataStore
from tests.contract.metadata_suite import MetadataHarness, MetadataStoreContract

pytestmark = [pytest.mark.servers, pytest.mark.timeout(60)]

T = TypeVar("T")

PASSWORD = "lbd-test-root-secret"
POLICY = SessionPolicy(lease_ttl_s=2, keepalive_interval_s=0.3)
REQUEST_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return DevPki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def client_cert(pki: DevPki) -> CertFiles:
    return pki.issue("etcd-client", "lbd", role="admin")


def secure_server(pki: DevPki, **kwargs: int) -> EtcdServer:
    """An etcd speaking TLS only, requiring client certificates of ``pki`` and a password."""
    cert = pki.issue(f"etcd-{uuid.uuid4().hex[:8]}", "etcd", server=True)
    return EtcdServer(tls=cert, client_ca_file=pki.ca_file, root_password=PASSWORD, **kwargs)


@pytest.fixture(scope="module")
def secure_etcd(pki: DevPki) -> Iterator[EtcdServer]:
    with secure_server(pki) as server:
        yield server


@pytest.fixture
def private_secure_etcd(pki: DevPki) -> Iterator[EtcdServer]:
    """A secure etcd of this test's own whose tokens expire after one second unused."""
    with secure_server(pki, auth_token_ttl_s=1) as server:
        yield server


def good_security(pki: DevPki, cert: CertFiles) -> EtcdSecurity:
    return EtcdSecurity(
        ca_file=str(pki.ca_file),
        cert_file=str(cert.cert),
        key_file=str(cert.key),
        username="root",
        password=PASSWORD,
    )


@pytest.fixture
def prefix() -> str:
    return f"/lbd-test/{uuid.uuid4().hex}"


@pytest.fixture
async def connections() -> AsyncIterator[list[EtcdConnection]]:
    """Connections a test makes; all closed after it."""
    made: list[EtcdConnection] = []
    yield made
    for conn in made:
        await conn.close()


def connect(
    made: list[EtcdConnection], url: str, security: EtcdSecurity, timeout_s: float = 2.0
) -> EtcdConnection:
    conn = EtcdConnection([url], timeout_s, security=security)
    made.append(conn)
    return conn


# -- what works --------------------------------------------------------------------------------


async def test_settings_reach_a_secure_etcd_through_the_adapter(
    secure_etcd: EtcdServer,
    pki: DevPki,
    client_cert: CertFiles,
    prefix: str,
    connections: list[EtcdConnection],
) -> None:
    settings = load_settings(
        None,
        env={
            "LBD_ETCD_ENDPOINTS": secure_etcd.client_url,
            "LBD_ETCD__CA_FILE": str(pki.ca_file),
            "LBD_ETCD__CERT_FILE": str(client_cert.cert),
            "LBD_ETCD__KEY_FILE": str(client_cert.key),
            "LBD_ETCD__USERNAME": "root",
            "LBD_ETCD__PASSWORD": PASSWORD,
            "LBD_CLUSTER": "secure",
        },
    )
    options = EtcdOptions.from_settings(settings)
    assert options.security == good_security(pki, client_cert)
    conn = EtcdConnection.from_options(options)
    connections.append(conn)
    key = f"{prefix}/k".encode()

    revision = await conn.put(key, b"v1")
    got = await conn.get(key)
    assert got is not None and (got.value, got.mod_revision) == (b"v1", revision)
    written, after = await conn.swap(key, b"v2", expected_mod_revision=revision)
    assert written and after is not None and after.value == b"v2"
    listed, _ = await conn.list_prefix(prefix.encode())
    assert [kv.key for kv in listed] == [key]

    # The lease as the sidecar's session uses it: grant, a key under it, keepalive, revoke.
    leases = EtcdLeaseBackend(conn)
    lease_id = await leases.grant(5)
    await conn.put(f"{prefix}/leased".encode(), b"x", lease_id)
    assert await leases.refresh(lease_id) is True
    await leases.revoke(lease_id)
    assert await leases.refresh(lease_id) is False
    assert await conn.get(f"{prefix}/leased".encode()) is None
    await conn.delete_prefix(prefix.encode())


class SecureEtcdHarness(MetadataHarness):
    """Stores on the secure etcd, each with a connection of its own, as sidecars would have."""

    def __init__(self, server: EtcdServer, prefix: str, security: EtcdSecurity) -> None:
        self.options = EtcdOptions(
            endpoints=(server.client_url,),
            prefix=prefix,
            session=POLICY,
            request_timeout_s=REQUEST_TIMEOUT_S,
            security=security,
        )
        self.admin = EtcdConnection.from_options(self.options)
        self.stores: list[tuple[EtcdMetadataStore, EtcdConnection]] = []

    async def store(self, policy: SessionPolicy | None = None) -> EtcdMetadataStore:
        conn = EtcdConnection.from_options(self.options)
        options = self.options if policy is None else _with_policy(self.options, policy)
        store = EtcdMetadataStore(conn, options)
        self.stores.append((store, conn))
        await store.start()
        return store

    async def lose_lease(self, store: MetadataStore) -> None:
        assert isinstance(store, EtcdMetadataStore)
        await EtcdLeaseBackend(self.admin).revoke(store.lease_id)

    async def wait(self, awaitable: Awaitable[T], timeout_s: float) -> T:
        return await asyncio.wait_for(awaitable, timeout_s)

    async def close(self) -> None:
        for store, conn in self.stores:
            await store.close()
            await conn.close()
        await self.admin.delete_prefix(self.options.prefix.encode())
        await self.admin.close()


def _with_policy(options: EtcdOptions, policy: SessionPolicy) -> EtcdOptions:
    return EtcdOptions(
        endpoints=options.endpoints,
        prefix=options.prefix,
        session=policy,
        request_timeout_s=options.request_timeout_s,
        security=options.security,
    )


class TestSecureEtcdMetadataStore(MetadataStoreContract):
    """The whole metadata contract (registry, election, watches, CAS) over TLS with a password."""

    @pytest.fixture
    async def harness(
        self, secure_etcd: EtcdServer, pki: DevPki, client_cert: CertFiles, prefix: str
    ) -> AsyncIterator[MetadataHarness]:
        harness = SecureEtcdHarness(secure_etcd, prefix, good_security(pki, client_cert))
        yield harness
        await harness.close()


# -- what fails, and says why ------------------------------------------------------------------


async def test_a_plaintext_client_is_told_to_use_https(
    secure_etcd: EtcdServer, connections: list[EtcdConnection]
) -> None:
    url = secure_etcd.client_url.replace("https://", "http://")
    conn = connect(connections, url, EtcdSecurity(username="root", password=PASSWORD))
    with pytest.raises(UnavailableError) as info:
        await conn.get(b"/k")
    assert str(info.value) == (
        f"etcd at {url} unavailable (get /k): etcd closed the connection while it was being "
        "set up: if etcd serves TLS, use https:// endpoints (and etcd.ca_file)"
    )


async def test_a_client_without_a_certificate_is_told_to_check_it(
    secure_etcd: EtcdServer, pki: DevPki, connections: list[EtcdConnection]
) -> None:
    security = EtcdSecurity(ca_file=str(pki.ca_file), username="root", password=PASSWORD)
    conn = connect(connections, secure_etcd.client_url, security)
    with pytest.raises(UnavailableError, match="refusing the client certificate") as info:
        await conn.get(b"/k")
    assert "check etcd.cert_file and etcd.key_file" in str(info.value)
    assert "TSI_" not in str(info.value)


async def test_a_certificate_of_another_ca_is_refused_like_none(
    secure_etcd: EtcdServer, pki: DevPki, tmp_path: Path, connections: list[EtcdConnection]
) -> None:
    foreign = DevPki(tmp_path / "foreign").issue("etcd-client", "lbd", role="admin")
    security = EtcdSecurity(
        ca_file=str(pki.ca_file),
        cert_file=str(foreign.cert),
        key_file=str(foreign.key),
        username="root",
        password=PASSWORD,
    )
    conn = connect(connections, secure_etcd.client_url, security)
    with pytest.raises(UnavailableError, match="refusing the client certificate"):
        await conn.get(b"/k")


async def test_a_wrong_ca_is_named(
    secure_etcd: EtcdServer,
    client_cert: CertFiles,
    tmp_path: Path,
    connections: list[EtcdConnection],
) -> None:
    other_ca = DevPki(tmp_path / "other").ca_file
    security = EtcdSecurity(
        ca_file=str(other_ca),
        cert_file=str(client_cert.cert),
        key_file=str(client_cert.key),
        username="root",
        password=PASSWORD,
    )
    conn = connect(connections, secure_etcd.client_url, security)
    with pytest.raises(UnavailableError) as info:
        await conn.get(b"/k")
    message = str(info.value)
    assert message.startswith(f"etcd at {secure_etcd.client_url} unavailable (get /k): TLS ")
    assert message.endswith("etcd's certificate is not trusted (check etcd.ca_file)")


async def test_a_wrong_password_is_refused_as_bad_input(
    secure_etcd: EtcdServer,
    pki: DevPki,
    client_cert: CertFiles,
    connections: list[EtcdConnection],
) -> None:
    security = good_security(pki, client_cert)
    wrong = EtcdSecurity(
        ca_file=security.ca_file,
        cert_file=security.cert_file,
        key_file=security.key_file,
        username="root",
        password="not-the-password",
    )
    conn = connect(connections, secure_etcd.client_url, wrong)
    with pytest.raises(InvalidInputError) as info:
        await conn.get(b"/k")
    assert str(info.value) == (
        f"etcd at {secure_etcd.client_url} refused the credentials of user 'root': "
        "authentication failed, invalid user ID or password "
        "(check etcd.username/etcd.password)"
    )
    assert "not-the-password" not in repr(wrong)


async def test_no_credentials_are_told_that_etcd_wants_them(
    secure_etcd: EtcdServer,
    pki: DevPki,
    client_cert: CertFiles,
    connections: list[EtcdConnection],
) -> None:
    security = EtcdSecurity(
        ca_file=str(pki.ca_file), cert_file=str(client_cert.cert), key_file=str(client_cert.key)
    )
    conn = connect(connections, secure_etcd.client_url, security)
    with pytest.raises(InvalidInputError) as info:
        await conn.put(b"/k", b"v")
    assert str(info.value) == (
        f"etcd at {secure_etcd.client_url} refused put /k: permission denied "
        "(etcd has authentication on: set etcd.username and etcd.password)"
    )


# -- tokens and restarts -----------------------------------------------------------------------


async def test_an_expired_token_is_renewed_for_requests_and_watches(
    private_secure_etcd: EtcdServer,
    pki: DevPki,
    client_cert: CertFiles,
    connections: list[EtcdConnection],
) -> None:
    conn = connect(connections, private_secure_etcd.client_url, good_security(pki, client_cert))
    revision = await conn.put(b"/k", b"1")
    await asyncio.sleep(2.5)  # the server's tokens live 1 s unused
    assert await conn.put(b"/k", b"2") == revision + 1
    await asyncio.sleep(2.5)
    # etcd 3.4 refuses a watch with a stale token as "permission denied", in a reply aetcd alone
    # would take for a created watch: it must get a new token too, not hang silently.
    stream = await conn.watch(b"/k", revision + 1, prefix=False)
    try:
        event = await asyncio.wait_for(anext(aiter(stream)), 5)
    finally:
        await stream.cancel()
    assert (event.value, event.revision) == (b"2", revision + 1)


async def test_a_restart_with_authentication_on_keeps_clients_working(
    private_secure_etcd: EtcdServer,
    pki: DevPki,
    client_cert: CertFiles,
    prefix: str,
    connections: list[EtcdConnection],
) -> None:
    options = EtcdOptions(
        endpoints=(private_secure_etcd.client_url,),
        prefix=prefix,
        session=POLICY,
        request_timeout_s=REQUEST_TIMEOUT_S,
        security=good_security(pki, client_cert),
    )
    conn = EtcdConnection.from_options(options)
    connections.append(conn)
    store = EtcdMetadataStore(conn, options)
    await store.start()
    try:
        await store.register_broker(BrokerId("a"), b"a")
        private_secure_etcd.restart()  # auth is on already: the start must take it as done
        assert "Roles: root" in private_secure_etcd.etcdctl("user", "get", "root")

        async def registered() -> dict[BrokerId, bytes]:
            while True:
                try:
                    brokers, _ = await store.list_brokers()
                    return brokers
                except UnavailableError:
                    await asyncio.sleep(0.1)

        assert await asyncio.wait_for(registered(), 10) == {BrokerId("a"): b"a"}
    finally:
        await store.close()
    fresh = connect(connections, private_secure_etcd.client_url, options.security)
    assert (await fresh.put(b"/after-restart", b"ok")) > 0
