"""The call registry's recording of replies, in-process: a reply the driver could not
unpickle is that call's ERR reply on every path a reply is recorded by (one by one, or in
a batch, among replies of calls and stall reports), and nothing else is touched."""

from __future__ import annotations

import pytest

import mpx
from mpx._driver.pump import _undecodable
from mpx._driver.registry import Call, CallRegistry
from mpx._driver.stalls import StallDiagnosis
from mpx.protocol import wire


def _registry(n_ranks: int, n_calls: int) -> tuple[CallRegistry, list]:
    reg = CallRegistry(n_ranks, StallDiagnosis(mpx.Config(), lambda: [0] * n_ranks,
                                               lambda rank: False),
                       lambda rank, err: None)
    calls = []
    for seq in range(n_calls):
        call = Call(seq, "m", n_ranks, None, None, None, reg.settings)
        reg.pending[seq] = call
        calls.append(call)
    reg.next_seq = n_calls
    return reg, calls


def _outcome(call):
    assert call.done, f"call {call.seq} is not done"
    return call.error if call.error is not None else call.value


def _undecodable_reply():
    return _undecodable(mpx.DeserializationError("no such class"))


@pytest.mark.parametrize("where", ["first", "middle", "last", "alone"])
def test_an_undecodable_reply_in_a_batch_fails_its_call_alone(where):
    reg, calls = _registry(2, 3)
    bad = {"first": 0, "middle": 1, "last": 2, "alone": 0}[where]
    batch = [(seq, wire.OK, f"r0-{seq}") if seq != bad else _undecodable_reply()
             for seq in range(3)]
    if where == "alone":
        batch = batch[:1]
    reg.record_batch(0, batch)
    reg.record_batch(1, [(seq, wire.OK, f"r1-{seq}") for seq in range(3)])
    reg.finish_answered()
    answered = 1 if where == "alone" else 3
    assert reg.next_reply == [answered, 3]
    for call in calls[:answered]:
        got = _outcome(call)
        if call.seq == bad:
            assert isinstance(got, mpx.RPCError)
            assert got.ranks == [0] and got.exc_type == "DeserializationError"
            assert "could not unpickle" in str(got)
        else:
            assert got == [f"r0-{call.seq}", f"r1-{call.seq}"]
    assert not reg.stalls.reports
    assert list(reg.pending) == list(range(answered, 3))


def test_undecodable_replies_and_stall_reports_in_one_batch():
    reg, calls = _registry(1, 3)
    stall = {"seq": 1, "seconds": 2.0, "rank": 0, "method": "m", "pid": 1, "stack": "",
             "dump_file": "/nonexistent"}
    reg.record_batch(0, [(0, wire.OK, "a"), (0, wire.STALL, dict(stall, seq=0)),
                          (1, wire.STALL, dict(stall)), _undecodable_reply(),
                          (2, wire.OK, "c")])
    reg.finish_answered()
    # the first report is about a call answered since: dropped; the second is kept
    # until its call (seq 1) is answered, by the undecodable reply
    assert _outcome(calls[0]) == ["a"]
    assert isinstance(_outcome(calls[1]), mpx.RPCError)
    assert _outcome(calls[2]) == ["c"]
    assert reg.next_reply == [3] and not reg.pending and not reg.stalls.reports


def test_an_undecodable_reply_recorded_by_itself():
    reg, calls = _registry(2, 1)
    reg.record(0, 0, wire.ERR, _undecodable_reply())
    reg.record(1, 0, wire.OK, "fine")
    reg.finish_answered()
    err = _outcome(calls[0])
    assert isinstance(err, mpx.RPCError) and err.ranks == [0]


def _pump(n_ranks: int, seqs: list[int], inbox: dict[int, list]):
    """A reply pump with calls ``seqs`` pending, whose rank r reads ``inbox[r]`` in order (a
    reply, or an exception to raise), and the list of what each read was asked."""
    from mpx._driver.pump import ReplyPump
    reg = CallRegistry(n_ranks, StallDiagnosis(mpx.Config(), lambda: [0] * n_ranks,
                                               lambda rank: False), lambda rank, err: None)
    pump = ReplyPump(reg, lambda err: None)
    calls = {seq: Call(seq, "m", n_ranks, None, None, None, reg.settings) for seq in seqs}
    pump.pending.update(calls)
    reg.next_seq = max(seqs) + 1
    asked: list = []

    class End:  # a rank's reply channel
        def __init__(self, rank):
            self.rank = rank

        def recv(self, deadline_ns):
            asked.append((self.rank, deadline_ns))
            got = inbox[self.rank].pop(0)
            if isinstance(got, BaseException):
                raise got
            return got

    pump.ends = [End(r) for r in range(n_ranks)]
    return pump, calls, asked


def test_the_pump_gathers_a_call_in_rank_order():
    from mpx._driver.pump import until_ns
    pump, calls, asked = _pump(3, [0], {0: [(0, wire.OK, "a")], 1: [(0, wire.OK, "b")],
                                        2: [(0, wire.OK, "c")]})
    pump._gather(calls[0], 12.5)
    assert _outcome(calls[0]) == ["a", "b", "c"] and not pump.pending
    assert pump.next_reply == [1, 1, 1]
    assert asked == [(r, until_ns(12.5)) for r in range(3)]


def test_the_pump_hands_what_is_not_the_calls_next_reply_to_the_table():
    # rank 0 first answers call 0, which timed out (no longer pending): recorded by the
    # table, and the gathering stops there; next time rank 1's reply is undecodable
    pump, calls, asked = _pump(2, [1], {0: [(0, wire.OK, "late"), (1, wire.OK, "x")],
                                        1: [mpx.DeserializationError("no such class")]})
    pump.next_reply[:] = [0, 1]
    pump._gather(calls[1], None)
    assert [a[0] for a in asked] == [0] and pump.next_reply == [1, 1]
    assert not calls[1].done and calls[1].missing() == [0, 1]
    pump._gather(calls[1], None)
    assert [a[0] for a in asked] == [0, 0, 1] and pump.next_reply == [2, 2]
    pump.registry.finish_answered()
    err = _outcome(calls[1])
    assert isinstance(err, mpx.RPCError) and err.ranks == [1]
    assert err.exc_type == "DeserializationError"


def test_the_pump_names_the_rank_whose_queue_died():
    pump, calls, asked = _pump(2, [0], {0: [(0, wire.OK, "a")],
                                        1: [mpx.PeerDiedError("gone", role="writer")]})
    with pytest.raises(mpx.PeerDiedError) as raised:
        pump._gather(calls[0], None)
    assert raised.value.rank == 1 and calls[0].missing() == [1]
