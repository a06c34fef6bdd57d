"""`kvscope report leaks` and `kvscope check`: explain a capture's leaks after the fact.

From a `full` capture the ledger is rebuilt event by event; each leak names the pool, the
slots, the request that last owned them (and its principal), the step and event that
allocated them, and the step the free should have come (the request's end). The onset is
the first step at which the ledger's invariant series breaks, found by bisection. A
`summary` capture has no slot indices: the report says so and works from the leak checks
and the requests table (onset, suspect requests).

NOTE: a replay costs ~6-11 µs of CPU per event (more as a run grows; bench_replay), too slow
to redo on every dashboard view of a million-event capture (or for `check` on a 100-million-event
one: about an hour). `kvscope run` therefore stores the report in the capture when the run closes
(`save_report`); `stored_report` returns it only while it still describes the run (the run is no
longer running, the report covers its last event, its last step and the same leak checks, and this
version built it).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, NamedTuple

import pandas as pd

from kvscope import __version__
from kvscope.debug.ledger import HOST_COPY, REQUEST, Holding, Ledger
from kvscope.debug.replay import EventsDropped, ProgressHook, Replay
from kvscope.telemetry import ENDED_WITHOUT_CLOSING, Capture, EventKind, RunStatus, decode_slots
from kvscope.telemetry import save_report as _store_report

REPORT_KIND = "leaks"
PRODUCER = f"kvscope {__version__} / leak report 2"  # a stored report from another producer is rebuilt

PROBE_NOTE = (
    "recorded inside the engine by kvscope's probe: its idle census checks every block's ref count "
    "against the scheduler's block tables and names the request that last took a leaked block; the "
    "engine's ref-counted blocks are not replayed through kvscope's slot ledger"
)
PAGE_PROBE_NOTE = (
    "recorded inside the engine by kvscope's probe: its idle page census checks that every page is "
    "exactly one of free, in the tree, or in a live request's row, and names the request that last "
    "took a leaked page; the engine's pages are not replayed through kvscope's slot ledger"
)
SUMMARY_NOTE = (
    "recorded at level summary: the capture holds no slot indices, so this report works from the "
    "leak checks and the requests table only (record with --level full for slots and culprits)"
)


class LeakKind(StrEnum):
    """What the ledger found wrong; the value is what reports and `--json` print."""

    ORPHANED = "orphaned"  # slots nobody holds and nobody freed
    DOUBLE_FREE = "double-free"
    LOCK_NEVER_RELEASED = "lock-never-released"  # a node lock whose request ended
    COPY_NEVER_ACKNOWLEDGED = "copy-never-acknowledged"  # a host-tier copy still in flight at an idle point
    USE_AFTER_FREE = "use-after-free"


# NOTE: a leak the ledger finds in a run that stopped mid-step may be a free still pending in
# that step (frees are grouped per step); these kinds are single events, certain wherever they are
DEFINITE_KINDS = (LeakKind.DOUBLE_FREE, LeakKind.USE_AFTER_FREE)


def certain(report: LeakReport, leak: Leak) -> bool:
    """A leak the run's end cannot explain: the run finished, the kind is a single wrong event, or
    the free was due before the run's last sampled step (a whole step ended after it, with no free)."""
    if report.finished or leak.kind in DEFINITE_KINDS:
        return True
    return leak.free_due_step is not None and report.last_step is not None and leak.free_due_step < report.last_step


READ_RIDS = 500  # requests read at once by rid (an IN list: SQLite's bound variables are limited)
CHECK_EXIT_CODES = {"clean": 0, "leak": 1, "inconclusive": 3}  # kvscope check's (2: unreadable, from the CLI)
_STOPPED = {
    RunStatus.RUNNING.value: "the run is still running",
    RunStatus.INTERRUPTED.value: "the run was interrupted",
    RunStatus.CRASHED.value: "the run crashed",
    RunStatus.INCOMPLETE.value: "the capture is incomplete",
    ENDED_WITHOUT_CLOSING: "the run ended without closing its capture (its process died)",
}


class Verdict(NamedTuple):
    """`kvscope check`'s verdict on a report: clean (exit 0), leak (1) or inconclusive (3)."""

    verdict: Literal["clean", "leak", "inconclusive"]
    exit_code: int
    reason: str  # one line


@dataclass
class Leak:
    kind: LeakKind  # a plain string (a stored report's) becomes its LeakKind; an unknown one is a ValueError
    pool: str
    slots: list[int]
    rid: str | None = None
    principal: str | None = None
    allocated_step: int | None = None
    allocated_event: int | None = None
    free_due_step: int | None = None  # the request's end, or when the node left the tree: the free that never came
    node_id: int | None = None
    detail: str = ""
    event: int = -1  # the event that exposes it: leaks are listed in this order
    consequence_of: int | None = None  # 1-based index of an earlier leak touching the same slots

    def __post_init__(self) -> None:
        self.kind = LeakKind(self.kind)


