"""services/resend_gate.py in isolation (one event loop, no server): when a re-send's answer is
held, for how long at most, and what bounds how many wait. The storm over real HTTP is
tests/test_retry_storm_fresh_first.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from dpsketch.services.admission import Admission
from dpsketch.services.resend_gate import QUIET_S, TICK_S, ResendGate

FRESH = SimpleNamespace(accepted=1, duplicates=0)
RESENT = SimpleNamespace(accepted=0, duplicates=1)
REFUSED_OR_EMPTY = SimpleNamespace(accepted=0, duplicates=0)


def run(coro):
    return asyncio.run(coro)


async def timed(gate: ResendGate, result, size: int = 100, counted: bool = False) -> float:
    t0 = time.monotonic()
    await gate.answered(result, size, counted)
    return time.monotonic() - t0


def at_once(gate: ResendGate, result, size: int = 100, counted: bool = False) -> bool:
    """Whether the answer went out without waiting: the coroutine ran to its end at its first
    step, never suspended. Unlike a wall-clock bound (formerly < 10 ms or < 50 ms) this does
    not depend on how loaded the machine is."""
    coro = gate.answered(result, size, counted)
    try:
        coro.send(None)
    except StopIteration:
        return True
    coro.close()
    return False


def test_a_resend_waits_only_while_fresh_uploads_arrive_and_never_past_its_bound():
    async def scenario():
        gate = ResendGate(hold_s=0.4)
        # nothing fresh yet: a storm alone is answered at once
        assert at_once(gate, RESENT)
        assert gate.held_total == 0
        # fresh uploads keep arriving (every 20 ms): the re-send waits between half its bound and
        # all of it (spread, so that a storm's clients do not come back all at once), no longer
        stop = asyncio.Event()

        async def fresh_stream():
            while not stop.is_set():
                assert at_once(gate, FRESH)  # a fresh answer is never held
                await asyncio.sleep(0.02)

        feeder = asyncio.create_task(fresh_stream())
        await asyncio.sleep(0.05)
        waited = await asyncio.gather(*(timed(gate, RESENT) for _ in range(20)))
        assert all(0.2 - 0.01 <= w <= 0.4 + 10 * TICK_S for w in waited), waited  # (slack: a loaded machine)
        assert max(waited) - min(waited) > 0.05, waited  # spread
        assert gate.held_total == 20 and gate.peak == 20 and gate.held == 0
        # fresh uploads stop: held answers go once QUIET_S passed, not at their bound (30 s)
        gate.hold_s = 30.0
        pending = asyncio.gather(*(timed(gate, RESENT) for _ in range(5)))
        await asyncio.sleep(0.05)
        stop.set()
        await feeder
        waited = await pending
        assert all(w < 0.05 + 0.02 + QUIET_S + 20 * TICK_S for w in waited), waited  # not 30 s
        # an answer that stored nothing and acknowledged nothing (never reaches here in the
        # server, but must not be held either)
        gate.fresh()
        assert at_once(gate, REFUSED_OR_EMPTY)

    run(scenario())


def test_held_answers_are_capped_in_count_and_bytes_and_leave_the_admission_counts():
    async def scenario():
        admission = Admission(max_requests=8, max_bytes=10_000)
        gate = ResendGate(hold_s=0.3, max_held=4, max_held_bytes=1000, admission=admission)
        gate.fresh()

        async def admitted(size: int) -> float:
            admission.requests += 1
            admission.bytes += size
            try:
                return await timed(gate, RESENT, size, counted=True)
            finally:
                admission.requests -= 1
                admission.bytes -= size

        def admitted_at_once(size: int) -> bool:
            admission.requests += 1
            admission.bytes += size
            try:
                return at_once(gate, RESENT, size, counted=True)
            finally:
                admission.requests -= 1
                admission.bytes -= size

        # alone (no other upload being worked on), a re-send is answered at once even right
        # after a fresh one: one client sending its reports one after another waits for nothing
        assert admitted_at_once(100) and gate.held_total == 0
        admission.requests += 1  # a fresh upload being worked on
        tasks = [asyncio.create_task(admitted(100)) for _ in range(6)]
        await asyncio.sleep(0.1)
        # 4 held (the count cap), 2 answered at once; the held ones are not "being worked on"
        assert gate.held == 4 and gate.over_cap == 2 and gate.peak == 4
        assert admission.requests == 1 and admission.bytes == 0 and admission.admits(100)
        gate.fresh()
        waited = await asyncio.gather(*tasks)
        assert sorted(w > 0.14 for w in waited) == [False, False, True, True, True, True]
        assert (admission.requests, admission.bytes, gate.held, gate.held_bytes) == (1, 0, 0, 0)
        # the byte cap: 600 + 600 > 1000, so the second is answered at once
        gate.fresh()
        first = asyncio.create_task(admitted(600))
        await asyncio.sleep(0.01)
        assert admitted_at_once(600) and gate.over_cap == 3
        assert await first > 0.14

    run(scenario())


def test_zero_turns_holding_off_and_the_environment_sets_the_bounds(monkeypatch):
    async def scenario():
        gate = ResendGate(hold_s=0)
        gate.fresh()
        assert at_once(gate, RESENT) and gate.held_total == 0

    run(scenario())
    monkeypatch.setenv("DPSKETCH_RESEND_HOLD_S", "0.5")
    monkeypatch.setenv("DPSKETCH_RESEND_HOLD_MAX", "7")
    monkeypatch.setenv("DPSKETCH_RESEND_HOLD_BYTES", "123")
    gate = ResendGate.from_env()
    assert (gate.hold_s, gate.max_held, gate.max_held_bytes) == (0.5, 7, 123)
    monkeypatch.setenv("DPSKETCH_RESEND_HOLD_MAX", "-1")
    try:
        ResendGate.from_env()
    except ValueError as exc:
        assert "DPSKETCH_RESEND_HOLD_MAX" in str(exc)
    else:
        raise AssertionError("a negative cap was taken")
    assert QUIET_S > TICK_S
