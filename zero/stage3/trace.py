"""The order in which units are used, and what it predicts: which partitions to prefetch, which to keep.

Prefetch: the uses of units (fetched in forward, held in backward, whether that gathers them or finds them
gathered) are recorded over one pass (root forward to the next root forward, backward included). On later
passes, each use queues async reads of the units that follow in that order (up to
stage3_prefetch_bucket_size elements, never more than stage3_max_live_parameters elements gathered or in
flight), so reads overlap compute: NVMe reads, and in an inference forward on an accelerator, copies of
host-memory partitions to it (store.prefetch). A use that leaves the recorded order stops the predictions
for the rest of the pass, and that pass's order replaces the recorded one.

Reuse (stage3_max_reuse_distance): a unit whose next use in the recorded order comes after at most that
many elements of other uses (persistent units count 0) is kept whole when its module is done with it,
instead of being freed and fetched again (a module called twice, a tied weight, the last layers turning
from forward into backward), as long as everything gathered stays within stage3_max_live_parameters.

`UseTrace` decides; the partitioner acts: it gathers and frees, and tells the trace how many elements are
gathered (`live_numel`) whenever a decision depends on it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Set

from zero.stage3.store import PartitionStore
from zero.stage3.unit import Unit

__all__ = ["PREFETCH_LOOKAHEAD", "UseTrace"]

PREFETCH_LOOKAHEAD = 64  # trace entries inspected per use: bounds the bookkeeping on the hot path


class UseTrace:
    """The recorded order of uses of `units` (the partitioner's list: units appended later are seen), with
    the prefetches and reuse decisions it implies (see the module doc)."""

    def __init__(
        self,
        units: List[Unit],
        store: PartitionStore,
        *,
        prefetch_numel: int,
        max_live_numel: int,
        max_reuse_numel: int,
    ) -> None:
        """`prefetch_numel`, `max_live_numel`, `max_reuse_numel`: the config's stage3_prefetch_bucket_size,
        stage3_max_live_parameters and stage3_max_reuse_distance (0: never keep a unit for its next use)."""
        self.units = units
        self.store = store
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.order: List[int] = []  # unit indices, one per use, of the last pass recorded
        self.valid = False  # the current pass follows `order` so far
        self.kept: Set[int] = set()  # units kept whole for a reuse the trace predicts
        self.reuse_keeps = 0  # times a unit was kept for its next use instead of freed
        self._recording: List[int] = []
        self._pos = 0  # where the current pass stands in `order`
        self._unit_pos: Dict[int, int] = {}  # unit index -> position of its latest use in this pass
        self._next_use: List[int] = []  # per position: where the same unit is used next, or -1
        self._uses_before: List[int] = []  # per position: elements of the uses before it
        self._guess_pos = 0  # first pass: the lowest unit index not used yet (`guess`)
        self._guessed: Set[int] = set()  # first pass: the units used so far

    def begin_pass(self, live_numel: int) -> None:
        """A root forward starts: the previous pass's uses become the order (when they differ from it), and
        the first units of the order are prefetched."""
        if self._recording:
            if not self.valid or self._recording != self.order:
                self._adopt(self._recording)
            self.valid = True
        self._recording = []
        self._pos = 0
        self._unit_pos.clear()
        if self.valid:
            self._prefetch_from(0, live_numel)

    def record(self, unit: Unit, live_numel: int) -> bool:
        """Record a use of `unit` and prefetch what follows it in the order. Returns True when this use just
        left the recorded order: no prediction holds for the rest of the pass, so the caller frees what was
        kept for reuse."""
        self._recording.append(unit.index)
        self._unit_pos.pop(unit.index, None)
        if not self.valid:
            return False
        pos = self._pos
        if pos < len(self.order) and self.order[pos] == unit.index:
            self._unit_pos[unit.index] = pos
            self._pos = pos + 1
            self._prefetch_from(pos + 1, live_numel)
            return False
        self.valid = False  # the order changed: stop guessing until it is recorded again
        return True

    def refill(self, live_numel: int) -> None:
        """A staging slot came free (a lent unit was released): queue the reads that follow the current
        position in the order now, instead of at the next use (or the guessed ones, see `guess`)."""
        if self.valid:
            self._prefetch_from(self._pos, live_numel)
        elif not self.order and self._guessed:
            self._prefetch(self._guesses(), live_numel)

    def guess(self, unit: Unit, live_numel: int) -> None:
        """No order is recorded yet (the first pass): after a use of `unit`, prefetch the units not used yet
        in this pass, in the order they were built - modules' registration order, which is how most
        models run them. A wrong guess costs reads that are given up when their slots are needed. Units
        that are not read from NVMe (kept in host memory by max_in_cpu, or persistent and gathered) are
        stepped over: the window of guesses must not stay anchored at one of them."""
        if self.order:
            return
        self._guessed.add(unit.index)
        n = len(self.units)
        while self._guess_pos < n and (
            self._guess_pos in self._guessed or not self._streamed(self.units[self._guess_pos])
        ):
            self._guess_pos += 1
        self._prefetch(self._guesses(), live_numel)

    def _streamed(self, unit: Unit) -> bool:
        """Whether a use of `unit` reads it (from NVMe, or copies it ahead to a GPU): worth a guess."""
        return not unit.present and self.store.prefetchable(unit)

    def _guesses(self) -> List[int]:
        end = min(len(self.units), self._guess_pos + PREFETCH_LOOKAHEAD)
        return [i for i in range(self._guess_pos, end) if i not in self._guessed]

    def keep(self, unit: Unit, live_numel: int) -> bool:
        """Whether `unit`, done with for now, should stay gathered for its next use: it comes within
        max_reuse_distance elements of other uses, and what is gathered is within max_live_parameters.
        A unit kept is counted in `kept` (until `discard`) and `reuse_keeps`."""
        pos = self._unit_pos.get(unit.index)
        if self.max_reuse_numel <= 0 or not self.valid or pos is None or pos >= len(self._next_use):
            return False
        nxt = self._next_use[pos]
        if nxt < self._pos or live_numel > self.max_live_numel:
            return False  # no later use in this pass, or over the live budget already
        if self._uses_before[nxt] - self._uses_before[self._pos] > self.max_reuse_numel:
            return False
        self.kept.add(unit.index)
        self.reuse_keeps += 1
        return True

    def discard(self, unit: Unit) -> None:
        """`unit` was freed: it is no longer kept."""
        self.kept.discard(unit.index)

    def make_room(self, live_numel: int, numel: int) -> List[Unit]:
        """The kept units to free before `numel` more elements are gathered, the one used last first, so
        that what is kept for reuse never pushes what is gathered above max_live_parameters (units in use
        are skipped; fewer are returned when freeing all the others is not enough)."""
        excess = live_numel + numel - self.max_live_numel
        if not self.kept or excess <= 0:
            return []

        def next_use(index: int) -> int:
            pos = self._unit_pos.get(index)
            nxt = self._next_use[pos] if pos is not None and pos < len(self._next_use) else -1
            return nxt if nxt >= 0 else len(self._next_use)

        out = []
        for index in sorted(self.kept, key=next_use, reverse=True):
            if excess <= 0:
                break
            u = self.units[index]
            if u.refs == 0 and not u.bwd_hold:
                excess -= u.numel
                out.append(u)
        return out

    def _adopt(self, order: List[int]) -> None:
        """Adopt a recorded order of uses; precompute each use's next use and the elements in between
        (persistent units cost nothing to reuse: they never count)."""
        self.order = order
        self._next_use = [-1] * len(order)
        last: Dict[int, int] = {}
        for pos in range(len(order) - 1, -1, -1):
            self._next_use[pos] = last.get(order[pos], -1)
            last[order[pos]] = pos
        self._uses_before = [0] * (len(order) + 1)
        total = 0
        for pos, index in enumerate(order):
            self._uses_before[pos] = total
            u = self.units[index]
            total += 0 if u.persistent else u.numel
        self._uses_before[len(order)] = total

    def _prefetch_from(self, pos: int, live_numel: int) -> None:
        """Queue reads of the units used from `pos` on, within the prefetch and live budgets."""
        self._prefetch(self.order[pos : pos + PREFETCH_LOOKAHEAD], live_numel)

    def _prefetch(self, indices: Sequence[int], live_numel: int) -> None:
        budget = self.prefetch_numel
        live = live_numel
        for index in indices[:PREFETCH_LOOKAHEAD]:
            u = self.units[index]
            if u.present or not self.store.prefetchable(u):
                continue
            if u.numel > budget or live + u.numel > self.max_live_numel:
                break
            budget -= u.numel
            live += u.numel
            if self.store.prefetching(u):
                continue
            if not self.store.prefetch(u):
                break
