"""A fleet's figures from a capture: its replicas side by side, what routing cost in cache hits, and
how much of the fleet's cached KV is duplicated across replicas.

    capture = Capture(path_or_url)
    for fleet in fleets(capture):
        figures = fleet_figures(capture, fleet)      # replicas, idle floor, routing, duplication

NOTE: how runs are grouped into fleets (runs.config JSON)
    "fleet": {"id", "rank", "size", "dispatch"}   `kvscope serve --dp-size N`: one id per serve start
    "source": {"engine": "vllm", "dp_rank": r}    an instrumented vLLM EngineCore: runs of one host,
                                                  each rank once, in start order (a rank seen again
                                                  opens the next fleet)
Every other run is in no fleet (`loose_runs`): runs of separate servers are not guessed into one.

NOTE: the figures
    routing loss       a request's max(0, elsewhere_cached_tokens - routed_cached_tokens); a method's
                       share = its requests' summed loss / their summed prompt tokens
    duplication        per replica the distinct pages its tree snapshot holds on the device (by
                       tree_snapshots.page_hashes); a page held by k replicas counts once in unique
                       and k - 1 times in duplicated, so unique + duplicated = the replicas' held sum
    idle floor         at each leak check (an idle point): total - available - evictable of the full
                       pool, the tokens that stay in use with nothing running (a rising floor leaks)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pandas as pd
from sqlalchemy import select

from kvscope.telemetry import schema
from kvscope.telemetry.page_hash import split_page_hashes
from kvscope.telemetry.queries import Capture

MAX_DUPLICATION_POINTS = 60  # snapshot times the duplication series is computed at
REPLICA_COLUMNS = (
    "rank",
    "run_id",
    "status",
    "usage",
    "hit_rate",
    "running",
    "waiting",
    "evicted_tokens",
    "leak_check",
    "idle_floor_tokens",
)
ROUTING_COLUMNS = ("dispatch", "num_requests", "prompt_tokens", "loss_tokens", "loss_share")
DUPLICATION_UNKNOWN = (
    "duplication: not known (no tree snapshot with page hashes: a source that does not hash pages, "
    "or a file written before schema version 7)"
)
DUPLICATION_UNKNOWN = (
    "duplication: not known (no tree snapshot with page hashes: a source that does not hash pages, "
    "or a file written before schema version 7)"
)
DUPLICATION_COLUMNS = ("t_s", "held_tokens", "unique_tokens", "duplicated_tokens", "unknown_tokens")


@dataclass(frozen=True)
class Replica:
    run_id: int
    rank: int
    dispatch: str | None
    status: str


@dataclass
class Fleet:
    id: str
    source: str  # "kvscope" (serve --dp-size) or "vllm" (instrumented DP ranks)
    size: int | None  # the size its runs declare (None: not declared)
    replicas: list[Replica] = field(default_factory=list)

    def missing_ranks(self) -> list[int]:
        """Ranks below the declared size with no run in the capture (none when no size is declared)."""
        present = {r.rank for r in self.replicas}
        return [rank for rank in range(self.size or 0) if rank not in present]


class Duplication(NamedTuple):
    held_tokens: int  # the replicas' distinct cached tokens, summed over replicas
    unique_tokens: int  # distinct across the fleet
    duplicated_tokens: int  # a page on k replicas counts k - 1 times

    @property
    def share(self) -> float:
        return self.duplicated_tokens / self.held_tokens if self.held_tokens else 0.0


class FleetFigures(NamedTuple):
    fleet: Fleet
    replicas: pd.DataFrame  # REPLICA_COLUMNS, by rank
    idle_floor: pd.DataFrame  # rank, t_s, floor_tokens
    routing: pd.DataFrame  # ROUTING_COLUMNS, one row per dispatch method
    duplication: pd.DataFrame  # DUPLICATION_COLUMNS over time; empty when not known
    notes: list[str]  # one line per figure the capture cannot give


# -- grouping ---------------------------------------------------------------------------------------


def fleets(capture: Capture) -> list[Fleet]:
    """The capture's fleets, in order of their first run."""
    out: dict[str, Fleet] = {}
    vllm_open: dict[str, Fleet] = {}  # host -> its latest vLLM fleet
    for row in capture.runs().itertuples():
        config = _config(row.config)
        replica_of = Replica(int(row.id), 0, None, str(row.display_status))
        declared = config.get("fleet")
        if isinstance(declared, dict) and "id" in declared and "rank" in declared:
            fleet = out.setdefault(
                f"fleet {declared['id']}", Fleet(str(declared["id"]), "kvscope", _int(declared.get("size")))
            )
            fleet.replicas.append(_with(replica_of, int(declared["rank"]), declared.get("dispatch")))
            continue
        source = config.get("source")
        if isinstance(source, dict) and source.get("engine") == "vllm" and source.get("dp_rank") is not None:
            rank, host = int(source["dp_rank"]), str(row.host)
            fleet_v = vllm_open.get(host)
            if fleet_v is None or any(r.rank == rank for r in fleet_v.replicas):
                fleet_v = vllm_open[host] = Fleet(f"vllm-{host}-{row.id}", "vllm", None)
                out[f"vllm {fleet_v.id}"] = fleet_v
            fleet_v.replicas.append(_with(replica_of, rank, None))
    for fleet in out.values():
        fleet.replicas.sort(key=lambda r: r.rank)
    return list(out.values())


