"""BrokerLink: the session stream, acknowledged commands, timeouts, replacement, auto-ack."""

import asyncio
import contextlib

import pytest
from rig import let_run, turns

from lbd.adapters.clock import ManualClock
from lbd.core.broker_info import (
    BrokerInfo,
    CloseCommand,
    CommandAck,
    Hello,
    LeaseRequest,
    LoadReport,
    OwnCommand,
    ReleaseCommand,
    ServingLease,
)
from lbd.core.errors import InvalidInputError
from lbd.core.ids import BrokerId, BundleId
from lbd.services.sidecar.broker_link import COMMANDS_IN_FLIGHT, BrokerLink, LinkEventKind

ME = BrokerId("me")
B1 = BundleId("public/default/0x00000000_0x40000000")
B2 = BundleId("public/default/0x40000000_0x80000000")


class Broker:
    """A scripted far end: a queue of messages to send, the commands it got."""

    def __init__(
        self, link: BrokerLink, info: BrokerInfo | None = None, *, hello: Hello | None = None
    ) -> None:
        self.outgoing: asyncio.Queue[object] = asyncio.Queue()
        self.outgoing.put_nowait(hello or Hello(info or BrokerInfo(ME)))
        self.commands: asyncio.Queue[object] = asyncio.Queue()
        self.task = asyncio.create_task(self._run(link))

    async def _incoming(self):
        while (message := await self.outgoing.get()) is not None:
            yield message

    async def _run(self, link: BrokerLink) -> None:
        async with contextlib.aclosing(link.session(self._incoming())) as commands:
            async for message in commands:
                self.commands.put_nowait(message)

    async def next_command(self):
        async with asyncio.timeout(2):
            return await self.commands.get()

    async def end(self) -> None:
        self.outgoing.put_nowait(None)
        async with asyncio.timeout(2):
            await self.task


async def attached(link: BrokerLink, events) -> None:
    async with asyncio.timeout(2):
        event = await anext(events)
    assert event.kind is LinkEventKind.ATTACHED


async def test_commands_wait_for_the_brokers_ack() -> None:
    clock = ManualClock()
    link = BrokerLink(ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=clock)
    events = link.events()
    broker = Broker(link)
    await attached(link, events)
    assert link.attached and link.info == BrokerInfo(ME)
    owning = asyncio.create_task(link.own(B1))
    command = await broker.next_command()
    assert command.command == OwnCommand(B1)
    assert not owning.done()
    broker.outgoing.put_nowait(CommandAck(command.command_id))
    assert await owning is True
    assert link.served() == {B1}
    assert await link.own(B1) is True  # already served: nothing sent
    assert broker.commands.empty()
    new_owner = BrokerInfo(BrokerId("other"), service_url="pulsar://other:6650")
    releasing = asyncio.create_task(link.release(B1, new_owner))
    command = await broker.next_command()
    assert command.command == ReleaseCommand(B1, new_owner)
    broker.outgoing.put_nowait(CommandAck(command.command_id, ok=False, error="busy"))
    assert await releasing is False
    assert link.served() == frozenset()
    report = LoadReport()
    broker.outgoing.put_nowait(report)
    await broker.end()
    assert link.latest_report is report
    async with asyncio.timeout(2):
        assert (await anext(events)).kind is LinkEventKind.DETACHED
    assert not link.attached


B3 = BundleId("public/default/0x80000000_0xc0000000")


async def test_owns_asked_for_together_go_as_one_command_to_a_broker_that_takes_batches() -> None:
    clock = ManualClock()
    link = BrokerLink(ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=clock)
    broker = Broker(link, hello=Hello(BrokerInfo(ME), takes_own_batches=True))
    owning = [asyncio.create_task(link.own(b)) for b in (B1, B2, B3)]
    command = await broker.next_command()
    assert command.command == OwnCommand(B1, (B2, B3))
    # B2 was not taken: it alone is refused, and closed after the Own (it may hold it anyway).
    broker.outgoing.put_nowait(
        CommandAck(command.command_id, ok=False, error="1 not taken", failed={B2: "no disk"})
    )
    close = await broker.next_command()
    assert close.command == CloseCommand(B2, "own not acknowledged: no disk")
    broker.outgoing.put_nowait(CommandAck(close.command_id))
    assert [await o for o in owning] == [True, False, True]
    assert link.served() == {B1, B3}
    # A lone Own is a batch of one: an Own of its own.
    alone = asyncio.create_task(link.own(B2))
    command = await broker.next_command()
    assert command.command == OwnCommand(B2)
    broker.outgoing.put_nowait(CommandAck(command.command_id))
    assert await alone is True
    await broker.end()


