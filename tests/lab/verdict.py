"""What the engines' telemetry says about a chaos run: pure functions over parsed events (docs/reliability.md).

Definitions (every number the lab prints comes from here):

* A **commit** is an `outer_step` event: node, wall time `ts`, `outer_step` index, parameter `checksum`. All
  members of one committed outer step print the same index and checksum.
* A committed outer step is **lost** when the run later goes back over it:
  - a **conflict**: the same index was committed with two different checksums (a rollback that redid it from an
    older state, or two runs side by side: split brain), or
  - a **regression**: a node's own index goes back (index <= the highest it committed before, across restarts):
    the indices from the one it went back to up to that highest are lost.
  `lost` counts the distinct indices hit by either. Skipped indices (the frontier jumping by more than one) are
  reported apart: nothing that was committed went missing there.
* The **survivors** are the nodes running when the lab stops the run; their checksums **agree** when, at the
  highest index every survivor committed, they all printed one checksum.
* A **stall** is the time between two advances of the run's frontier (the highest index committed by anyone),
  and from the last advance to the stop. Time while the store was down (killed, not yet restarted) is
  excused: the goal is no stall above the limit outside those windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from lab.schedule import Fault


@dataclass(frozen=True)
class Commit:
    ts: float
    node: str
    index: int
    checksum: str
    members: tuple[str, ...]


def commits_of(events_by_node: dict[str, list[dict]]) -> dict[str, list[Commit]]:
    """Each node's commits in the order it wrote them."""
    return {node: [Commit(float(e["ts"]), node, int(e["outer_step"]), str(e["checksum"]), tuple(e.get("members", ())))
                   for e in events if e.get("type") == "outer_step"]
            for node, events in events_by_node.items()}


@dataclass
class Losses:
    conflicts: dict[int, set[str]]  # index -> the different checksums committed for it
    regressions: list[tuple[str, float, int, int]]  # (node, ts, highest before, index it went back to)
    skipped: list[int]

    @property
    def lost(self) -> set[int]:
        hit = set(self.conflicts)
        for _, _, highest, back_to in self.regressions:
            hit.update(range(back_to, highest + 1))
        return hit


def losses(commits: dict[str, list[Commit]]) -> Losses:
    seen: dict[int, set[str]] = {}
    regressions = []
    for node, mine in commits.items():
        highest = None
        for c in mine:
            seen.setdefault(c.index, set()).add(c.checksum)
            if highest is not None and c.index <= highest:
                regressions.append((node, c.ts, highest, c.index))
                highest = c.index  # one regression per going back: the redone steps after it are its own
            highest = c.index if highest is None else max(highest, c.index)
    indices = sorted(seen)
    skipped = [i for lo, hi in zip(indices, indices[1:]) for i in range(lo + 1, hi)]
    return Losses({i: s for i, s in seen.items() if len(s) > 1}, regressions, skipped)


def agreement(commits: dict[str, list[Commit]], survivors: Iterable[str]) -> tuple[bool, str]:
    """Do the survivors hold one state? (ok, one line saying at which index and with which checksums)."""
    survivors = sorted(survivors)
    if not survivors:
        return False, "no survivors"
    by_node = {n: {c.index: c.checksum for c in commits.get(n, [])} for n in survivors}
    common = set.intersection(*(set(m) for m in by_node.values()))
    if not common:
        return False, f"no outer step committed by every survivor ({', '.join(survivors)})"
    k = max(common)
    sums = {n: by_node[n][k] for n in survivors}
    if len(set(sums.values())) == 1:
        return True, f"{', '.join(survivors)} at outer step {k}: {next(iter(sums.values()))}"
    return False, f"at outer step {k}: " + ", ".join(f"{n} {s}" for n, s in sums.items())


def frontier(commits: dict[str, list[Commit]]) -> list[tuple[float, int]]:
    """(time, index) each time the highest committed index grows, in time order."""
    out: list[tuple[float, int]] = []
    for c in sorted((c for mine in commits.values() for c in mine), key=lambda c: c.ts):
        if not out or c.index > out[-1][1]:
            out.append((c.ts, c.index))
    return out


def _overlap(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in windows)


@dataclass(frozen=True)
class Stall:
    start: float
    seconds: float  # wall time without an advance
    excused: float  # of which the store was down

    @property
    def counted(self) -> float:
        return self.seconds - self.excused


def stalls(front: list[tuple[float, int]], end: float, store_down: list[tuple[float, float]]) -> list[Stall]:
    times = [t for t, _ in front] + ([end] if front and end > front[-1][0] else [])
    return [Stall(a, b - a, _overlap(a, b, store_down)) for a, b in zip(times, times[1:])]