@dataclass
class LeakReport:
    capture: str
    run_id: int
    level: str
    status: str
    checks_run: int = 0
    first_failure_step: int | None = None
    first_failure: list[str] = field(default_factory=list)
    last_failure_step: int | None = None  # the last failing idle point (a probe's census names what is wrong now)
    last_failure: list[str] = field(default_factory=list)
    last_clean_step: int | None = None
    onset_step: int | None = None
    leaks: list[Leak] = field(default_factory=list)
    suspects: list[str] = field(default_factory=list)
    injected: list[dict[str, Any]] = field(default_factory=list)
    note: str | None = None
    through_seq: int = -1  # the last event the ledger replayed
    stored_at: float | None = None  # unix seconds, when read back from the capture
    error: str | None = None  # the run's one-line error (crashed, interrupted, incomplete)
    last_step: int | None = None  # the run's last step with a usage sample
    attached: str | None = None  # an attached engine's run ("vllm 0.32.0"): its leaks are not kvscope's to see
    probe: str | None = None  # a probe's run inside a real engine ("vllm 0.32.0"): its verdict is its census
    # NOTE: every block (page) a probe's census named at the first and the last failing step (census_blocks;
    # its checks' messages name a few): step, term, block, ref, accounted, taker and releaser ({rid, step, event})
    census_blocks: list[dict[str, Any]] = field(default_factory=list)
    censuses: dict[str, int] = field(default_factory=dict)  # a probe's censuses by kind (busy, idle, drain, poll)
    unchecked: int = 0  # a probe's requests that finished after its last census (no census saw their end)
    # NOTE: retention (docs/captures.md): the run's events before seq dropped_events (step dropped_before_step)
    # are gone; the ledger resumed from its checkpoint (resumed_from: its last event), or could not
    # (events_missing: why; no verdict comes from the ledger then)
    dropped_events: int = 0
    dropped_before_step: int | None = None
    resumed_from: int | None = None
    events_missing: str | None = None

    @property
    def clean(self) -> bool:
        """Nothing found: no leak and no failed check. Not a verdict: see `verdict()`, which also
        asks that the run finished and reached an idle check."""
        return not self.leaks and self.first_failure_step is None

    @property
    def finished(self) -> bool:
        return self.status == RunStatus.FINISHED

    @property
    def root_leaks(self) -> list[Leak]:
        """The leaks that are not consequences of an earlier one."""
        return [leak for leak in self.leaks if leak.consequence_of is None]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=int)

    @classmethod
    def from_json(cls, text: str) -> LeakReport:
        fields = json.loads(text)
        fields = {name: value for name, value in fields.items() if name in cls.__dataclass_fields__}
        fields["leaks"] = [Leak(**leak) for leak in fields.get("leaks", [])]
        return cls(**fields)


def _slots_text(slots: list[int], limit: int = 12) -> str:
    head = ", ".join(map(str, slots[:limit]))
    return f"[{head}{f', … +{len(slots) - limit} more' if len(slots) > limit else ''}]"


def run_row(capture: Capture, run_id: int | None) -> Any:
    """The run's row of `capture.runs()` (default: the latest); ValueError naming the runs there are."""
    runs = capture.runs()
    if runs.empty:
        raise ValueError(f"{capture.name}: the capture holds no runs")
    if run_id is None:
        return runs.iloc[-1]
    chosen = runs[runs.id == run_id]
    if chosen.empty:
        raise ValueError(f"{capture.name}: no run {run_id} (runs: {', '.join(map(str, runs.id))})")
    return chosen.iloc[0]


def attached_source(run: Any, kind: str = "attach") -> str | None:
    """ "<engine> <version>" when the run is a `kvscope attach` recording of a real engine (kind
    "attach") or a recording of the probe inside one (kind "probe"), else None."""
    try:
        source = json.loads(run.config or "{}").get("source")
    except (TypeError, ValueError, AttributeError):
        return None
    if not isinstance(source, dict) or source.get("kind") != kind:
        return None
    return " ".join(str(part) for part in (source.get("engine") or "engine", source.get("version")) if part)


@dataclass
class ReportState:
    """What a report of a growing capture carries from one build to the next: the paused replay
    and the 'broken so far' series of the steps it completed."""

    replay: Replay
    series: list[tuple[int, bool]] = field(default_factory=list)

    def after_step(self, step: int, ledger: Ledger) -> None:
        self.series.append((step, bool(self.series and self.series[-1][1]) or ledger.is_broken()))