def loose_runs(capture: Capture, grouped: Iterable[Fleet]) -> list[int]:
    """Run ids in no fleet."""
    taken = {r.run_id for fleet in grouped for r in fleet.replicas}
    return [int(i) for i in capture.runs()["id"] if int(i) not in taken]


def pick_fleet(found: Sequence[Fleet], fleet_id: str | None) -> Fleet:
    """The fleet named `fleet_id`, or the latest one; ValueError with one line when none is."""
    if not found:
        raise ValueError("no fleet in this capture (no run carries fleet keys or a vLLM data-parallel rank)")
    if fleet_id is None:
        return found[-1]
    for fleet in found:
        if fleet.id == fleet_id:
            return fleet
    raise ValueError(f"no fleet {fleet_id!r} in this capture: it has {', '.join(f.id for f in found)}")


def _with(replica: Replica, rank: int, dispatch: Any) -> Replica:
    return Replica(replica.run_id, rank, None if dispatch is None else str(dispatch), replica.status)


def _config(text: Any) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


# -- the figures ------------------------------------------------------------------------------------


def fleet_figures(capture: Capture, fleet: Fleet) -> FleetFigures:
    notes: list[str] = []
    floors = pd.concat([idle_floor(capture, r) for r in fleet.replicas], ignore_index=True)
    replicas = pd.DataFrame([replica_row(capture, r, floors) for r in fleet.replicas], columns=list(REPLICA_COLUMNS))
    routing = routing_loss(pd.concat([capture.requests(r.run_id) for r in fleet.replicas], ignore_index=True))
    if routing.empty:
        notes.append("routing loss: no request of this fleet was routed among replicas")
    duplication = duplication_series(capture, fleet)
    if duplication.empty:
        notes.append(DUPLICATION_UNKNOWN)
    if floors.empty:
        notes.append("idle floor: no leak check recorded")
    t0 = _fleet_t0(floors, duplication)
    floors["t_s"] -= t0
    duplication["t_s"] -= t0
    return FleetFigures(fleet, replicas, floors, routing, duplication, notes)