@dataclass
class Verdict:
    faults: list[Fault]
    losses: Losses
    agree: bool
    agree_line: str
    worst: Stall | None  # the longest counted stall
    worst_raw: Stall | None  # the longest, store outages included
    stall_limit: float
    problems: list[str] = field(default_factory=list)  # from the lab: a console that crashed, an abort...
    commits: int = 0
    every: list[Stall] = field(default_factory=list)

    def by_kind(self) -> dict[str, float]:
        """The longest counted stall that overlaps each kind of fault (from its injection to its recovery)."""
        out: dict[str, float] = {}
        for f in self.faults:
            if f.start is None:
                continue
            end = max(t for t in (f.start, f.healed, f.recovered) if t is not None)
            hit = [st.counted for st in self.every if st.start < end and st.start + st.seconds > f.start]
            out[f.kind] = max([out.get(f.kind, 0.0), *hit])
        return out

    @property
    def failed_faults(self) -> list[Fault]:
        return [f for f in self.faults if f.start is not None and not f.survived]

    @property
    def skipped_faults(self) -> list[Fault]:
        return [f for f in self.faults if f.start is None]

    @property
    def reasons(self) -> list[str]:
        out = []
        if self.losses.lost:
            out.append(f"{len(self.losses.lost)} committed outer step(s) lost")
        if not self.agree:
            out.append("survivors' checksums differ")
        if self.failed_faults:
            out.append(f"{len(self.failed_faults)} fault(s) not survived")
        if self.skipped_faults:
            out.append(f"{len(self.skipped_faults)} fault(s) never injected")
        if self.worst is not None and self.worst.counted > self.stall_limit:
            out.append(f"a stall of {self.worst.counted:.1f}s exceeds {self.stall_limit:.1f}s")
        if self.commits == 0:
            out.append("no outer step was ever committed")
        return out + self.problems

    @property
    def ok(self) -> bool:
        return not self.reasons

    def lines(self, t0: float) -> list[str]:
        ran = [f for f in self.faults if f.start is not None]
        out = [f"faults injected {len(ran)} of {len(self.faults)}, survived {sum(bool(f.survived) for f in ran)}"]
        for f in self.failed_faults:
            out.append(f"  NOT SURVIVED {f.describe()}: {'; '.join(f.notes)}")
        for f in ran:  # what a fault found that is no failure (who restarted the store)
            if f.info:
                out.append(f"  {f.describe()}: {'; '.join(f.info)}")
        if self.skipped_faults:
            out.append(f"  never injected: {', '.join(f.describe() for f in self.skipped_faults)}")
        lo = self.losses
        conflicts = _some([f"{i}: {sorted(s)}" for i, s in sorted(lo.conflicts.items())])
        regress = _some([f"{n} {hi}->{back} at +{ts - t0:.1f}s" for n, ts, hi, back in lo.regressions])
        out.append(f"committed outer steps lost: {len(lo.lost)} (conflicting commits: {conflicts}; "
                   f"regressions: {regress}; skipped indices: {len(lo.skipped)})")
        out.append(f"survivors' checksums agree: {'yes' if self.agree else 'NO'} ({self.agree_line})")
        if self.worst is None:
            out.append("longest stall: - (fewer than two commits)")
        else:
            w, r = self.worst, self.worst_raw
            assert r is not None
            out.append(f"longest stall: {w.counted:.1f}s from +{w.start - t0:.1f}s (limit {self.stall_limit:.1f}s, "
                       f"store outages excused; {r.seconds:.1f}s from +{r.start - t0:.1f}s counting them)")
        kinds = self.by_kind()
        if kinds:
            out.append("longest stall by fault kind: " + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(kinds.items())))
        out.append("verdict: " + ("PASS" if self.ok else "FAIL: " + "; ".join(self.reasons)))
        return out


def _some(items: list[str], shown: int = 4) -> str:
    """A list for one report line: the first few, then how many in all."""
    if not items:
        return "none"
    more = f", ... ({len(items)} in all)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def judge(events_by_node: dict[str, list[dict]], faults: list[Fault], survivors: Iterable[str], end: float,
          store_down: list[tuple[float, float]], stall_limit: float, problems: list[str] | None = None) -> Verdict:
    commits = commits_of(events_by_node)
    every = stalls(frontier(commits), end, store_down)
    agree, line = agreement(commits, survivors)
    return Verdict(faults=faults, losses=losses(commits), agree=agree, agree_line=line,
                   worst=max(every, key=lambda s: s.counted, default=None),
                   worst_raw=max(every, key=lambda s: s.seconds, default=None), stall_limit=stall_limit,
                   problems=list(problems or []), commits=sum(len(c) for c in commits.values()), every=every)