def build_report(
    target: str | Path,
    run_id: int | None = None,
    *,
    on_progress: ProgressHook | None = None,
    state: ReportState | None = None,
) -> LeakReport:
    """`on_progress(events)` follows the ledger replay of a full capture, batch by batch. With
    `state` (kept by the caller, for one run), only the events after its last one are replayed."""
    capture = Capture(target)
    try:
        run = run_row(capture, run_id)
        report = LeakReport(
            capture.name,
            int(run.id),
            str(run.level),
            str(run.display_status),
            error=_text(run.error),
            attached=attached_source(run),
            probe=attached_source(run, "probe"),
        )
        if report.status != RunStatus.RUNNING:
            capture.check_pages()  # NOTE: a verdict (clean included) is read from this file: all of it must be sound
        checks = capture.leak_checks(report.run_id)
        _from_checks(report, checks)
        _from_census_blocks(report, capture)
        _from_retention(report, capture)
        last_step = capture.step_range(report.run_id).hi.iloc[0]
        report.last_step = None if pd.isna(last_step) else int(last_step)
        if report.level != "full" or report.probe is not None:
            requests = capture.requests(report.run_id)
            if report.probe is not None:
                _census_coverage(report, checks, requests)
            report.note = SUMMARY_NOTE if report.probe is None else PAGE_PROBE_NOTE if _pages(report) else PROBE_NOTE
            report.onset_step = report.first_failure_step
            report.suspects = _suspects(requests, report)
            return report
        if state is None or state.replay.run_id != report.run_id:
            state = ReportState(Replay(report.run_id))
        _from_ledger(report, capture, on_progress, state)
        return report
    finally:
        capture.close()


def checks_report(target: str | Path, run_id: int | None = None, capture: Capture | None = None) -> LeakReport:
    """The report of a run that has not finished, from its leak checks alone (no ledger replay:
    cheap on a live run; its verdict is a leak or inconclusive, never clean). A finished run at
    level full gets the whole report (build_report): only the ledger can say it is clean.
    `capture`: `target` already open, read through and left open (the dashboard's, so a live page's
    every refresh does not open and check the file again)."""
    own = capture is None
    capture = Capture(target) if capture is None else capture
    try:
        run = run_row(capture, run_id)
        if str(run.display_status) == RunStatus.FINISHED and str(run.level) == "full":
            return build_report(target, int(run.id))
        report = LeakReport(
            capture.name,
            int(run.id),
            str(run.level),
            str(run.display_status),
            error=_text(run.error),
            attached=attached_source(run),
        )
        _from_checks(report, capture.leak_checks(report.run_id))
        _from_census_blocks(report, capture)
        last_step = capture.step_range(report.run_id).hi.iloc[0]
        report.last_step = None if pd.isna(last_step) else int(last_step)
        return report
    finally:
        if own:
            capture.close()


def save_report(target: str | Path, report: LeakReport) -> None:
    """Store the report in the capture, replacing an older one of the same run."""
    report.stored_at = None
    _store_report(target, report.run_id, REPORT_KIND, report.through_seq, PRODUCER, report.to_json())


def stored_report(capture: Capture, run_id: int) -> LeakReport | None:
    """The report stored with the run, if it still describes it (see the NOTE above): built by this
    version, the run closed, through the run's last event, at its last step and over the same leak
    checks. None otherwise (the caller replays): a stale or unreadable report is never read."""
    row = capture.stored_report(run_id, REPORT_KIND)
    if row is None or row.producer != PRODUCER:
        return None
    runs = capture.runs()
    run = runs[runs.id == run_id]
    if run.empty or run.iloc[0].display_status == "running" or row.through_seq != capture.last_event_seq(run_id):
        return None
    capture.check_pages()  # NOTE: a stored verdict reads no event: a page damaged since must still be seen
    try:
        report = LeakReport.from_json(row.body)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None  # a damaged body: the caller rebuilds
    if report.run_id != run_id or report.through_seq != row.through_seq:
        return None
    last_step = capture.step_range(run_id).hi.iloc[0]
    last_step = None if pd.isna(last_step) else int(last_step)
    if report.last_step is None:  # NOTE: a report stored before it had last_step: as build_report reads it
        report.last_step = last_step
    elif report.last_step != last_step:
        return None
    if _checks_summary(report) != _checks_summary(_checks_only(capture, run_id)):
        return None  # leak checks written (or changed) after it was built
    report.capture = capture.name  # NOTE: the file's name now (it may have been stored under another)
    report.stored_at = float(row.built_at)
    report.status = str(run.iloc[0].display_status)
    report.error = _text(run.iloc[0].error)
    return report


def _checks_only(capture: Capture, run_id: int) -> LeakReport:
    report = LeakReport(capture.name, run_id, "", "")
    _from_checks(report, capture.leak_checks(run_id))
    return report