def replica_row(capture: Capture, replica: Replica, floors: pd.DataFrame) -> dict[str, Any]:
    last = capture.latest_usage(replica.run_id).tail(1)
    row: dict[str, Any] = dict.fromkeys(REPLICA_COLUMNS)
    row.update(
        rank=replica.rank, run_id=replica.run_id, status=replica.status, leak_check=leak_verdict(capture, replica)
    )
    if not last.empty:
        u = last.iloc[0]
        row["usage"] = _ratio(u["full_used"], u["full_total"])
        row["hit_rate"] = _ratio(u["cum_hit_tokens"], u["cum_prompt_tokens"])
        row["running"], row["waiting"] = _num(u["num_running"]), _num(u["num_waiting"])
        row["evicted_tokens"] = _num(u["cum_evicted_tokens"])
    mine = floors[floors["rank"] == replica.rank]
    row["idle_floor_tokens"] = None if mine.empty else int(mine["floor_tokens"].iloc[-1])
    return row


def leak_verdict(capture: Capture, replica: Replica) -> str:
    """The last leak check's verdict: ok, leak (its first message) or not checked."""
    checks = capture.leak_checks(replica.run_id)
    if checks.empty:
        return "not checked"
    last = checks[checks["step"] == checks["step"].max()]
    bad = last[~last["ok"].astype(bool)]
    return "ok" if bad.empty else f"leak: {bad['message'].iloc[0]}"


def idle_floor(capture: Capture, replica: Replica) -> pd.DataFrame:
    """rank, t_s (monotonic seconds), floor_tokens at each of the full pool's leak checks."""
    checks = capture.leak_checks(replica.run_id)
    full = checks[checks["pool"] == "full"]
    return pd.DataFrame(
        {
            "rank": replica.rank,
            "t_s": full["t_mono"].astype(float),
            "floor_tokens": (full["total"] - full["available"] - full["evictable"]).astype(int),
        }
    )


def routing_loss(requests: pd.DataFrame) -> pd.DataFrame:
    """ROUTING_COLUMNS per dispatch method, over the routed requests (dispatch not NULL)."""
    if requests.empty or "dispatch" not in requests:
        return pd.DataFrame(columns=list(ROUTING_COLUMNS))
    routed = requests[requests["dispatch"].notna()]
    loss = (routed["elsewhere_cached_tokens"].astype(int) - routed["routed_cached_tokens"].astype(int)).clip(lower=0)
    frame = pd.DataFrame({"dispatch": routed["dispatch"], "prompt_tokens": routed["prompt_len"], "loss_tokens": loss})
    return loss_table(frame)


