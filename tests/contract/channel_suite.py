"""The contract of :class:`lbd.ports.channel.ChannelLog`, run against every implementation.

A concrete test class subclasses :class:`ChannelLogContract` and provides the ``new_channel``
fixture: a factory of clients of one fresh log (each call: another sidecar's client of the same
log), all closed by the fixture afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

import pytest

from lbd.core.errors import InvalidInputError
from lbd.core.table import ChannelPosition
from lbd.ports.channel import MAX_BATCH_ENTRIES, RESERVED_KEY_PREFIX, ChannelLog, ChannelMessage
from lbd.ports.errors import UnavailableError

ChannelFactory = Callable[[], ChannelLog]

TAKE_TIMEOUT_S = 10.0


async def take(
    messages: AsyncGenerator[ChannelMessage, None],
    count: int,
    *,
    timeout_s: float = TAKE_TIMEOUT_S,
) -> list[ChannelMessage]:
    """The next ``count`` distinct messages, dropping repeats as the port lets a log deliver them.

    Fails if a message is older than one already taken without being a repeat of it (out of
    order), since the port promises log order.
    """
    taken: list[ChannelMessage] = []
    seen: dict[ChannelPosition, ChannelMessage] = {}

    async def collect() -> None:
        async for message in messages:
            if message.position in seen:
                assert seen[message.position] == message, "a repeat differs from the original"
                continue
            assert not taken or message.position > taken[-1].position, (
                f"{message.position} delivered after {taken[-1].position}"
            )
            seen[message.position] = message
            taken.append(message)
            if len(taken) == count:
                return

    await asyncio.wait_for(collect(), timeout_s)
    return taken


async def catch_up_all(channel: ChannelLog, after: ChannelPosition | None) -> list[ChannelMessage]:
    """Everything :meth:`ChannelLog.catch_up` yields, checking it ends by itself."""
    async with contextlib.aclosing(channel.catch_up(after)) as messages:
        return await asyncio.wait_for(_collect_all(messages), TAKE_TIMEOUT_S)


async def _collect_all(messages: AsyncGenerator[ChannelMessage, None]) -> list[ChannelMessage]:
    return [message async for message in messages]


def entries(messages: list[ChannelMessage]) -> list[tuple[str, bytes]]:
    """The (key, value) pairs of ``messages``, in order."""
    return [(m.key, m.value) for m in messages]


class ChannelLogContract:
    """What every ChannelLog does. Subclasses provide ``new_channel``."""

    @pytest.fixture
    def new_channel(self) -> ChannelFactory:
        raise NotImplementedError("a concrete contract test provides new_channel")

    async def test_publish_returns_increasing_positions(self, new_channel: ChannelFactory) -> None:
        channel = new_channel()
        positions = [await channel.publish(f"t/ns/{i}", b"v") for i in range(5)]
        assert positions == sorted(positions)
        assert len(set(positions)) == 5

    async def test_follow_from_the_start_delivers_everything_in_order(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        published = [(f"t/ns/b{i}", f"value-{i}".encode()) for i in range(5)]
        positions = [await writer.publish(key, value) for key, value in published]

        async with contextlib.aclosing(reader.follow(None)) as follower:
            got = await take(follower, 5)

        assert entries(got) == published
        assert [m.position for m in got] == positions

    async def test_follow_after_a_position_delivers_exactly_what_follows_it(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        positions = [await writer.publish(f"t/ns/b{i}", b"%d" % i) for i in range(6)]

        async with contextlib.aclosing(reader.follow(positions[2])) as follower:
            got = await take(follower, 3)
            assert [m.position for m in got] == positions[3:]
            assert entries(got) == [("t/ns/b3", b"3"), ("t/ns/b4", b"4"), ("t/ns/b5", b"5")]
            later = await writer.publish("t/ns/later", b"7")
            (next_one,) = await take(follower, 1)
        assert next_one == ChannelMessage(later, "t/ns/later", b"7")

    async def test_a_batch_is_read_entry_by_entry_at_positions_of_one_message(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        before = await writer.publish("t/ns/before", b"0")
        batch = [("t/ns/a", b"1"), ("t/ns/b", b""), ("t/ns/a", b"3")]
        positions = await writer.publish_batch(batch)
        after = await writer.publish("t/ns/after", b"4")

        assert before < positions[0] < positions[1] < positions[2] < after
        assert {(p.ledger_id, p.entry_id) for p in positions} == {
            (positions[0].ledger_id, positions[0].entry_id)
        }
        assert [p.batch_index for p in positions] == [0, 1, 2]
        everything = [("t/ns/before", b"0"), *batch, ("t/ns/after", b"4")]
        async with contextlib.aclosing(reader.follow(None)) as follower:
            got = await take(follower, 5)
        assert entries(got) == everything
        assert [m.position for m in got] == [before, *positions, after]
        assert entries(await catch_up_all(reader, None)) == everything

    async def test_follow_after_an_entry_of_a_batch_delivers_the_rest_of_it(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        positions = await writer.publish_batch([(f"t/ns/b{i}", b"%d" % i) for i in range(4)])
        later = await writer.publish("t/ns/later", b"x")

        async with contextlib.aclosing(reader.follow(positions[1])) as follower:
            got = await take(follower, 3)
        assert [m.position for m in got] == [positions[2], positions[3], later]
        caught = await catch_up_all(reader, positions[3])
        assert caught == [ChannelMessage(later, "t/ns/later", b"x")]

    @pytest.mark.parametrize(
        ("batch", "error"),
        [
            ([], "at least one entry"),
            ([("t/ns/a", b"1"), (f"{RESERVED_KEY_PREFIX}x", b"2")], "reserved"),
            ([("t/ns/a", b"1"), ("", b"2")], "non-empty key"),
            ([("t/ns/a", b"")] * (MAX_BATCH_ENTRIES + 1), f"at most {MAX_BATCH_ENTRIES}"),
        ],
        ids=["empty", "reserved-key", "empty-key", "too-many"],
    )
    async def test_a_batch_that_cannot_be_published_is_refused_whole(
        self, new_channel: ChannelFactory, batch: list[tuple[str, bytes]], error: str
    ) -> None:
        channel = new_channel()
        with pytest.raises(InvalidInputError, match=error):
            await channel.publish_batch(batch)
        assert await catch_up_all(channel, None) == []

    async def test_follow_after_the_last_position_waits_for_the_next(
        self, new_channel: ChannelFactory
    ) -> None:
        channel = new_channel()
        last = await channel.publish("t/ns/a", b"old")
        async with contextlib.aclosing(channel.follow(last)) as follower:
            pending = asyncio.ensure_future(take(follower, 1))
            await asyncio.sleep(0.05)
            assert not pending.done()
            newer = await channel.publish("t/ns/a", b"new")
            assert await pending == [ChannelMessage(newer, "t/ns/a", b"new")]

    async def test_a_follower_started_before_any_publish_receives_the_first(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        async with contextlib.aclosing(reader.follow(None)) as follower:
            pending = asyncio.ensure_future(take(follower, 2))
            await asyncio.sleep(0.2)
            assert not pending.done()
            first = await writer.publish("t/ns/first", b"1")
            second = await writer.publish("t/ns/second", b"")
            got = await pending
        assert got == [
            ChannelMessage(first, "t/ns/first", b"1"),
            ChannelMessage(second, "t/ns/second", b""),
        ]

    async def test_two_followers_see_concurrent_publishers_in_the_same_order(
        self, new_channel: ChannelFactory
    ) -> None:
        publishers = [new_channel() for _ in range(3)]
        followers = [new_channel(), new_channel()]
        per_publisher = 20

        async def publish_all(index: int, channel: ChannelLog) -> list[ChannelMessage]:
            sent = []
            for i in range(per_publisher):
                key, value = f"t/ns/p{index}-{i % 4}", f"{index}:{i}".encode()
                sent.append(ChannelMessage(await channel.publish(key, value), key, value))
            return sent

        async with (
            contextlib.aclosing(followers[0].follow(None)) as first,
            contextlib.aclosing(followers[1].follow(None)) as second,
        ):
            sent_lists = await asyncio.gather(
                *(publish_all(i, channel) for i, channel in enumerate(publishers))
            )
            total = per_publisher * len(publishers)
            seen_first, seen_second = await asyncio.gather(take(first, total), take(second, total))

        sent = sorted((m for sent_list in sent_lists for m in sent_list), key=lambda m: m.position)
        assert len({m.position for m in sent}) == total
        assert seen_first == sent
        assert seen_second == sent
        for sent_list in sent_lists:
            assert [m.position for m in sent_list] == sorted(m.position for m in sent_list)

    async def test_catch_up_delivers_what_the_log_holds_then_ends(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        positions = [await writer.publish(f"t/ns/b{i}", b"%d" % i) for i in range(5)]

        everything = await catch_up_all(reader, None)
        after_two = await catch_up_all(reader, positions[1])
        nothing_new = await catch_up_all(reader, positions[-1])

        assert [m.position for m in everything] == positions
        assert entries(after_two) == [("t/ns/b2", b"2"), ("t/ns/b3", b"3"), ("t/ns/b4", b"4")]
        assert nothing_new == []

    async def test_last_after_names_where_catch_up_would_end(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        assert await reader.last_after(None) is None  # nothing yet, the log's own marker unseen
        positions = [await writer.publish(f"t/ns/b{i}", b"%d" % i) for i in range(5)]

        for after in (None, positions[0], positions[3]):
            caught = await catch_up_all(reader, after)
            assert await reader.last_after(after) == caught[-1].position == positions[-1]
        assert await reader.last_after(positions[-1]) is None
        assert await catch_up_all(reader, positions[-1]) == []

    async def test_catch_up_of_an_empty_log_ends_and_leaves_nothing_visible(
        self, new_channel: ChannelFactory
    ) -> None:
        writer, reader = new_channel(), new_channel()
        assert await catch_up_all(reader, None) == []
        assert await catch_up_all(writer, None) == []

        real = await writer.publish("t/ns/real", b"x")

        # Whatever the log wrote for itself to find its end stays invisible to every reader.
        assert await catch_up_all(reader, None) == [ChannelMessage(real, "t/ns/real", b"x")]
        async with contextlib.aclosing(reader.follow(None)) as follower:
            assert await take(follower, 1) == [ChannelMessage(real, "t/ns/real", b"x")]

    @pytest.mark.parametrize("key", ["", f"{RESERVED_KEY_PREFIX}bootstrap__", "__lbd_x"])
    async def test_empty_and_reserved_keys_are_refused(
        self, new_channel: ChannelFactory, key: str
    ) -> None:
        channel = new_channel()
        with pytest.raises(InvalidInputError, match="key"):
            await channel.publish(key, b"v")
        assert await catch_up_all(channel, None) == []

    async def test_close_ends_followers_refuses_publishing_and_is_idempotent(
        self, new_channel: ChannelFactory
    ) -> None:
        channel = new_channel()
        await channel.publish("t/ns/a", b"1")
        follower = channel.follow(None)
        got = await take(follower, 1)
        assert entries(got) == [("t/ns/a", b"1")]
        rest = asyncio.ensure_future(_collect_all(follower))
        await asyncio.sleep(0.05)
        assert not rest.done()

        await channel.close()

        assert await asyncio.wait_for(rest, TAKE_TIMEOUT_S) == []
        await channel.close()
        with pytest.raises(UnavailableError):
            await channel.publish("t/ns/a", b"2")
