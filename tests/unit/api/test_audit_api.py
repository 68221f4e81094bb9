"""The Audit RPC (answered by the leader, forwarded there by the others) and how ``lbd ctl audit``
shows its answer."""

from __future__ import annotations

from rich.console import Console

from lbd.ctl import render
from lbd.gen.v1 import lbd_pb2
from tests.unit.api.served import serve_api, until
from tests.unit.services.harness import Harness


async def test_audit_is_answered_by_the_leader_from_any_sidecar(harness: Harness) -> None:
    a = await harness.add("broker-a")
    b = await harness.add("broker-b")
    await harness.ready()
    async with serve_api(harness, a) as api_a, serve_api(harness, b) as api_b:
        await until(lambda: api_a.elector.is_leader or api_b.elector.is_leader)
        leader, follower = (api_a, api_b) if api_a.elector.is_leader else (api_b, api_a)
        await until(lambda: follower.elector.leader is not None)
        await until(
            lambda: all(
                i.sidecar_grpc_addr.startswith("127.0.0.1:")
                for i in follower.sidecar.registry.brokers().values()
            )
        )
        assert leader.sidecar.auditor.latest is None
        reply = await follower.admin.Audit(lbd_pb2.AuditRequest(), timeout=5)
        latest = leader.sidecar.auditor.latest  # none had run: the leader audited now
        assert latest is not None and follower.sidecar.auditor.latest is None
        assert reply.checked_at_ms == latest.checked_at_ms > 0
        assert list(reply.findings) == []
        assert reply.bundles_checked == latest.bundles_checked
        again = await leader.admin.Audit(lbd_pb2.AuditRequest(), timeout=5)
        assert again.checked_at_ms == reply.checked_at_ms  # the latest, not a new one


def shown(response: lbd_pb2.AuditResponse) -> str:
    console = Console(record=True, width=200)
    console.print(render.audit_view(response))
    return console.export_text()


def test_ctl_audit_shows_each_finding_with_what_to_do_or_that_there_is_none() -> None:
    assert shown(lbd_pb2.AuditResponse()) == "no audit has run yet\n"
    clean = lbd_pb2.AuditResponse(
        checked_at_ms=1_714_561_200_000, bundles_checked=12, sidecars_compared=3
    )
    assert shown(clean) == (
        "no findings (audit at 2024-05-01T11:00:00.000Z: 12 bundles checked, 3 sidecar tables "
        "compared)\n"
    )
    finding = lbd_pb2.Finding(
        kind="stale_owner",
        bundle="public/default/0x00000000_0x40000000",
        broker_id="broker-2",
        detail="Owned by broker-2, which left 95s ago",
        action="lbd ctl transfer it",
        since_ms=1_714_561_100_000,
    )
    text = shown(lbd_pb2.AuditResponse(findings=[finding], checked_at_ms=1_714_561_200_000))
    assert "audit: 1 finding(s)" in text
    for part in (
        "stale_owner",
        finding.bundle,
        "broker-2",
        "2024-05-01T10:58:20.000Z",
        finding.detail,
        "do: lbd ctl transfer it",
    ):
        assert part in text