async def test_an_own_batch_unanswered_is_doubted_whole() -> None:
    clock = ManualClock()
    link = BrokerLink(ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=clock)
    broker = Broker(link, hello=Hello(BrokerInfo(ME), takes_own_batches=True))
    owning = [asyncio.create_task(link.own(b)) for b in (B1, B2)]
    assert (await broker.next_command()).command == OwnCommand(B1, (B2,))
    await clock.run_for(5.1, step=0.5)
    closes = [await broker.next_command() for _ in range(2)]
    assert {c.command.bundle for c in closes} == {B1, B2}
    for close in closes:
        broker.outgoing.put_nowait(CommandAck(close.command_id))
    async with asyncio.timeout(2):
        assert [await o for o in owning] == [False, False]
    assert link.served() == frozenset()
    await broker.end()


async def test_a_broker_that_did_not_say_it_takes_batches_gets_one_own_per_bundle() -> None:
    clock = ManualClock()
    link = BrokerLink(ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=clock)
    broker = Broker(link)
    owning = [asyncio.create_task(link.own(b)) for b in (B1, B2)]
    commands = [await broker.next_command() for _ in range(2)]
    assert [c.command for c in commands] == [OwnCommand(B1), OwnCommand(B2)]
    for command in commands:
        broker.outgoing.put_nowait(CommandAck(command.command_id))
    assert [await o for o in owning] == [True, True]
    await broker.end()


async def test_an_unanswered_command_times_out_on_the_clock() -> None:
    clock = ManualClock()
    link = BrokerLink(ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=clock)
    broker = Broker(link)
    owning = asyncio.create_task(link.own(B1))
    await broker.next_command()
    await clock.run_for(4.9, step=0.7)
    assert not owning.done()
    await clock.run_for(0.2, step=0.1)
    # The broker may still take it (a late ack): it is told to close it, after the Own.
    close = await broker.next_command()
    assert close.command.bundle == B1 and isinstance(close.command, CloseCommand)
    broker.outgoing.put_nowait(CommandAck(close.command_id))
    async with asyncio.timeout(2):
        assert await owning is False
    assert link.served() == frozenset()
    await broker.end()


async def test_a_session_must_start_with_hello_from_this_broker() -> None:
    link = BrokerLink(
        ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=ManualClock()
    )

    async def messages(*items):
        for item in items:
            yield item

    with pytest.raises(InvalidInputError, match="must start with Hello, got LoadReport"):
        await anext(link.session(messages(LoadReport())))
    with pytest.raises(InvalidInputError, match="'other' said Hello to the sidecar of broker 'me'"):
        await anext(link.session(messages(Hello(BrokerInfo(BrokerId("other"))))))
    assert not link.attached


async def test_a_new_session_replaces_the_open_one_and_pending_commands_fail() -> None:
    link = BrokerLink(
        ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=ManualClock()
    )
    events = link.events()
    first = Broker(link)
    await attached(link, events)
    owning = asyncio.create_task(link.own(B1))
    await first.next_command()
    second = Broker(link, BrokerInfo(ME, version="2"))
    await attached(link, events)
    async with asyncio.timeout(2):
        assert await owning is False
        await first.task  # the replaced session ended
    assert link.info == BrokerInfo(ME, version="2")
    closing = asyncio.create_task(link.close_bundle(B2, "test"))
    command = await second.next_command()
    assert command.command == CloseCommand(B2, "test")
    second.outgoing.put_nowait(CommandAck(command.command_id))
    await closing
    await second.end()
    async with asyncio.timeout(2):
        assert (await anext(events)).kind is LinkEventKind.DETACHED


async def test_auto_ack_serves_alone_and_nothing_is_owned_while_fenced() -> None:
    link = BrokerLink(
        ME, auto_ack=True, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=ManualClock()
    )
    assert await link.own(B1) and await link.own(B2)
    assert link.served() == {B1, B2}
    await link.fence("test")
    assert link.served() == frozenset() and link.fenced
    assert await link.own(B1) is False
    link.unfence()
    assert await link.own(B1) is True
    assert await link.release(B1, None) is True
    assert link.served() == frozenset()


async def test_without_auto_ack_and_broker_nothing_is_acknowledged() -> None:
    link = BrokerLink(
        ME, auto_ack=False, own_ack_timeout_s=5, release_ack_timeout_s=5, clock=ManualClock()
    )
    assert await link.own(B1) is False
    assert await link.release(B1, None) is False
    assert link.served() == frozenset()


# -- the serving lease -------------------------------------------------------------------------


def leasing_link(clock: ManualClock, vouching: list[bool]) -> BrokerLink:
    return BrokerLink(
        ME,
        auto_ack=False,
        own_ack_timeout_s=5,
        release_ack_timeout_s=5,
        clock=clock,
        serving_lease_s=10,
        lease_margin_s=1,
        vouch=lambda: vouching[0],
    )