def _checks_summary(report: LeakReport) -> tuple[Any, ...]:
    """What a report reads from the run's leak checks (_from_checks)."""
    return (
        report.checks_run,
        report.first_failure_step,
        report.first_failure,
        report.last_failure_step,
        report.last_failure,
        report.last_clean_step,
    )


def _text(value: Any) -> str | None:
    """A nullable text cell as str or None (pandas reads SQL NULL as None or NaN)."""
    return None if value is None or pd.isna(value) or value == "" else str(value)


def _from_checks(report: LeakReport, checks: pd.DataFrame) -> None:
    report.checks_run = int(checks.step.nunique()) if not checks.empty else 0
    failed = checks[~checks.ok.astype(bool)]
    if not failed.empty:
        step = int(failed.step.min())
        report.first_failure_step = step
        report.first_failure = [str(m) for m in failed[failed.step == step].message]
        report.last_failure_step = last = int(failed.step.max())
        report.last_failure = [str(m) for m in failed[failed.step == last].message]
        before = checks[checks.step < step]
        report.last_clean_step = int(before.step.max()) if not before.empty else None
    elif not checks.empty:
        report.last_clean_step = int(checks.step.max())


def _from_retention(report: LeakReport, capture: Capture) -> None:
    kept = capture.run_retention(report.run_id)
    if kept is not None and int(kept.first_seq) > 0:
        report.dropped_events = int(kept.first_seq)
        report.dropped_before_step = int(kept.first_step)


def _from_census_blocks(report: LeakReport, capture: Capture) -> None:
    """The blocks the census named at the first and the last failing step, every one of them."""
    steps = {report.first_failure_step, report.last_failure_step} - {None}
    if not steps:
        return
    blocks = capture.census_blocks(report.run_id)
    report.census_blocks = [_census_block(row) for row in blocks[blocks.step.isin(steps)].itertuples()]


def _census_block(row: Any) -> dict[str, Any]:
    def who(prefix: str) -> dict[str, Any] | None:
        step = getattr(row, f"{prefix}_step")
        if step is None or pd.isna(step):
            return None
        return {
            "rid": _text(getattr(row, f"{prefix}_rid")),
            "step": int(step),
            "event": _text(getattr(row, f"{prefix}_event")),
        }

    def count(value: Any) -> int | None:
        return None if value is None or pd.isna(value) else int(value)

    return {
        "step": int(row.step),
        "term": str(row.term),
        "block": int(row.block),
        "ref": count(row.ref),
        "accounted": count(row.accounted),
        "taker": who("taker"),
        "releaser": who("releaser"),
    }


def _census_coverage(report: LeakReport, checks: pd.DataFrame, requests: pd.DataFrame) -> None:
    """A probe's censuses by kind, and the requests that finished after the last one (a census at the
    end of step S sees every request finished by then)."""
    if checks.empty:
        report.unchecked = len(requests)
        return
    kinds = checks.drop_duplicates("step")["census"] if "census" in checks else pd.Series(dtype=object)
    if kinds.notna().any():  # NOTE: a probe that names no census kind (an older capture) checked at idle points
        report.censuses = {str(k): int(n) for k, n in kinds.fillna("idle").value_counts().items()}
    if not requests.empty and "finish_step" in requests:
        report.unchecked = int((requests.finish_step > int(checks.step.max())).sum())


def _suspects(requests: pd.DataFrame, report: LeakReport) -> list[str]:
    """Requests that ended after the last clean check and by the first failing one."""
    if report.first_failure_step is None or requests.empty:
        return []
    lo = report.last_clean_step if report.last_clean_step is not None else -1
    ended = requests[(requests.finish_step > lo) & (requests.finish_step <= report.first_failure_step)]
    return [str(r) for r in ended.rid]


def _from_ledger(report: LeakReport, capture: Capture, on_progress: ProgressHook | None, state: ReportState) -> None:
    with state.replay.lock:
        try:
            state.replay.advance(capture, state.after_step, on_progress=on_progress)
        except EventsDropped as dropped:
            report.events_missing = str(dropped)
            report.dropped_before_step = dropped.first_step
            return
        ledger, current = state.replay.ledger, state.replay.current
        report.resumed_from = state.replay.resumed_from
        onset_before = state.replay.onset_before
        series = [(onset_before, True)] if onset_before is not None else []
        series += state.series
        if current is not None:  # the last step, as far as the capture goes
            series.append((current, bool(series and series[-1][1]) or ledger.is_broken()))
        report.onset_step = _bisect_onset(series)
        report.through_seq = ledger.last_seq
        report.leaks = _link_consequences(_leaks(ledger))
    _name_principals(capture, report.run_id, report.leaks)
    injected = capture.events(report.run_id, kinds=[EventKind.INJECT], limit=100_000)
    report.injected = [
        {
            "kind": r.reason,
            "rid": _text(r.rid),
            "step": int(r.step),
            "slots": decode_slots(r.slots),
            "node_id": None if r.node_id != r.node_id else r.node_id,
        }
        for r in injected.itertuples()
    ]


