"""Fresh uploads first: a re-send's answer is held back, for a bounded time, while fresh
uploads are being stored (issue 46's retry storm).

Why: after an outage every client that lost an acknowledgement sends the same reports again,
at once. Each re-send is cheap now (the writer finds its id in the report index and compares
the bytes with the stored copy), but the server still reads, parses and answers it, so a
saturated server shared its capacity fairly among every client: 8 clients sending fresh
reports beside 64 re-sending got about 8/72 of it (0.11-0.33x their calm rate,
docs/operations.md). A fair share cannot keep fresh uploads at their usual rate; the server
has to prefer fresh work.

How: a client has one request in flight per connection and sends its next re-send only once
it has the answer to the last. So holding that answer slows the client down without refusing
anything: an upload the writer acknowledged as duplicates only (``accepted`` 0: nothing new was
stored) has its 200 answer, the same body, sent after a wait while fresh uploads keep
arriving, and the storm's clients, each waiting for its answer, send ``clients / hold_s`` re-sends
a second instead of as many as the server can take. The decision is the writer's (the byte
comparison that tells a duplicate from a conflict, done in the same group as fresh uploads),
so nothing here reads the report index from the event loop (it is not thread-safe) and nothing
about the answer changes: its status and body are what they were, only later.

Bounded, so it opens no denial path:

* no answer waits longer than ``hold_s`` (``$DPSKETCH_RESEND_HOLD_S``, default 2 s; 0 turns
  this off); each waits a random time between half of it and all of it, so that the storm's
  clients, who all began at once, do not all come back at once either (a burst of 64 re-sends
  at every bound cost fresh uploads a tenth of their rate: 1 s without the spread, 0.77x calm,
  against 0.97x at 2 s; benchmarks/retry_storm.py); none waits at all when no fresh upload was acknowledged in the last
  ``QUIET_S`` or no other upload is being worked on (a storm alone, or one client sending its
  reports one after another, runs at the server's full rate: there is nothing to prefer);
  every held answer is released at once when fresh uploads stop;
* at most ``max_held`` answers (``$DPSKETCH_RESEND_HOLD_MAX``, default 4096, the default
  connection cap) and ``max_held_bytes`` of their request bodies (``$DPSKETCH_RESEND_HOLD_BYTES``,
  default 32 MiB; the body stays referenced until the answer) are held at once; past either, a
  re-send is answered at once, as before (a fair share);
* a held upload no longer counts among the uploads being worked on
  (services/admission.py): its work is done, and counting it would let a storm fill the
  admission limit with waiting answers and have fresh uploads refused 503.

What it costs a retrying client: up to ``hold_s`` more before its acknowledgement, far below
the SDK's 30 s timeout. The counts (held now, the peak, held in all, answered at once because a
cap was reached) are in GET /metrics.
"""

from __future__ import annotations

import asyncio
import heapq
from random import random
from time import monotonic

from .admission import ADMITTED_BYTES_KEY, env_limit

DEFAULT_HOLD_S = 2.0
DEFAULT_MAX_HELD = 4096
DEFAULT_MAX_HELD_BYTES = 32 << 20
#: Fresh uploads count as "arriving" for this long after the last one was acknowledged. Longer
#: than the gaps between a busy server's writer groups (a few ms to tens of ms), so that a
#: gap does not release every held answer into the fresh uploads' way.
QUIET_S = 0.25
#: How often the held answers are looked at (release when due or when fresh uploads stopped).
TICK_S = 0.05


class ResendGate:
    """The held answers of one server (one event loop; module docstring)."""

    def __init__(self, hold_s: float = DEFAULT_HOLD_S, max_held: int = DEFAULT_MAX_HELD,
                 max_held_bytes: int = DEFAULT_MAX_HELD_BYTES, admission=None):
        #: the upload admission counts (services/admission.py): whether other uploads are being
        #: worked on, and where a held one stops counting
        self.admission = admission
        self.hold_s = hold_s
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self.held = 0  # answers held now
        self.held_bytes = 0  # their request bodies
        self.peak = 0  # most answers held at once since start
        self.held_total = 0  # answers held since start
        self.over_cap = 0  # re-sends answered at once because a cap was reached
        self._last_fresh = float("-inf")
        self._waiting: list[tuple[float, int, asyncio.Future]] = []  # heap of (due, order, future)
        self._order = 0
        self._tick: asyncio.TimerHandle | None = None

    @classmethod
    def from_env(cls, admission=None) -> "ResendGate":
        return cls(env_limit("DPSKETCH_RESEND_HOLD_S", DEFAULT_HOLD_S, float),
                   env_limit("DPSKETCH_RESEND_HOLD_MAX", DEFAULT_MAX_HELD),
                   env_limit("DPSKETCH_RESEND_HOLD_BYTES", DEFAULT_MAX_HELD_BYTES), admission)

    def fresh(self) -> None:
        """An upload stored something new: fresh work is arriving."""
        self._last_fresh = monotonic()

    def busy(self) -> bool:
        """Whether a fresh upload was acknowledged within the last QUIET_S."""
        return monotonic() - self._last_fresh < QUIET_S

    def others_in_flight(self, counted: bool) -> bool:
        """Whether uploads other than this one (``counted``: this one is in the admission counts)
        are being worked on. Without admission counts: assumed so."""
        if self.admission is None:
            return True
        return self.admission.requests - (1 if counted else 0) > 0

    async def answered(self, result, size: int, counted: bool = False) -> None:
        """Before an upload's answer is sent: if it stored something new, note it; if it was
        re-sends only and fresh uploads are arriving while other uploads are being worked on,
        hold it (module docstring). ``size``: the request's body bytes; ``counted``: it is in
        the admission counts (and leaves them while it waits)."""
        if result.accepted:
            self.fresh()
            return
        if not result.duplicates or not self.hold_s or not self.busy() or not self.others_in_flight(counted):
            return
        if self.held >= self.max_held or (self.held and self.held_bytes + size > self.max_held_bytes):
            self.over_cap += 1
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._order += 1
        heapq.heappush(self._waiting, (monotonic() + self.hold_s * (0.5 + 0.5 * random()), self._order, waiter))
        if self._tick is None:
            self._tick = loop.call_later(TICK_S, self._release)
        self.held += 1
        self.held_bytes += size
        self.held_total += 1
        self.peak = max(self.peak, self.held)
        admission = self.admission if counted else None
        if admission is not None:
            admission.requests -= 1
            admission.bytes -= size
        try:
            await waiter
        finally:
            self.held -= 1
            self.held_bytes -= size
            if admission is not None:
                admission.requests += 1
                admission.bytes += size

    def _release(self) -> None:
        """Wake the answers that are due, or all of them once fresh uploads stopped."""
        self._tick = None
        waiting = self._waiting
        now = monotonic()
        everyone = not self.busy()
        while waiting and (everyone or waiting[0][0] <= now):
            waiter = heapq.heappop(waiting)[2]
            if not waiter.done():  # cancelled: the client went away
                waiter.set_result(None)
        if waiting:
            self._tick = asyncio.get_running_loop().call_later(TICK_S, self._release)


async def hold_route_answer(gate: ResendGate | None, scope, result) -> None:
    """:meth:`ResendGate.answered` for an upload a route answers: its body size as the
    admission layers left it in ``scope`` (none: it was not counted there)."""
    if gate is None:
        return
    size = scope.get(ADMITTED_BYTES_KEY)
    await gate.answered(result, size or 0, counted=size is not None)