async def test_a_lease_is_granted_only_while_the_sidecar_can_vouch() -> None:
    clock = ManualClock()
    vouching = [True]
    link = leasing_link(clock, vouching)
    events = link.events()
    broker = Broker(link)
    await attached(link, events)
    broker.outgoing.put_nowait(LeaseRequest(1))
    granted = await broker.next_command()
    assert granted.command_id == 0 and granted.command == ServingLease(1, 10_000)
    assert link.lease_granted_until == clock.monotonic() + 10

    vouching[0] = False  # e.g. the etcd lease was not renewed for etcd.fence_after_s
    broker.outgoing.put_nowait(LeaseRequest(2))
    broker.outgoing.put_nowait(LoadReport())
    await turns(lambda: link.latest_report is not None)
    assert broker.commands.empty()  # no grant
    await link.fence("test")
    vouching[0] = True
    broker.outgoing.put_nowait(LeaseRequest(3))
    broker.outgoing.put_nowait(LoadReport(bundles=()))
    await let_run()
    assert broker.commands.empty()  # fenced: no grant either
    await broker.end()


async def test_waiting_out_a_lease_withholds_renewals_until_it_surely_ran_out() -> None:
    clock = ManualClock()
    link = leasing_link(clock, [True])
    events = link.events()
    broker = Broker(link)
    await attached(link, events)
    broker.outgoing.put_nowait(LeaseRequest(1))
    await broker.next_command()
    await clock.run_for(4)

    waiting = asyncio.create_task(link.wait_out_lease())
    await let_run()
    broker.outgoing.put_nowait(LeaseRequest(2))  # a renewal while it waits: refused
    await let_run()
    assert broker.commands.empty()
    await clock.run_for(6.5)  # the lease ran out, the margin not yet
    assert not waiting.done()
    await clock.run_for(0.6)
    async with asyncio.timeout(2):
        await waiting
    broker.outgoing.put_nowait(LeaseRequest(3, lapses=1))
    assert (await broker.next_command()).command == ServingLease(3, 10_000)
    await broker.end()


async def test_a_lapse_the_broker_reports_clears_what_it_serves_and_is_an_event() -> None:
    clock = ManualClock()
    link = leasing_link(clock, [True])
    events = link.events()
    broker = Broker(link)
    await attached(link, events)
    owning = asyncio.create_task(link.own(B1))
    assert isinstance((await broker.next_command()).command, OwnCommand)
    broker.outgoing.put_nowait(CommandAck(1))
    async with asyncio.timeout(2):
        assert await owning
    assert link.served() == {B1}
    broker.outgoing.put_nowait(LeaseRequest(5, lapses=1))
    async with asyncio.timeout(2):
        event = await anext(events)
    assert event.kind is LinkEventKind.LAPSED
    assert link.served() == frozenset()
    await broker.end()


async def test_a_burst_of_commands_is_windowed_and_a_lease_grant_waits_behind_the_window() -> None:
    clock = ManualClock()
    link = leasing_link(clock, [True])
    events = link.events()
    broker = Broker(link)
    await attached(link, events)
    bundles = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(600)]
    owning = [asyncio.create_task(link.own(b)) for b in bundles]
    await let_run()
    # Only the window is sent; the rest wait, in order.
    assert broker.commands.qsize() == COMMANDS_IN_FLIGHT
    broker.outgoing.put_nowait(LeaseRequest(1))
    sent = [await broker.next_command() for _ in range(COMMANDS_IN_FLIGHT + 1)]
    assert sent[-1].command == ServingLease(1, 10_000)  # behind the window, not the burst
    assert [m.command.bundle for m in sent[:-1]] == bundles[:COMMANDS_IN_FLIGHT]
    # Each ack lets one more command go, in the order they were issued.
    order = [m.command.bundle for m in sent[:-1]]
    window = sent[:-1]
    while window:
        broker.outgoing.put_nowait(CommandAck(window.pop(0).command_id))
        if len(order) < len(bundles):
            message = await broker.next_command()
            order.append(message.command.bundle)
            window.append(message)
            assert broker.commands.empty()
    assert order == bundles
    async with asyncio.timeout(5):
        assert all(await asyncio.gather(*owning))
    assert link.served() == set(bundles)
    await broker.end()


async def test_commands_waiting_for_a_slot_fail_when_the_session_ends() -> None:
    clock = ManualClock()
    link = leasing_link(clock, [True])
    events = link.events()
    broker = Broker(link)
    await attached(link, events)
    bundles = [BundleId(f"public/default/0x{i:08x}_0x{i + 1:08x}") for i in range(300)]
    owning = [asyncio.create_task(link.own(b)) for b in bundles]
    await let_run()
    await broker.end()
    async with asyncio.timeout(5):
        assert not any(await asyncio.gather(*owning))
    assert link.served() == frozenset()