def _bisect_onset(series: list[tuple[int, bool]]) -> int | None:
    """First step whose ledger is broken; bisection over the 'broken so far' series."""
    ever, broken = [], False
    for _, flag in series:
        broken = broken or flag
        ever.append(broken)
    index = bisect.bisect_left(ever, True)
    return series[index][0] if index < len(series) else None


def _link_consequences(leaks: list[Leak]) -> list[Leak]:
    """Order by the exposing event; a leak whose slots an earlier leak touched is its consequence
    (after a slot is freed under a reader, the reader's own free and other readers follow)."""
    leaks = sorted(leaks, key=lambda leak: leak.event)
    touched: dict[tuple[str, int], int] = {}
    for index, leak in enumerate(leaks, 1):
        earlier = [touched[(leak.pool, s)] for s in leak.slots if (leak.pool, s) in touched]
        if earlier:
            leak.consequence_of = min(earlier)
        for slot in leak.slots:
            touched.setdefault((leak.pool, slot), index)
    return leaks


def _ended_step(ledger: Ledger, rid: str | None) -> int | None:
    if rid is None or ledger.rid_index.get(rid) not in ledger.ended:
        return None
    return ledger.ended[ledger.rid_index[rid]][1]


def _orphan_detail(ledger: Ledger, hold: Holding) -> str:
    if hold.owner == REQUEST:
        if hold.rid is None:
            return "allocated for no request and never claimed by a node"
        how = ledger.ended.get(ledger.rid_index.get(hold.rid, -1), ("gone", None))[0]
        return f"held by request {hold.rid}, which {how}"
    when = "" if hold.gone_step is None else f" at step {hold.gone_step}"
    if hold.owner == HOST_COPY:
        return f"held by node {hold.node_id}'s host copy, which left the tree{when} without being freed"
    return (
        f"held by node {hold.node_id}, which is no longer in the tree (it left{when})"
        if when
        else f"held by node {hold.node_id}, which is no longer in the tree"
    )


def _name_principals(capture: Capture, run_id: int, leaks: list[Leak]) -> None:
    """Each leak's principal: its request's (a copy op's leak has none). NOTE: only the requests the
    leaks name are read (a 100 M-event run has millions of requests), in batches of READ_RIDS."""
    named = [leak for leak in leaks if leak.kind != LeakKind.COPY_NEVER_ACKNOWLEDGED]
    wanted = sorted({leak.rid or "" for leak in named})
    people: dict[str, Any] = {}
    for start in range(0, len(wanted), READ_RIDS):
        rows = capture.request_rows(run_id, rids=wanted[start : start + READ_RIDS], columns=["rid", "principal"])
        people.update(zip(rows.rid, rows.principal, strict=True))
    for leak in named:
        leak.principal = people.get(leak.rid or "")


def _leaks(ledger: Ledger) -> list[Leak]:
    """The ledger's defects as leaks, their principals not named yet (_name_principals)."""
    leaks = []
    for hold in ledger.orphans():
        due = _ended_step(ledger, hold.rid) if hold.owner == REQUEST else hold.gone_step
        leaks.append(
            Leak(
                LeakKind.ORPHANED,
                hold.pool,
                hold.slots,
                hold.rid,
                None,
                hold.step,
                hold.seq,
                due,
                hold.node_id,
                _orphan_detail(ledger, hold),
                event=hold.seq,
            )
        )
    for twice in ledger.double_frees:
        leaks.append(
            Leak(
                LeakKind.DOUBLE_FREE,
                twice.pool,
                twice.slots,
                twice.rid,
                None,
                detail=f"freed again at step {twice.step} (event #{twice.seq}); first freed at step "
                f"{twice.first_step} (event #{twice.first_seq})",
                event=twice.seq,
            )
        )
    for held in ledger.locks_of_ended_requests():
        slots = ledger.node_slots.get(held.node_id)
        if held.op:
            detail = (
                f"node {held.node_id} locked by copy op {held.op} at step {held.step} (event #{held.seq}) "
                "and never unlocked, though the op is no longer in flight: its tokens stay protected"
            )
        else:
            detail = (
                f"node {held.node_id} locked at step {held.step} (event #{held.seq}) "
                "and never unlocked: its tokens stay protected"
            )
        leaks.append(
            Leak(
                LeakKind.LOCK_NEVER_RELEASED,
                "full",
                [] if slots is None else slots.tolist(),
                held.rid,
                None,
                held.step,
                held.seq,
                _ended_step(ledger, held.rid),
                held.node_id,
                detail,
                event=held.seq,
            )
        )
    for stuck in ledger.stuck_ops:
        copy, node = stuck.copy, stuck.copy.node_id
        pool, copies = ("host", ledger.host_copies) if copy.kind == "write" else ("full", ledger.node_slots)
        slots = copies.get(node) if node is not None else None
        leaks.append(
            Leak(
                LeakKind.COPY_NEVER_ACKNOWLEDGED,
                pool,
                [] if slots is None else slots.tolist(),
                None,
                None,
                copy.step,
                copy.seq,
                stuck.idle_step,
                node,
                f"{copy.kind} op {stuck.op} of node {node} ({copy.num_tokens} tokens) was still in "
                f"flight at the idle point of step {stuck.idle_step} (event #{stuck.idle_seq}), where "
                "every copy is acknowledged",
                event=stuck.idle_seq,
            )
        )
    for read in ledger.bad_reads:  # the culprit is whoever freed the slots while they were still in use
        reader = "it" if read.reader == read.freer else f"request {read.reader}"
        leaks.append(
            Leak(
                LeakKind.USE_AFTER_FREE,
                "full",
                read.slots,
                read.freer,
                None,
                detail=f"freed at step {read.free_step} (event #{read.free_seq}) while still in use; "
                f"{reader} read it at step {read.step} (event #{read.seq}), position {read.position}",
                event=read.free_seq,
            )
        )
    return leaks


