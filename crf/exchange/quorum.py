"""The quorum decision of one exchange round: who takes part in round r.

Each poll lists the contributions, whose names tell each one's base round and facts digest
(:mod:`crf.exchange.contribution`), and reads the decision once it can be there. When every
replica's contribution is listed, the lowest eligible rank (on the newest base round) writes
the decision - who takes part, who is stale, each participant's contribution and facts
digest - and the others read it (a race of N conditional writes costs N - 1 refusals, each
followed by two reads). Anyone decides if it has not appeared within ``DECIDER_GRACE_S``,
and at the round deadline with at least ``min_replicas`` eligible.

With ``follow_liveness`` a round waits only for replicas that may still come: the previous
round's members, unless one has gone quiet (no contribution here and a heartbeat older than
the freshness window: it died, at the latest, soon after that round's quorum), and any other
replica whose heartbeat shows life.

:class:`QuorumDecision` holds the state of that wait as fields; what it needs of the
exchange (listing, reads, heartbeats, the lag check) comes in as a :class:`QuorumPort`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from crf.exchange.contribution import Arrival

#: when every replica has arrived, how long the others leave the lowest eligible rank to write
#: the round's quorum before deciding themselves (it may have died after arriving)
DECIDER_GRACE_S = 1.0
#: how often a replica that has not seen every contribution yet asks for the round's decision
#: (it can only be a deadline decision, which left this replica out)
DECISION_POLL_S = 1.0
#: a replica asks whether it lags the others (global/, a later decided round) only when it is
#: about to decide a round not everyone arrived for, finds itself alone in its round, or still
#: waits for arrivals this long after its own: in a round that fills at once nobody asks
LAG_CHECK_AFTER_S = 0.5
#: the previous round's members that have not arrived are asked once whether they have gone
#: quiet (their heartbeats), after this replica waited this long: in a round whose members
#: arrive together nobody reads a heartbeat
QUIET_CHECK_AFTER_S = 0.5


class Stale(Exception):
    """This replica is behind the others: it must heal to global round ``top``."""

    def __init__(self, top: int) -> None:
        self.top = top


@dataclass(frozen=True)
class QuorumPort:
    """What the decision of round r needs of the exchange, as plain callables."""

    rank: int
    world_size: int
    min_replicas: int
    follow_liveness: bool
    #: the exchange's control pool (reads, heartbeats and the lag check run there)
    control: Callable[[], ThreadPoolExecutor]
    #: the contributions listed for round r, by rank
    list_arrivals: Callable[[], dict[int, Arrival]]
    #: (eligible ranks on the newest base, stale ranks) among the arrivals
    eligible: Callable[[dict[int, Arrival]], tuple[list[int], list[int]]]
    #: the decision's bytes if it is there, else None
    read_if_there: Callable[[], bytes | None]
    #: a decision's bytes, checked for where they came from
    read_decision: Callable[[bytes], dict[str, Any]]
    #: write ``body`` if no decision exists; returns the one that stands
    write_decision: Callable[[dict[str, Any]], dict[str, Any]]
    #: the members of round r - 1 (None when not known)
    members_before: Callable[[], frozenset[int] | None]
    #: whether replica k shows a sign of life at round r - 1 or later
    shows_life: Callable[[int], bool]
    #: whether replica k, a member of round r - 1, has gone quiet: its heartbeat is older
    #: than the freshness window (or says it ended); False when unknown
    gone_quiet: Callable[[int], bool]
    #: the global round this replica lags behind, or None
    lag_behind: Callable[[], int | None]
    #: start downloads of these peers' contributions while the decision is pending (a no-op
    #: where early fetching is off)
    fetch_early: Callable[[dict[int, Arrival]], None]
    #: the facts the digests stand for (the decider's own manifest), or None
    facts: Callable[[], dict[str, Any] | None]
    #: called about once a second while waiting
    on_wait: Callable[[], None] | None
    run_id: str


class QuorumDecision:
    """The wait for round r's decision; :meth:`poll` is called until it returns True, then
    ``decided`` holds the decision."""

    def __init__(self, port: QuorumPort, r: int, mine: Arrival, deadline: float) -> None:
        now = time.monotonic()
        self.port, self.round, self.mine, self.deadline = port, r, mine, deadline
        self.decided: dict[str, Any] | None = None
        self.next_hook = now + 1.0
        # whether this replica lags the others (global/ or, with sparse checkpoints, a later
        # decided round says so) is asked concurrently with the polls: by a replica that finds
        # itself alone in the round (a straggler whose round the others left long ago), by
        # one still waiting for arrivals after LAG_CHECK_AFTER_S, and by anyone about to
        # decide a round not everyone arrived for (a deadline decision) unless its answer is
        # fresh. A replica that only reads a decision needs no answer: the decision says
        # whether it took part, and one left out checks for later rounds before catching up;
        # nor does one deciding a round every replica arrived for (see check_lag)
        self.started = now
        self.lag_check: Future[int | None] | None = None
        self.lag_asked = 0.0
        self.everyone_at: float | None = None  # when this replica first saw every replica
        # the decision is asked for on every poll once every contribution is listed (but by
        # the replica that is to write it), and otherwise once a second: before then it can
        # only be a deadline decision by the others (this replica is a straggler). A replica
        # that finds itself alone asks at once: it may be a straggler whose peers decided
        # the round without it and then dropped their contributions (file stores), which
        # takes the round's average rather than healing
        self.asked = now
        self.alone_asked = False
        # membership (follow_liveness): the arrivals whose absentees were last looked at, and
        # the absentees found alive then (waited for until they arrive or the deadline)
        self.looked_at: frozenset[int] | None = None
        self.alive: set[int] = set()
        # the previous round's members found quiet, once their heartbeats were read
        self.quiet: set[int] = set()
        self.quiet_asked = False

    def ask_lag(self) -> None:
        self.lag_check = self.port.control().submit(self.port.lag_behind)
        self.lag_asked = time.monotonic()

    def check_lag(self, deciding: bool, waiting: bool, alone: bool) -> None:
        """Raise :class:`Stale` once the lag check says this replica is behind."""
        if deciding and not waiting:
            # every contribution to round r is listed: nobody has moved past round r
            # (a replica ahead would have left it, and the GC removed its contribution;
            # a round decided without this one has its decision here, which wins)
            return
        now = time.monotonic()
        overdue = waiting and now - self.started >= LAG_CHECK_AFTER_S
        if self.lag_check is None and (deciding or alone or overdue):
            self.ask_lag()
        elif deciding and now - self.lag_asked > DECIDER_GRACE_S:
            self.ask_lag()  # stale answer: the others may have moved on since
        if self.lag_check is None or not (deciding or self.lag_check.done()):
            return
        behind = self.lag_check.result()
        if behind is not None:
            raise Stale(behind)

    def all_live_arrived(self, arrived: dict[int, Arrival]) -> bool:
        """Every replica this round waits for is here though some are not: the members
        of round r - 1 arrived or went quiet (:meth:`members_gone_quiet`), and no other
        absentee shows a sign of life (a fresh heartbeat at round r - 1 or later). The
        others' heartbeats are read only then, once per set of arrivals, so a round
        everyone arrives for costs no request more."""
        members = self.port.members_before()
        if members is None:
            return False
        here = frozenset(arrived)
        missing = members - here
        if missing and not self.members_gone_quiet(missing):
            return False
        if here != self.looked_at:
            self.looked_at = here
            absent = [k for k in range(self.port.world_size) if k not in here | missing]
            verdicts = self.port.control().map(self.port.shows_life, absent)
            self.alive = {k for k, ok in zip(absent, verdicts, strict=True) if ok}
        return not self.alive

    def members_gone_quiet(self, missing: frozenset[int]) -> bool:
        """Whether every member of round r - 1 still missing here has gone quiet: no
        contribution to this round and a heartbeat older than the freshness window. A
        replica that died after round r - 1's quorum cost that round the shard grace; by
        now its heartbeat is that old, so waiting the deadline for it again would buy
        nothing. A slow member's heartbeat goes on while it trains or waits: it stays
        fresh, and the round waits for it. Read once, after :data:`QUIET_CHECK_AFTER_S` of
        waiting: a member that dies during this round, its heartbeat still fresh, is waited
        for until the deadline, which is the one wait its death costs."""
        if not self.quiet_asked and time.monotonic() - self.started >= QUIET_CHECK_AFTER_S:
            self.quiet_asked = True
            ranks = sorted(missing)
            verdicts = self.port.control().map(self.port.gone_quiet, ranks)
            self.quiet = {k for k, quiet in zip(ranks, verdicts, strict=True) if quiet}
        return missing <= self.quiet

    def _start_read(
        self, now: float, alone: bool, complete: bool, eligible: list[int]
    ) -> Future[bytes | None] | None:
        """The read that this poll's listing calls for: a replica alone in the round asks
        once, and every replica but the one to write it once every contribution is listed."""
        port = self.port
        if (alone and not self.alone_asked) or (complete and eligible[:1] != [port.rank]):
            self.alone_asked = self.alone_asked or alone
            self.asked = now
            return port.control().submit(port.read_if_there)
        return None

    def poll(self) -> bool:
        """One poll: True once the decision stands (in ``decided``)."""
        port = self.port
        now = time.monotonic()
        # the once-a-second ask goes out next to the listing
        early_read = None
        if now - self.asked >= DECISION_POLL_S or now >= self.deadline:
            early_read = port.control().submit(port.read_if_there)
            self.asked = now
        arrived = port.list_arrivals()  # no request once every contribution is known
        eligible, stale = port.eligible(arrived)
        everyone = len(arrived) == port.world_size
        complete = everyone or (port.follow_liveness and self.all_live_arrived(arrived))
        alone = list(arrived) == [port.rank]
        reading = early_read
        if reading is None:
            reading = self._start_read(now, alone, complete, eligible)
        if port.rank in eligible:
            mine = (self.mine.base_round, self.mine.facts)
            port.fetch_early({p: a for p, a in arrived.items() if (a.base_round, a.facts) == mine})
        data = reading.result() if reading is not None else None
        if data is not None:  # a decision stands, whatever the listing says now
            self.decided = port.read_decision(data)
            return True
        if port.rank in stale:
            raise Stale(max(arrived[e].base_round or -1 for e in eligible))
        if port.on_wait is not None and time.monotonic() >= self.next_hook:
            self.next_hook = time.monotonic() + 1.0
            port.on_wait()
        late = time.monotonic() >= self.deadline
        enough = len(eligible) >= port.min_replicas
        deciding = bool((complete or late) and eligible and enough)
        if deciding and not late and eligible[0] != port.rank:
            self.everyone_at = self.everyone_at or time.monotonic()
            # the lowest eligible rank decides; read its decision
            deciding = time.monotonic() - self.everyone_at >= DECIDER_GRACE_S
        self.check_lag(deciding, waiting=not everyone, alone=alone)
        if not deciding:
            return False
        body = self.body(arrived, eligible, stale, everyone, complete)
        self.decided = port.write_decision(body)
        return True

    def body(
        self,
        arrived: dict[int, Arrival],
        eligible: list[int],
        stale: list[int],
        everyone: bool,
        complete: bool,
    ) -> dict[str, Any]:
        """The decision this replica writes."""
        bases = [arrived[e].base_round for e in eligible]
        body = {
            "round": self.round,
            "participants": eligible,
            "stale": stale,
            "base_round": max((b for b in bases if b is not None), default=None),
            "contributions": {
                str(p): {"name": arrived[p].name, "facts": arrived[p].facts} for p in eligible
            },
            # what the digests stand for, as in the decider's own manifest
            "facts": self.port.facts(),
            "decided_by": self.port.rank,
            "decided_at": time.time(),
            "run_id": self.port.run_id,
            "reason": "all arrived"
            if everyone
            else ("all live arrived" if complete else "deadline"),
        }
        if complete and not everyone:  # not waited for: dead, ended or far behind
            body["not_waited_for"] = [k for k in range(self.port.world_size) if k not in arrived]
        return body
