"""The probe's census for an operator's Prometheus: what the engine process keeps (CensusTally,
stdlib only, one small update per census) and the series a scrape exports from its snapshots
(families(), plain values: the engine's own metrics client turns them into its metric types).

NOTE: the series (labels: the engine's own, as its own series carry them, e.g. vLLM's model_name and
engine; every series below has them)
    kvscope_probe_leaked_blocks{term}        gauge: what the last census's term names (census.py's
                                             TERMS; orphans: block tables, qcount: the counter's
                                             difference, the rest blocks); 0 = the term holds
    kvscope_probe_censuses_total             counter: censuses run and stored since the engine started
    kvscope_probe_censuses_failed_total      counter: of them, those with any term violated
    kvscope_probe_censuses_by_kind_total{kind}
                                             counter: the censuses run and stored, by kind (busy, idle,
                                             drain, crash, poll: when each runs, docs/probe.md)
    kvscope_probe_census_seconds_total       counter: the engine thread's time spent in censuses: its rate()
                                             is the probe's share of the engine thread (<= 0.01 by the
                                             census's own budget; absent where the engine does not say)
    kvscope_probe_last_census_step           gauge: the engine step of the last census
    kvscope_probe_last_census_timestamp_seconds
                                             gauge: when it ran (Unix time): its age is time() - this
    kvscope_probe_last_census_age_seconds    gauge: seconds since it ran, at the scrape (vLLM only: SGLang's
                                             series are set by the scheduler, not computed at the scrape)
    kvscope_probe_recording{reason}          gauge: 1 while the probe records; 0 once it stopped for good,
                                             `reason` its one line ("" while recording)
    kvscope_probe_up                         gauge: 1 when the engine answered the last poll for these
                                             values, 0 when it did not (the others then keep its last answer)
A series with no census yet (the census terms, step and age) is absent until the first census.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

PREFIX = "kvscope_probe_"


def term_count(value: Any) -> int:
    """A census term's size: the length of what it names, or a difference's magnitude."""
    return len(value) if hasattr(value, "__len__") else abs(int(value))


@dataclass
class CensusTally:
    """The engine's censuses so far, for its metrics (one per probe; updated on the engine's thread)."""

    num_censuses: int = 0
    num_failed: int = 0
    last_step: int | None = None
    last_unix_s: float | None = None  # NOTE: wall clock: the API server computes the age in its own process
    terms: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)  # NOTE: censuses by kind (census.CENSUS_KINDS)
    census_s: float | None = None  # NOTE: engine-thread seconds, every census's own time summed (None: not told)

    def spent(self, seconds: float) -> None:
        """A census's engine-thread time (stored or not: a live poll's too)."""
        self.census_s = (self.census_s or 0.0) + seconds

    def note(self, step: int, result: Any, terms: Iterable[str], kind: str | None = None) -> None:
        """A stored census: `result` holds each of `terms` as a field (a list, a mapping or a difference);
        a term it lacks is left out (the census's own terms decide the series)."""
        fields = {term: getattr(result, term, None) for term in terms}
        counts = {term: term_count(value) for term, value in fields.items() if value is not None}
        self.note_counts(step, counts, kind)

    def note_counts(self, step: int, counts: dict[str, int], kind: str | None = None) -> None:
        """A stored census of `kind`, as what each of its terms names."""
        if kind is not None:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.num_censuses += 1
        self.num_failed += any(counts.values())
        self.last_step, self.last_unix_s, self.terms = step, time.time(), counts

    def snapshot(self, recording: bool, reason: str | None) -> dict[str, Any]:
        """Plain values (they cross a process boundary): the tally and the recording state."""
        return {
            "censuses": self.num_censuses,
            "failed": self.num_failed,
            "last_step": self.last_step,
            "last_unix_s": self.last_unix_s,
            "terms": dict(self.terms),
            "kinds": dict(self.kinds),
            "census_s": self.census_s,
            "recording": recording,
            "reason": reason or "",
        }


class Family(NamedTuple):
    """One series family: its name (PREFIX included; a counter's without _total), type, help, and
    samples as (label values in `labels` order + extra, value)."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    extra: tuple[str, ...]  # label names after the engine's own
    samples: list[tuple[tuple[str, ...], float]]


def families(
    snapshots: Mapping[tuple[str, ...], Mapping[str, Any] | None],
    up: Mapping[tuple[str, ...], bool],
    now_unix_s: float,
) -> list[Family]:
    """The series of every engine: `snapshots` maps the engine's label values to its last snapshot
    (None: none yet), `up` says whether its last poll answered."""
    leaked = Family(f"{PREFIX}leaked_blocks", "gauge", "what the last census's term names (0: it holds)", ("term",), [])
    runs = Family(f"{PREFIX}censuses", "counter", "censuses run and stored", (), [])
    failed = Family(f"{PREFIX}censuses_failed", "counter", "censuses with a term violated", (), [])
    kinds = Family(f"{PREFIX}censuses_by_kind", "counter", "censuses run and stored, by kind", ("kind",), [])
    spent = Family(f"{PREFIX}census_seconds", "counter", "engine-thread seconds spent in censuses", (), [])
    step = Family(f"{PREFIX}last_census_step", "gauge", "the engine step of the last census", (), [])
    stamp = Family(f"{PREFIX}last_census_timestamp_seconds", "gauge", "when the last census ran (Unix time)", (), [])
    age = Family(f"{PREFIX}last_census_age_seconds", "gauge", "seconds since the last census", (), [])
    recording = Family(f"{PREFIX}recording", "gauge", "1 while the probe records; 0: stopped", ("reason",), [])
    alive = Family(f"{PREFIX}up", "gauge", "1: the engine answered the last poll", (), [])
    for labels, snap in snapshots.items():
        alive.samples.append((labels, float(up.get(labels, False))))
        if snap is None:
            continue
        runs.samples.append((labels, float(snap["censuses"])))
        failed.samples.append((labels, float(snap["failed"])))
        if snap.get("census_s") is not None:
            spent.samples.append((labels, float(snap["census_s"])))
        recording.samples.append(((*labels, str(snap["reason"])), float(bool(snap["recording"]))))
        for kind, count in sorted(snap.get("kinds", {}).items()):  # NOTE: an older probe's snapshot has none
            kinds.samples.append(((*labels, kind), float(count)))
        for term, count in sorted(snap["terms"].items()):
            leaked.samples.append(((*labels, term), float(count)))
        if snap["last_step"] is not None:
            step.samples.append((labels, float(snap["last_step"])))
            stamp.samples.append((labels, float(snap["last_unix_s"])))
            age.samples.append((labels, max(0.0, now_unix_s - float(snap["last_unix_s"]))))
    return [leaked, runs, failed, kinds, spent, step, stamp, age, recording, alive]