def render_text(report: LeakReport, max_leaks: int | None = None) -> str:
    """The report as text; `max_leaks` lists only the first leaks, then says how many more."""
    lines = [f"capture {report.capture} — run {report.run_id}, level {report.level}, {report.status}"]
    if report.error:
        lines.append(f"error: {report.error}")
    if report.note:
        lines.append(f"note: {report.note}")
    lines += _checks_lines(report)
    lines += _retention_lines(report)
    if report.onset_step is not None:
        clean = f"; last clean check at step {report.last_clean_step}" if report.last_clean_step is not None else ""
        lines.append(f"onset: step {report.onset_step} (bisected over the invariant series{clean})")
    if report.suspects:
        lines.append(
            f"suspect requests (ended between the last clean and the first failing check): "
            f"{', '.join(report.suspects[:20])}"
        )
    lines.append(_leaks_line(report))
    shown = report.leaks if max_leaks is None else report.leaks[:max_leaks]
    for i, leak in enumerate(shown, 1):
        lines += _leak_lines(i, leak)
    if len(shown) < len(report.leaks):
        lines.append(f"  … and {len(report.leaks) - len(shown):,} more (kvscope report leaks lists them all)")
    if report.injected:
        kinds = sorted({str(i["kind"]) for i in report.injected})
        lines.append(f"injected faults (ground truth in the capture): {len(report.injected)} ({', '.join(kinds)})")
    check = verdict(report)
    lines.append(f"verdict: {check.verdict} (kvscope check exits {check.exit_code})")
    return "\n".join(lines)


def _retention_lines(report: LeakReport) -> list[str]:
    if report.events_missing is not None:
        return [f"retention: {report.events_missing}; the verdict rests on the leak checks alone"]
    if report.dropped_before_step is None:
        return []
    resumed = (
        f"; the ledger resumed from its checkpoint at event #{report.resumed_from}, so the leaks and culprits "
        "it names stand, and the events before that step cannot be shown"
        if report.resumed_from is not None
        else ""
    )
    return [
        f"retention: events before step {report.dropped_before_step} ({report.dropped_events:,} events) "
        f"were dropped{resumed}"
    ]


def _checks_lines(report: LeakReport) -> list[str]:
    if report.first_failure_step is not None:
        where = _censuses(report) if report.censuses else f"{report.checks_run} idle points"
        lines = [
            f"leak checks: {where}; first failure at step {report.first_failure_step}:",
            *(f"    {m}" for m in report.first_failure),
        ]
        lines += _blocks_lines(report, report.first_failure_step)
        if report.probe is not None and report.last_failure_step not in (None, report.first_failure_step):
            lines += [
                f"  last failure at step {report.last_failure_step} (what the census finds wrong there):",
                *(f"    {m}" for m in report.last_failure),
                *_blocks_lines(report, report.last_failure_step),
            ]
        return lines
    if report.checks_run == 0:
        return ["leak checks: the run reached no idle point, so no leak check ran"]
    if report.censuses:
        unchecked = f"; {report.unchecked} requests finished after the last" if report.unchecked else ""
        return [f"leak checks: {_censuses(report)}, all balanced{unchecked}"]
    return [f"leak checks: {report.checks_run} idle points, all balanced"]


