"""Step 2 of a round (docs/design.md, "Exchange"): the quorum, as this replica takes part
in it - listing the contributions, reading or writing the decision (the rules are
:mod:`crf.exchange.quorum`'s), checking where a decision came from, who the round waits for
(the previous round's members, absentees that show life) and whether this replica lags the
others. The owner's downloads start while the decision is pending."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future
from typing import Any

from crf import jsonsafe, layout
from crf.exchange.contribution import FACTS, Arrival, parse_contrib_name
from crf.exchange.quorum import QuorumDecision, QuorumPort
from crf.exchange.quorum import Stale as _Stale
from crf.exchange.round import AllReduceResult, QuorumTimeout, _Early, _Round
from crf.exchange.transfers import ExchangeState
from crf.store import CorruptObjectError, ObjectNotFound, StoreError, wait_until

log = logging.getLogger(__name__)


#: a heartbeat counts as a sign of life for this long, as a share of the round deadline (and
#: at most _ALIVE_MAX_S): a live replica refreshes it every second, while a dead one's is
#: at least a deadline old once the round it missed was decided
_ALIVE_SHARE = 0.6


_ALIVE_MAX_S = 30.0


class Membership(ExchangeState):
    """Step 2: who takes part in a round."""

    def _join_quorum(
        self, res: AllReduceResult, job: _Round, manifest: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[tuple[int, int], Future]]:
        """Step 2, the quorum: the round's decision (``res.participants`` set from it; empty
        when this replica is stale) and the early downloads still of use. While it is being
        decided, the contributions to the shards this replica owns in a full quorum are
        already downloaded, as each peer's object appears: the reduce step then starts with
        them at hand."""
        r = job.round
        self._phase("quorum")
        self._early = _Early(job, manifest, res)  # names: the listing's, as it grows
        decided: dict[str, Any] = {}
        try:
            decided = self._decide_quorum(res, r)
            participants = sorted(int(p) for p in decided["participants"])
            self._remember_members(r, decided)
        except _Stale as e:
            participants, res.stale_behind = [], e.top
        finally:
            early, self._early = self._early.fetches, None
        res.participants = participants
        if participants != list(range(self.world_size)) or self.rank not in participants:
            # another quorum moves ownership (or this replica reduces nothing): drop them
            for f in early.values():
                f.cancel()
            early = {}
        return decided, early

    def _decide_quorum(self, res: AllReduceResult, r: int) -> dict[str, Any]:
        """Read or create rounds/<r>/quorum.json; exactly one decision per round, returned
        (the rules are :mod:`crf.exchange.quorum`'s). Raises _Stale as soon as this replica
        sees it is behind the others (it must heal)."""
        key = layout.quorum_key(r)

        def write(body: dict[str, Any]) -> dict[str, Any]:
            if self._put(res, key, jsonsafe.dumps(body).encode(), exclusive=True):
                return body
            # someone else decided first: theirs is the decision
            return self._read_decision(r, key, self._get(res, key, 0))

        def fetch_early(peers: dict[int, Arrival]) -> None:
            # two levels: a member's parts depend on the groups, known once decided
            if self._early is not None and self.config.fetch_early and not self._two_level:
                self._fetch_early(peers)

        port = QuorumPort(
            rank=self.rank,
            world_size=self.world_size,
            min_replicas=self.config.min_replicas,
            follow_liveness=self.config.follow_liveness,
            control=self._control,
            list_arrivals=lambda: self._list_present(r),
            eligible=self._eligible,
            read_if_there=lambda: self._get_if_there(res, key, 0),
            read_decision=lambda data: self._read_decision(r, key, data),
            write_decision=write,
            members_before=lambda: self._members_before(res, r),
            shows_life=lambda k: self._shows_life(k, r),
            gone_quiet=lambda k: self._gone_quiet(k, r),
            lag_behind=lambda: self._lag_behind(r),
            fetch_early=fetch_early,
            facts=lambda: {k: self._early.manifest.get(k) for k in FACTS} if self._early else None,
            on_wait=self.hooks.on_wait,
            run_id=self.config.run_id,
        )
        deadline = time.monotonic() + self.config.round_timeout_s
        decision = QuorumDecision(port, r, self._present[r][self.rank], deadline)
        # keep polling a little past the deadline so a decision by a peer is seen
        if not wait_until(
            decision.poll,
            self.config.round_timeout_s + 1.0,
            poll_s=0.005,
            max_poll_s=self.config.max_poll_s,
        ):
            raise QuorumTimeout(
                f"round {r}: only {len(self._list_present(r))} of {self.world_size} replicas "
                f"arrived within {self.config.round_timeout_s:.0f}s (need "
                f"min_replicas={self.config.min_replicas})"
            )
        decided = decision.decided
        assert decided is not None
        if self.rank in decided.get("stale", []) and decided.get("base_round") is not None:
            raise _Stale(int(decided["base_round"]))
        return decided

    def _list_present(self, r: int) -> dict[int, Arrival]:
        """Contributions to round r in the store (complete: each is one atomic PUT), by rank,
        with what their names tell (base round, facts digest). Once all are there the folder
        is not listed again."""
        present = self._present.setdefault(r, {})
        if len(present) < self.world_size:
            for name in self.store.list(layout.contrib_dir(r)):
                arrival = parse_contrib_name(name)
                if arrival is not None and arrival.rank < self.world_size:
                    present.setdefault(arrival.rank, arrival)
        return dict(sorted(present.items()))

    @staticmethod
    def _eligible(arrived: dict[int, Arrival]) -> tuple[list[int], list[int]]:
        """Split arrivals into (eligible, stale): a replica whose weights are based on an
        older global round than the others missed a commit and must heal, not contribute."""
        bases = {k: a.base_round for k, a in arrived.items()}
        known = [b for b in bases.values() if b is not None]
        if not known:
            return sorted(arrived), []
        top = max(known)
        eligible = sorted(k for k, b in bases.items() if b is None or b == top)
        return eligible, sorted(set(arrived) - set(eligible))

    def _fetch_early(self, peers: dict[int, Arrival]) -> None:
        """Start downloading the parts of the shards this replica owns in a full quorum from
        every peer whose contribution is here and matches this replica's (same base round
        and facts digest): with everyone in the quorum they are exactly what the reduce step
        reads, and until then they only cost their download."""
        early = self._early
        assert early is not None
        job = early.job
        for p, arrival in peers.items():
            if p == self.rank:
                continue
            job.names[p] = arrival.name
            for s in range(self.rank, self.config.num_shards, self.world_size):
                if (p, s) not in early.fetches:
                    early.fetches[(p, s)] = self._pool().submit(
                        self._fetch_contrib,
                        early.res,
                        job,
                        p,
                        s,
                        0.0,
                    )

    def _read_decision(self, r: int, key: str, data: bytes) -> dict[str, Any]:
        """Round r's quorum.json, checked for where it came from: this run, round r, and
        participants that are ranks of this run, each with its own contribution (whose name
        carries the rank, and the digest of run, layout, wire and shards that
        ``_check_layouts`` compares). A decision copied from another run or round, or
        unreadable, is never followed: it holds the round's one create-if-absent key, so no
        good decision can replace it, and the round fails for everyone alike
        (``failed.json``, as for a bad reduced shard), reported as rejected."""
        problems = []
        try:
            decided = json.loads(data)
        except ValueError as e:
            decided, problems = {}, [f"unreadable ({e})"]
        if not isinstance(decided, dict):
            decided, problems = {}, ["not a json object"]
        if not problems:
            if decided.get("run_id") != self.config.run_id:
                problems.append(f"run {decided.get('run_id')!r}, not {self.config.run_id!r}")
            if decided.get("round") != r:
                problems.append(f"round {decided.get('round')!r}, not {r}")
            parts = decided.get("participants")
            contributions = decided.get("contributions")
            if not isinstance(parts, list) or not isinstance(contributions, dict):
                problems.append("no participants or contributions")
            else:
                for p in parts:
                    c = contributions.get(str(p))
                    name = c.get("name") if isinstance(c, dict) else None
                    arrival = parse_contrib_name(name) if isinstance(name, str) else None
                    if not (isinstance(p, int) and 0 <= p < self.world_size) or (
                        arrival is None or arrival.rank != p
                    ):
                        problems.append(f"participant {p!r} is not a rank with a contribution")
                        break
        if problems:
            msg = f"{key}: not this run's decision of round {r} ({'; '.join(problems)})"
            log.warning("rejected %s", msg)
            raise self._fail_round(r, f"bad quorum: {msg}", key, msg)
        return decided

    def _remember_members(self, r: int, decided: dict[str, Any]) -> None:
        """Keep who arrived for decided round r (participants and stale ones): the members
        round r + 1 waits for unless one has gone quiet (:meth:`_gone_quiet`)."""
        try:
            members = frozenset(int(p) for p in decided.get("participants", [])) | frozenset(
                int(p) for p in decided.get("stale", [])
            )
        except (TypeError, ValueError):
            members = None
        self._members = {k: v for k, v in self._members.items() if k >= r - 1}
        self._members_read = {k for k in self._members_read if k >= r - 1}
        self._members[r] = members

    def _members_before(self, res: AllReduceResult, r: int) -> frozenset[int] | None:
        """Who arrived for round r - 1 (its decision: this replica's memory, else one read);
        None when unknown (round 0, or a decision garbage-collected or never made): then
        round r waits for everyone, as it would without ``follow_liveness``."""
        if r == 0:
            return None
        if r - 1 not in self._members:
            self._members_read.add(r - 1)  # not seen by this process: see _gone_quiet
            data = self._get_if_there(res, layout.quorum_key(r - 1), 0)
            decided: Any = None
            if data is not None:
                try:
                    decided = json.loads(data)
                except ValueError:
                    decided = None
            if isinstance(decided, dict) and decided.get("run_id") in (None, self.config.run_id):
                self._remember_members(r - 1, decided)
            else:
                self._members[r - 1] = None
        return self._members.get(r - 1)

    def _shows_life(self, k: int, r: int) -> bool:
        """Whether replica k, which was no member of round r - 1, is to be waited for in
        round r: its heartbeat is younger than ``alive_window_s`` and says it is at round
        r - 1 or later (a restart that resumed, a straggler one round behind that will catch
        up, a replica that healed). A dead replica's heartbeat stops; one far behind says an
        older round; one that ended says so in its phase. An unreadable store answers yes:
        waiting is what a round did before liveness was followed."""
        try:
            beat = json.loads(self.store.get(layout.heartbeat_key(k)))
        except ObjectNotFound:
            return False
        except (ValueError, CorruptObjectError):
            return False
        except (StoreError, OSError) as e:
            log.debug("round %d: cannot read replica %d's heartbeat (%s): waiting for it", r, k, e)
            return True
        if not isinstance(beat, dict) or "exchange_round" not in beat:
            return False
        record = layout.Heartbeat.from_dict(beat)
        if record.phase in ("done", "failed"):
            return False
        at, updated = record.exchange_round, record.updated_at
        if isinstance(at, bool) or not isinstance(at, int):
            return False
        if isinstance(updated, bool) or not isinstance(updated, int | float):
            return False
        return at >= r - 1 and time.time() - updated <= self.alive_window_s

    def _gone_quiet(self, k: int, r: int) -> bool:
        """Whether replica k, a member of round r - 1 with no contribution to round r, has
        gone quiet: its process was last heard from (``Heartbeat.seen_at``: its news, or the
        beats that keep it alive through one long step, a generation or an evaluation of
        minutes) longer than ``alive_window_s`` ago. A live replica is heard from every few
        seconds, so only a dead (or cut off) one ages past the window; a hung one that is
        still heard from is waited for until the deadline, once.

        A member known only from the store (this process did not see round r - 1: a
        restart, or every replica of a resumed launch) whose last sign is older than this
        process's start may be starting too, as slowly as this one did: it is waited for,
        at most the deadline. A heartbeat that is missing, unreadable or without a time
        answers no: the member is waited for, as it was before heartbeats were asked."""
        try:
            beat = json.loads(self.store.get(layout.heartbeat_key(k)))
        except (ObjectNotFound, ValueError, CorruptObjectError, StoreError, OSError) as e:
            log.debug("round %d: cannot read member %d's heartbeat (%s): waiting for it", r, k, e)
            return False
        if not isinstance(beat, dict):
            return False
        times = [beat.get("updated_at"), beat.get("alive_at")]
        times = [t for t in times if isinstance(t, int | float) and not isinstance(t, bool)]
        if not times:
            return False
        seen = max(times)
        if r - 1 in self._members_read and seen < self.started_at:
            return False
        return time.time() - seen > self.alive_window_s

    def _lag_behind(self, r: int) -> int | None:
        """The global round this replica must heal to if the others are past round r."""
        newest = self._newest_global()
        if newest is not None and newest >= r:
            # round r was committed already and its folder garbage-collected: this replica
            # lags the others by more than keep_rounds (a straggler). A quorum decided now
            # would fork the weights; catch up instead.
            return newest
        if self.config.checkpoint_period > 1:
            # global/ is written only every few rounds: a later decided round shows just as
            # well that this replica lags the others
            return self._later_decided_round(r)
        return None

    def _later_decided_round(self, r: int) -> int | None:
        """If a round after r has a quorum (the others moved past r), the round before it:
        the global round this replica must at least heal to. None otherwise."""
        later = sorted(layout.round_numbers(self.store), reverse=True)
        for k in later:
            if k <= r:
                break
            if self.store.object_exists(layout.quorum_key(k)):
                return k - 1
        return None

    def _newest_global(self) -> int | None:
        rounds = layout.global_rounds(self.store)
        return rounds[-1] if rounds else None