def loss_table(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` (dispatch, prompt_tokens, loss_tokens per request) summed per method."""
    grouped = frame.groupby("dispatch", sort=True)
    out = pd.DataFrame(
        {
            "num_requests": grouped.size(),
            "prompt_tokens": grouped["prompt_tokens"].sum().astype(int),
            "loss_tokens": grouped["loss_tokens"].sum().astype(int),
        }
    ).reset_index()
    out["loss_share"] = [_ratio(a, b) or 0.0 for a, b in zip(out["loss_tokens"], out["prompt_tokens"], strict=True)]
    return out[list(ROUTING_COLUMNS)]


def duplication(replica_pages: Sequence[Mapping[bytes, int]]) -> Duplication:
    """`replica_pages[r]`: replica r's distinct pages (hash -> its tokens)."""
    held = sum(sum(pages.values()) for pages in replica_pages)
    unique: dict[bytes, int] = {}
    for pages in replica_pages:
        unique.update(pages)
    unique_tokens = sum(unique.values())
    return Duplication(held, unique_tokens, held - unique_tokens)


def snapshot_pages(nodes: pd.DataFrame) -> tuple[dict[bytes, int], int]:
    """A snapshot's device pages (hash -> tokens) and the device tokens of nodes with no hashes."""
    pages: dict[bytes, int] = {}
    unknown = 0
    for num_tokens, tier, blob in zip(nodes["num_tokens"], nodes["tier"], nodes["page_hashes"], strict=True):
        if not num_tokens or tier == "host":
            continue
        hashes = split_page_hashes(bytes(blob)) if isinstance(blob, bytes | bytearray | memoryview) else []
        if not hashes or num_tokens % len(hashes):
            unknown += int(num_tokens)
            continue
        page_tokens = int(num_tokens) // len(hashes)
        pages.update(dict.fromkeys(hashes, page_tokens))
    return pages, unknown


def duplication_series(capture: Capture, fleet: Fleet) -> pd.DataFrame:
    """DUPLICATION_COLUMNS at the replicas' snapshot times (each replica's latest snapshot then);
    empty when no replica's snapshots carry page hashes."""
    snapshots = {r.rank: _replica_snapshots(capture, r.run_id) for r in fleet.replicas}
    if not any(pages for series in snapshots.values() for _, pages, _ in series):
        return pd.DataFrame(columns=list(DUPLICATION_COLUMNS))
    times = sorted({t for series in snapshots.values() for t, _, _ in series})
    stride = max(1, -(-len(times) // MAX_DUPLICATION_POINTS))
    picked = times[::-1][::stride][::-1]
    rows = []
    for t in picked:
        current = [_latest_before(series, t) for series in snapshots.values()]
        found = duplication([pages for pages, _ in current])
        rows.append((t, *found, sum(unknown for _, unknown in current)))
    return pd.DataFrame(rows, columns=list(DUPLICATION_COLUMNS))


def _replica_snapshots(capture: Capture, run_id: int) -> list[tuple[float, dict[bytes, int], int]]:
    """(t_mono, pages, unknown tokens) per snapshot of a run, in time order (the time of the
    snapshot's step from usage; a snapshot at a step with no usage row is skipped)."""
    t, u = schema.tree_snapshots.c, schema.usage.c
    columns = {c.name: c for c in schema.columns_as_of(schema.tree_snapshots, capture.schema_version)}
    picked = [columns[name] for name in ("step", "num_tokens", "tier", "page_hashes")]
    nodes = capture.read_frame(select(*picked).where(t.run_id == run_id).order_by(t.step))
    steps = capture.read_frame(
        select(u.step, u.t_mono).where(u.run_id == run_id, u.step.in_(nodes["step"].unique().tolist()))
    )
    time_of = dict(zip(steps["step"].astype(int), steps["t_mono"].astype(float), strict=True))
    nodes["tier"] = nodes["tier"].where(nodes["tier"].notna(), "device")
    out = []
    for step, group in nodes.groupby("step", sort=True):
        if int(step) in time_of:
            out.append((time_of[int(step)], *snapshot_pages(group)))
    return out


def _latest_before(series: list[tuple[float, dict[bytes, int], int]], t: float) -> tuple[dict[bytes, int], int]:
    latest: tuple[dict[bytes, int], int] = ({}, 0)
    for when, pages, unknown in series:
        if when > t:
            break
        latest = (pages, unknown)
    return latest


def _fleet_t0(floors: pd.DataFrame, duplication_frame: pd.DataFrame) -> float:
    starts = [s.min() for s in (floors["t_s"], duplication_frame["t_s"]) if len(s)]
    return float(min(starts)) if starts else 0.0


def _ratio(part: Any, whole: Any) -> float | None:
    if part is None or whole is None or pd.isna(part) or pd.isna(whole) or not whole:
        return None
    return float(part) / float(whole)


def _num(value: Any) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


# -- JSON -------------------------------------------------------------------------------------------


def figures_json(figures: FleetFigures) -> dict[str, Any]:
    """The figures as plain JSON values."""
    fleet = figures.fleet
    last = figures.duplication.tail(1)
    return {
        "fleet": {"id": fleet.id, "source": fleet.source, "size": fleet.size, "replicas": len(fleet.replicas)},
        "replicas": _records(figures.replicas),
        "routing": _records(figures.routing),
        "duplication": None if last.empty else _records(last)[0],
        "duplication_over_time": _records(figures.duplication),
        "idle_floor": _records(figures.idle_floor),
        "notes": list(figures.notes),
    }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _plain(v) for k, v in row.items()} for row in frame.to_dict("records")]


def _plain(value: Any) -> Any:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value