def _blocks_lines(report: LeakReport, step: int | None) -> list[str]:
    """Every block the census named at `step` (the messages above name a few), one line each."""
    blocks = [b for b in report.census_blocks if b["step"] == step]
    if not blocks:
        return []
    unit = "page" if _pages(report) else "block"
    return [
        f"  every {unit} the census named at step {step} ({len(blocks)}):",
        *(f"    {_block_text(b, unit)}" for b in blocks),
    ]


def _block_text(block: dict[str, Any], unit: str = "block") -> str:
    text = f"{block['term']}: {unit} {block['block']}"
    if block["ref"] is not None:
        text += f" ref {block['ref']}"
    if block["accounted"] is not None:
        text += f", accounted {block['accounted']}"
    for key, verb in (("taker", "taken"), ("releaser", "released")):
        who = block[key]
        if who is not None:
            text += f"; last {verb} for request {who['rid']} ({who['event']} at step {who['step']})"
    return text


def _leaks_line(report: LeakReport) -> str:
    """What the capture can and cannot say about leaks: 'none' only when it can know."""
    if report.leaks:
        roots = len(report.root_leaks)
        pending = [leak for leak in report.root_leaks if not certain(report, leak)]
        cut = (
            ""
            if not pending
            else (
                f" ({len(pending)} found where the run stopped: a free may still have been pending in that "
                f"step; the others were due {'' if len(pending) < roots else 'no '}earlier)"
            )
        )
        consequences = len(report.leaks) - roots
        return (
            f"leaks: {roots} root cause{'s' if roots != 1 else ''}, {consequences} "
            f"consequence{'s' if consequences != 1 else ''}{cut}"
        )
    if report.first_failure_step is not None:
        if report.probe is not None:
            return (
                f"leaks: the census of the {report.probe} probe failed at step {report.first_failure_step}; "
                f"the check above names the {'pages' if _pages(report) else 'blocks'} and the request that last "
                "took each"
            )
        if report.level != "full":
            return (
                f"leaks: the leak check failed at step {report.first_failure_step} "
                f"({_gap(report.first_failure)}), but this capture is at level {report.level}, so it has no "
                "slot indices to name the culprits: re-record at --level full"
            )
        return f"leaks: the slot ledger names no culprit for the check that failed at step {report.first_failure_step}"
    if not report.finished:
        return (
            f"leaks: not known: {_STOPPED.get(report.status, f'the run is {report.status!r}')}"
            f"{_at_step(report)}; whether its memory would have balanced at the end is not in the capture"
        )
    if report.probe is not None:
        return f"leaks: none seen by the {report.probe} probe's census"
    if report.level != "full":
        return f"leaks: none seen by the leak checks (level {report.level}: no slot ledger to look further)"
    if report.checks_run == 0:
        return "leaks: the slot ledger found no leak, but no idle leak check ran to confirm it"
    return "leaks: none"


def _gap(messages: list[str]) -> str:
    """'22 tokens missing' of a failed check's message (the text after the terms)."""
    return "; ".join(m.rsplit(": ", 1)[-1] for m in messages if ": " in m) or "unbalanced"


def _at_step(report: LeakReport) -> str:
    return "" if report.last_step is None else f" at step {report.last_step}"


def _leak_lines(index: int, leak: Leak) -> list[str]:
    who = (
        f"request {leak.rid}" + (f" (user {leak.principal})" if leak.principal else "")
        if leak.rid
        else f"node {leak.node_id}"
        if leak.node_id is not None
        else "-"
    )
    count = f"{len(leak.slots)} slot{'s' if len(leak.slots) != 1 else ''}"
    after = f" — a consequence of #{leak.consequence_of}" if leak.consequence_of else ""
    lines = [
        f"  {index}. {leak.kind}, pool {leak.pool}: {count} {_slots_text(leak.slots)}{after}",
        f"     culprit: {who}; {leak.detail}",
    ]
    if leak.kind is LeakKind.LOCK_NEVER_RELEASED and leak.free_due_step is not None:
        lines.append(f"     the unlock was due at step {leak.free_due_step}, when the request finished")
    elif leak.allocated_step is not None:
        due = f"; the free was due at step {leak.free_due_step} and never came" if leak.free_due_step else ""
        what = "allocated"
        if leak.kind is LeakKind.COPY_NEVER_ACKNOWLEDGED:
            what, due = "started", f"; the ack was due by step {leak.free_due_step}"
        elif leak.pool == "host" and leak.node_id is not None:
            what = "written to the host"
        lines.append(f"     {what} at step {leak.allocated_step} (event #{leak.allocated_event}){due}")
    return lines


