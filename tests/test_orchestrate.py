"""pdcheck.orchestrate: the waits, the tag routing and the port holding every command drives its ranks with.

The waits and the routing are pure logic over a launcher's event stream: a scripted stream stands in for the
launcher here (the integration tests drive the same functions with real ranks: test_faults, test_bench,
test_handshake_integration, test_live, test_ray). Held ports are real sockets.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import pytest

from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.bench import messages as bm
from pdcheck.errors import HarnessError
from pdcheck.orchestrate import RankId
from pdcheck.vllm import drive
from pdcheck.vllm import messages as vm


@dataclass(eq=False)
class FakeRank:
    role: str
    tp_rank: int
    how: str = "exited with code 3"
    done: bool = False
    stopped: str | None = None
    sent: list[m.Msg] = field(default_factory=list)

    @property
    def id(self) -> RankId:
        return RankId(self.role, self.tp_rank)

    def send(self, msg: m.Msg) -> None:
        self.sent.append(msg)

    def ended(self) -> str:
        return self.how


class Script:
    """A launcher whose events are scripted; a callable entry reacts to what ranks were sent so far. The
    script running out stands for the deadline passing."""

    def __init__(self, *steps: object) -> None:
        self.steps = list(steps)

    def events(self, ranks: list[FakeRank], deadline: float) -> Iterator[tuple[FakeRank, m.Msg | None]]:
        while self.steps:
            step = self.steps.pop(0)
            got = step() if callable(step) else step
            if got is None:
                continue
            rank, msg = got
            if rank in ranks and not rank.done:
                if msg is None:
                    rank.done = True
                yield rank, msg


def test_rank_ids_render_two_ways_and_sort_by_role_then_index():
    assert str(RankId("P", 3)) == "P rank 3" and RankId("D", 10).short == "D10"
    assert sorted([RankId("P", 10), RankId("P", 2), RankId("D", 1)]) == [RankId("D", 1), RankId("P", 2),
                                                                         RankId("P", 10)]
    assert orc.ids("D", 2) == [RankId("D", 0), RankId("D", 1)]


def test_await_ready_keys_by_rank_id_and_ticks():
    p0, d0 = FakeRank("P", 0), FakeRank("D", 0)
    ticks: list[tuple[str, int, int]] = []
    lau = Script((d0, m.Ready(0, "d", 2.0)), (p0, vm.Serving(0)), (p0, m.Ready(0, "p", 1.0, b"v")))
    got = orc.await_ready(lau, [p0, d0], 5, lambda *a: ticks.append(a))
    assert got == {RankId("D", 0): (2.0, None), RankId("P", 0): (1.0, b"v")}
    assert ticks == [("ranks up", 1, 2), ("ranks up", 2, 2)]


@pytest.mark.parametrize(("event", "text"), [
    (m.Failed(1, "OSError: no memory"), "P rank 1 failed to start: OSError: no memory"),
    (None, "P rank 1 died during start-up: it exited with code 3"),
])
def test_await_ready_names_the_rank_that_failed_or_died(event, text):
    p0, p1 = FakeRank("P", 0), FakeRank("P", 1)
    with pytest.raises(HarnessError) as err:
        orc.await_ready(Script((p0, m.Ready(0, "p", 1.0)), (p1, event)), [p0, p1], 5)
    assert str(err.value) == text


def test_await_ready_past_the_deadline_lists_who_is_missing():
    ranks = [FakeRank("P", 0), FakeRank("P", 1), FakeRank("D", 0)]
    with pytest.raises(HarnessError) as err:
        orc.await_ready(Script((ranks[1], m.Ready(1, "p", 1.0))), ranks, 1.5)
    assert str(err.value) == "D rank 0, P rank 0 not ready after 1.5 s (start-up follows --timeout)"


def test_await_serving_maps_layout_ports_to_bound_ones():
    p0, p1 = FakeRank("P", 0), FakeRank("P", 1)
    listeners = {0: [vm.ListenerSpec("A", 5600, None, [0])], 1: [vm.ListenerSpec("A", 5601, None, [1])]}
    got = drive.await_serving(Script((p1, vm.Serving(1, [40001])), (p0, vm.Serving(0, [40000]))),
                            {0: p0, 1: p1}, listeners, 5)
    assert got == {5600: 40000, 5601: 40001}
    with pytest.raises(HarnessError, match=r"^P rank 1 died during start-up \(opening its side channel\): it "
                                           r"exited with code 3$"):
        drive.await_serving(Script((p1, None)), {0: FakeRank("P", 0), 1: p1}, listeners, 5)


@dataclass
class Words:
    """A caller's own fault texts (transfer-bench's)."""

    strict: bool = True

    def failed(self, rank, msg):
        return RuntimeError(f"failed {rank.id.short}: {msg.error}")

    def died(self, rank):
        return RuntimeError(f"died {rank.id.short}")

    def late(self, pending):
        return TimeoutError(",".join(r.short for r in pending))

    def stray(self, rank, msg):
        return RuntimeError(f"stray {type(msg).__name__}") if self.strict else None


def test_gather_watches_ranks_it_does_not_wait_for():
    p0, d0 = FakeRank("P", 0), FakeRank("D", 0)
    with pytest.raises(RuntimeError, match="^died P0$"):
        orc.gather(Script((p0, None)), [d0], m.Ack, 5, Words(), watch=[p0, d0])


def test_gather_stray_messages_raise_or_are_skipped_as_the_caller_says():
    d0, d1 = FakeRank("D", 0), FakeRank("D", 1)
    with pytest.raises(RuntimeError, match="^stray Armed$"):
        orc.gather(Script((d0, m.Armed())), [d0], m.Ack, 5, Words())
    got = orc.gather(Script((d0, m.Armed()), (d0, m.Ack()), (d0, m.Ack()), (d1, m.Ack())), [d0, d1], m.Ack, 5,
                     Words(strict=False))
    assert list(got) == [RankId("D", 0), RankId("D", 1)]
    with pytest.raises(TimeoutError, match="^D1$"):
        orc.gather(Script((d0, m.Ack())), [d0, d1], m.Ack, 5, Words())


def test_gather_lets_ranks_that_said_goodbye_end():
    p0, d0 = FakeRank("P", 0), FakeRank("D", 0)
    got = orc.gather(Script((p0, bm.Bye(1)), (p0, None), (d0, bm.Bye(0))), [p0, d0], bm.Bye, 5, Words(),
                     ended_ok=True)
    assert {k: v[1].notifs for k, v in got.items()} == {RankId("P", 0): 1, RankId("D", 0): 0}


def _result(r: int) -> vm.DecodeResult:
    return vm.DecodeResult(r, 8, {}, None)


def test_route_tags_gives_each_d_rank_its_own_ticket_back():
    """Two D ranks both number their first request 1 and both read P rank 0: the replies must not cross."""
    p0, d0, d1 = FakeRank("P", 0), FakeRank("D", 0), FakeRank("D", 1)

    def p_answers(i: int):  # P tags the i-th request it was sent, in its own (global) ticket numbers
        return lambda: (p0, m.Tagged(p0.sent[i].ticket))

    lau = Script((d0, m.TagReq(1, 0, {0: [1]})), (d1, m.TagReq(1, 0, {0: [2]})), p_answers(1), p_answers(0),
                 (d0, _result(0)), (d1, _result(1)), (p0, vm.PrefillFinal(0, 2, ["n"], None)))
    harness: list[str] = []
    ticks: list[tuple[str, int, int]] = []
    results, finals = drive.route_tags(lau, {0: p0}, {0: d0, 1: d1}, 5, harness, tick=lambda *a: ticks.append(a))
    assert [x.ticket for x in p0.sent[:2]] == [1, 2] and p0.sent[0].blocks == {0: [1]}
    assert d0.sent == [m.Tagged(1)] and d1.sent == [m.Tagged(1)]
    assert isinstance(p0.sent[-1], m.Stop)  # every D rank reported: P ranks are stopped
    assert set(results) == {0, 1} and finals[0].served == 2 and harness == []
    assert ticks[-1] == ("handshakes + transfer proof", 2, 2)


def test_route_tags_answers_for_a_p_rank_a_test_killed():
    p0, d0 = FakeRank("P", 0, how="exited with code 17"), FakeRank("D", 0)
    lau = Script((d0, m.TagReq(4, 0, {0: [1]})), (p0, None), (d0, _result(0)))
    harness: list[str] = []
    results, finals = drive.route_tags(lau, {0: p0}, {0: d0}, 5, harness, expected_dead=[0])
    assert d0.sent == [m.Tagged(4)]  # so the D rank reports the failed READ instead of waiting
    assert harness == ["P rank 0 died during transfer: it exited with code 17"]
    assert set(results) == {0} and finals == {}


def test_route_tags_stops_at_once_when_a_rank_nobody_killed_dies(capsys):
    p0, d0, d1 = FakeRank("P", 0), FakeRank("D", 0, how="was killed by SIGKILL"), FakeRank("D", 1)
    lau = Script((d0, None), (d1, _result(1)))
    harness: list[str] = []
    results, _ = drive.route_tags(lau, {0: p0}, {0: d0, 1: d1}, 7, harness)
    assert results == {}  # the run stopped before D rank 1's result was read
    assert harness == ["D rank 0 died during handshake: it was killed by SIGKILL",
                       "D rank 1 did not report within 7 s"]
    err = capsys.readouterr().err
    assert "pdcheck: D rank 0 died during handshake: it was killed by SIGKILL; stopping the run" in err


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_hold_the_rest_sends_unserved_layout_ports_to_one_silent_port():
    with ExitStack() as held:
        go = drive.hold_the_rest(held, "127.0.0.1", [5600, 5601, 5602], False, {5600: 41000})
        assert go.ports[5600] == 41000
        assert go.ports[5601] == go.ports[5602] == go.silent and _answers(go.silent)
    assert not _answers(go.silent)  # leaving the stack let it go