def verdict(report: LeakReport) -> Verdict:
    """clean: the run finished, reached at least one idle leak check, and nothing failed.
    leak: a leak check failed, or the ledger found a leak (in a run cut short, only the
    DEFINITE_KINDS count). inconclusive: the run did not finish, or no idle check ran."""
    if report.attached is not None:
        return Verdict(
            "inconclusive",
            CHECK_EXIT_CODES["inconclusive"],
            f"inconclusive: an attached engine ({report.attached}) runs its own leak check; kvscope sees "
            "its cached pages, not its slots (`kvscope report engine-log LOG` explains its leak messages)",
        )
    leaks = [leak for leak in report.root_leaks if certain(report, leak)]
    if leaks or report.first_failure_step is not None:
        return Verdict("leak", CHECK_EXIT_CODES["leak"], _leak_reason(report, leaks))
    if report.events_missing is not None:
        return Verdict("inconclusive", CHECK_EXIT_CODES["inconclusive"], f"inconclusive: {report.events_missing}")
    if not report.finished:
        stopped = _STOPPED.get(report.status, f"the run's status is {report.status!r}")
        why = f" ({report.error})" if report.error else _at_step(report)
        when = "so far" if report.status == RunStatus.RUNNING else "before it stopped"
        balanced = f"{_checks(report.checks_run)} balanced {when}"
        pending = _pending_line(report)
        return Verdict(
            "inconclusive", CHECK_EXIT_CODES["inconclusive"], f"inconclusive: {stopped}{why}; {balanced}{pending}"
        )
    if report.checks_run == 0:
        return Verdict(
            "inconclusive",
            CHECK_EXIT_CODES["inconclusive"],
            "inconclusive: the run finished without reaching an idle point, so no leak check ran",
        )
    if report.probe is not None and report.unchecked:
        return Verdict(
            "inconclusive",
            CHECK_EXIT_CODES["inconclusive"],
            f"inconclusive: {_censuses(report)} of the {report.probe} probe held, but {report.unchecked} "
            f"request{'s' if report.unchecked != 1 else ''} finished after the last one (step "
            f"{report.last_clean_step}) and no census saw the blocks they left",
        )
    if report.probe is not None:
        return Verdict(
            "clean",
            CHECK_EXIT_CODES["clean"],
            f"clean: {_censuses(report)} of the {report.probe} probe's {_census_words(report)})",
        )
    if report.level != "full":
        return Verdict(
            "clean",
            CHECK_EXIT_CODES["clean"],
            f"clean: {_checks(report.checks_run)} balanced (level {report.level}: no slot ledger to look further)",
        )
    return Verdict(
        "clean",
        CHECK_EXIT_CODES["clean"],
        f"clean: {_checks(report.checks_run)} balanced, no orphaned slots, double frees or held locks",
    )


def _pages(report: LeakReport) -> bool:
    """The probe's census counts pages (SGLang's), not ref-counted blocks (vLLM's)."""
    return bool(report.probe and report.probe.startswith("sglang"))


def _census_words(report: LeakReport) -> str:
    if _pages(report):
        return "page census held (every page free, in the tree or in a live request's row, exactly once"
    return "block census held (every block's references accounted for"


def _censuses(report: LeakReport) -> str:
    """'5 censuses (3 busy, 1 idle, 1 drain)'; a capture without census kinds: its idle checks."""
    if not report.censuses:
        return _checks(report.checks_run)
    kinds = ", ".join(
        f"{report.censuses[k]} {k}" for k in ("busy", "idle", "drain", "crash", "poll") if k in report.censuses
    )
    return f"{report.checks_run} census{'es' if report.checks_run != 1 else ''} ({kinds})"


def _checks(count: int) -> str:
    return f"{count} idle leak check{'s' if count != 1 else ''}"


def _pending_line(report: LeakReport) -> str:
    """Why the leaks the ledger found where an unfinished run stopped do not make it a leak."""
    pending = report.root_leaks
    if not pending:
        return ""
    kinds = ", ".join(sorted({str(leak.kind) for leak in pending}))
    return (
        f"; {len(pending)} {kinds} slot group{'s' if len(pending) != 1 else ''} found where it stopped "
        f"{'are' if len(pending) != 1 else 'is'} not counted: each was due to be freed in the last step, "
        "whose frees may still have been pending"
    )


def _leak_reason(report: LeakReport, leaks: list[Leak]) -> str:
    if not leaks:
        unnamed = f"; {report.events_missing}" if report.events_missing is not None else ""
        return f"leak: the leak check failed at step {report.first_failure_step}: {report.first_failure[0]}{unnamed}"
    leak = leaks[0]
    who = f" ({leak.rid})" if leak.rid else ""
    more = f" and {len(report.leaks) - 1} more" if len(report.leaks) > 1 else ""
    return f"leak: {leak.kind}: {len(leak.slots)} slots of pool {leak.pool}{who}{more}"


def check_reason(report: LeakReport) -> str:
    """One line: the verdict's reason (why the run leaks, why it is inconclusive, or that it is clean)."""
    return verdict(report).reason
