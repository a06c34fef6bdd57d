"""The dashboard by capability, not by source: a run's config says what its source provides
(kvscope.telemetry.capabilities), each page section renders when its capability is there and
otherwise says in one line what this source cannot show. Every page through the real app
(AppTest) on an own-engine capture (sample_runs), an attached one (`kvscope attach`'s recorder)
and probe-shaped ones written through the real SQLRecorder the way kvscope's vLLM probe writes
them: block events with ref-count kinds, the real census (kvscope.probe.census) as leak checks,
tree snapshots in the own engine's row shape (node = block, parent = the block before it in its
hash chain, lock_ref = the block's ref count), requests with and without arrival times.
"""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from kvscope.attach.recorder import AttachRecorder, provides
from kvscope.attach.scrape import EngineSample
from kvscope.attach.wire import Batch, Removed, Stored
from kvscope.dashboard import attached, data
from kvscope.probe import BlockView, census_checks, take_census
from kvscope.telemetry import (
    EventKind,
    EvictReason,
    NodeRow,
    PoolName,
    PoolTerms,
    RequestRecord,
    SQLRecorder,
    UsageSample,
)
from kvscope.telemetry.capabilities import (
    ATTACH_PROVIDES,
    CANNOT_SHOW,
    Capabilities,
    capabilities,
    capabilities_of_json,
)
from tests.dashboard.conftest import PAGES, ROOT

FULL = PoolName.FULL
BLOCK = 16  # tokens per block
NUM_BLOCKS = 11  # the null block left out, as the probe counts them
PROBE_SOURCE = {
    "kind": "probe",
    "engine": "vllm",
    "version": "0.32.0",
    "patched": True,
    "reason": None,
    "pid": 1,
    "provides": ["blocks", "ownership", "refs", "leak_checks", "requests"],
}
ATTACH_SOURCE = {
    "kind": "attach",
    "engine": "vllm",
    "version": "0.32.0",
    "url": "http://127.0.0.1:8000",
    "model": "tiny",
    "block_size": 16,
    "capacity_tokens": 176,
    "kv_events": None,
    "warnings": [],
    "provides": ["evictions", "hit_rate", "pages", "requests.counts", "usage.used"],
}
OWN_ENGINE = ROOT / "sample_runs" / "shared-prefix.db"
PROBE = capabilities({"source": PROBE_SOURCE})
ATTACH = capabilities({"source": ATTACH_SOURCE})


# -- the model ----------------------------------------------------------------------------------


def test_each_kind_of_source_provides_its_own_capabilities() -> None:
    own = capabilities({"engine": {"cache": {"kind": "radix"}}})
    assert (own.kind, own.engine, own.unit) == ("engine", "kvscope", "slots")
    assert own.has("ledger", "locks", "latencies", "tenants", "waste", "regret", "request_stream")
    assert own.lacks("census") and own.lacks("forest")
    attach = capabilities({"source": ATTACH_SOURCE})
    assert (attach.kind, attach.unit) == ("attach", "pages")
    assert attach.provides == {"attach_loop", "evictions", "forest", "hit_rate", "request_counts", "usage.used"}
    probe = capabilities({"source": PROBE_SOURCE})
    assert (probe.kind, probe.engine, probe.title, probe.unit) == ("probe", "vllm", "vllm 0.32.0", "blocks")
    assert probe.has("ownership", "refs", "leak_checks", "census", "requests", "tree")
    for lacking in ("locks", "ledger", "slots", "latencies", "tenants", "waste", "regret", "request_stream", "gpu"):
        assert probe.lacks(lacking), lacking
    # an SGLang probe (the same config shape; its pool is pages with tree locks, its leak checks per
    # pool, not vLLM's block census), and a newer probe that says it records more
    sglang = capabilities(
        {
            "source": {
                **PROBE_SOURCE,
                "engine": "sglang",
                "provides": ["pages", "ownership", "locks", "leak_checks", "requests", "swa", "bogus"],
            }
        }
    )
    assert sglang.unit == "pages" and sglang.has("locks", "leak_checks", "swa", "tree")
    for lacking in ("census", "blocks", "refs", "forest", "bogus", "ledger"):
        assert sglang.lacks(lacking), lacking
    assert "sglang" in sglang.cannot_show("ledger")
    # the SGLang probe at level summary leaves its tree methods unpatched: no eviction is counted
    summary = capabilities({"source": {**PROBE_SOURCE, "engine": "sglang", "lacks": ["evictions"]}})
    assert summary.lacks("evictions") and sglang.has("evictions") and PROBE.has("evictions")
    assert "level summary" in summary.cannot_show("evictions") and "sglang" in summary.cannot_show("evictions")


def test_every_name_kvscope_attach_writes_maps_to_a_capability() -> None:
    sample = EngineSample(0.0, 64, *([0] * 12))  # every figure exported, a host tier included
    for engine in ("sglang", "vllm", "kvscope"):
        for subscribed in (True, False):
            written = set(provides(engine, subscribed, sample))
            assert written <= set(attached.PROVIDED) == set(ATTACH_PROVIDES), (engine, written)


def test_data_adds_what_a_config_cannot_promise() -> None:
    probe = capabilities({"source": PROBE_SOURCE})
    assert probe.with_data({"tree_snapshots": True, "latencies": True}).has("tree_snapshots", "latencies")
    assert probe.with_data({"census": False}).lacks("census")
    assert capabilities_of_json("not json").kind == "engine"  # an unreadable config: the own engine's


def test_every_cannot_show_line_is_one_line_naming_the_engine_where_it_says_so() -> None:
    probe = Capabilities("probe", "vllm", "0.32.0", frozenset())
    for name, lines in CANNOT_SHOW.items():
        line = probe.cannot_show(name)
        assert "\n" not in line and "{" not in line, name
        assert ("vllm" in line) == ("{engine}" in lines.get("probe", lines.get("*", ""))), name


def test_no_page_asks_which_kind_of_source_a_run_came_from() -> None:
    """Pages ask for capabilities; only capability.py (the source's header) reads the kind."""
    for page in (ROOT / "kvscope" / "dashboard" / "app_pages").glob("*.py"):
        text = page.read_text()
        for fork in ("caps.kind", "source_of(", '"attach"', '"probe"', "attached_pages"):
            assert fork not in text, (page.name, fork)


# -- captures ------------------------------------------------------------------------------------


def census_rows(
    rec: SQLRecorder,
    step: int,
    refs: dict[int, int],
    hashed: set[int],
    last_taker: dict[int, tuple[str | None, int, str]],
) -> None:
    """The real census of a pool whose blocks have `refs` (others 0), with no request left."""
    ref_counts = {b: refs.get(b, 0) for b in range(1, NUM_BLOCKS + 1)}
    queued = [b for b, r in ref_counts.items() if r == 0]
    result = take_census(BlockView(ref_counts, hashed, queued, len(queued)), [], [], set(), last_taker)
    for check in census_checks(step, result):
        rec.leak_check(check)


def usage(step: int, free_blocks: int, running: int, cached_free: int = 0) -> UsageSample:
    """A probe's usage row; `cached_free` blocks (hashed, in the free queue) as evictable, as a
    probe that records them per step writes them."""
    total = NUM_BLOCKS * BLOCK
    terms = PoolTerms(total, (free_blocks - cached_free) * BLOCK, cached_free * BLOCK, 0)
    return UsageSample(
        step,
        terms,
        None,
        0,
        0,
        running,
        0,
        100 * step,
        16 * (step - 1),
        step,
        step - 1,
        16 * (step // 3),
        0,
        full_used=total - free_blocks * BLOCK,
    )


def node(node_id: int, parent: int | None, refs: int, depth: int) -> NodeRow:
    return NodeRow(node_id, parent, 0 if parent is None else BLOCK, "", refs, 0.0, 0, None, False, depth)


class Stop(StrEnum):  # NOTE: why a prefix lookup stopped, as a probe may name it on the match event's reason
    PARTIAL = "partial-block"


def probe_life(rec: SQLRecorder, *, leak: bool, arrivals: bool) -> None:
    """Two requests sharing the prefix block 1: r1 allocates blocks 1 and 2 and caches them
    (the hash chain 1 -> 2); r2 hits block 1 (a touch), allocates block 3, and with `leak`
    never releases block 3. Snapshots at steps 2 and 3; the census at the idle step 3. Without
    `leak` (a newer probe) the requests have arrival times, the usage rows count cached-free
    blocks, and the lookup names why it stopped."""
    rec.step = 1
    rec.record(EventKind.ALLOC, pool=FULL, rid="r1", num_tokens=2, slots=[1, 2], aux=0)
    rec.record(EventKind.INSERT, pool=FULL, rid="r1", node_id=1, num_tokens=BLOCK, slots=[1], aux=0)
    rec.record(EventKind.INSERT, pool=FULL, rid="r1", node_id=2, num_tokens=BLOCK, slots=[2], aux=1)
    rec.usage(usage(1, NUM_BLOCKS - 2, 1))
    rec.step = 2
    rec.record(
        EventKind.MATCH, pool=FULL, rid="r2", node_id=1, num_tokens=BLOCK, aux=20, reason=None if leak else Stop.PARTIAL
    )
    rec.record(EventKind.LOCK, pool=FULL, rid="r2", num_tokens=1, slots=[1], aux=0)
    rec.record(EventKind.ALLOC, pool=FULL, rid="r2", num_tokens=1, slots=[3], aux=0)
    rec.record(EventKind.FREE, pool=FULL, rid="r1", num_tokens=1, slots=[2], aux=0)
    rec.record(EventKind.UNLOCK, pool=FULL, rid="r1", num_tokens=1, slots=[1], aux=0)
    rec.tree_snapshot(2, [node(0, None, 1, 0), node(1, 0, 1, BLOCK), node(2, 1, 0, 2 * BLOCK)])
    rec.usage(usage(2, NUM_BLOCKS - 2, 1))
    rec.step = 3
    rec.record(EventKind.FREE, pool=FULL, rid="r2", num_tokens=1 if leak else 2, slots=[1] if leak else [1, 3], aux=0)
    rec.record(
        EventKind.EVICT, pool=FULL, rid="r3", node_id=2, num_tokens=BLOCK, slots=[2], reason=EvictReason.CAPACITY
    )
    rec.tree_snapshot(3, [node(0, None, 1, 0), node(1, 0, 0, BLOCK)])
    rec.usage(usage(3, NUM_BLOCKS - (1 if leak else 0), 0, 0 if leak else 1))
    for step, rid in ((2, "r1"), (3, "r2")):
        done = RequestRecord(rid, None, 40, "finished", BLOCK * (step - 1), 4)
        if arrivals:
            done.mark("arrive", step - 1, float(step - 1))
            done.mark("admit", step - 1, step - 0.9)
            done.mark("first_token", step - 1, step - 0.8)
        done.mark("finish", step, float(step))
        rec.request(done)
    census_rows(rec, 3, {3: 1} if leak else {}, {1}, {3: ("r2", 2, "alloc")} if leak else {})


def scrape(t: float, **given: int) -> EngineSample:
    """A vLLM-like scrape of a 176-token pool: what `given` names, None (not provided) for the rest."""
    fields = (
        "available_tokens",
        "evictable_tokens",
        "used_tokens",
        "host_used_tokens",
        "host_total_tokens",
        "num_running",
        "num_waiting",
        "prompt_tokens_total",
        "cached_tokens_total",
        "host_cached_tokens_total",
        "evicted_tokens_total",
        "preemptions_total",
    )
    return EngineSample(t, 176, *(given.get(f) for f in fields))


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("capabilities")
    made = {"own": OWN_ENGINE}
    for name, leak, arrivals in (("probe", True, False), ("probe-clean", False, True)):
        made[name] = folder / f"{name}.db"
        with SQLRecorder(made[name], config={"source": PROBE_SOURCE}, label=f"vllm 0.32.0 probe {name}") as rec:
            probe_life(rec, leak=leak, arrivals=arrivals)
    made["attach"] = folder / "attach.db"
    recorder = AttachRecorder(made["attach"], ATTACH_SOURCE, snapshot_every=1, flush_interval_s=0.05)
    recorder.apply(Batch(1.0, (Stored((11, 12), None, tuple(range(32)), 16, "device"),), None))
    recorder.tick(scrape(1.0, used_tokens=32))
    recorder.apply(Batch(2.0, (Removed((12,), "device"),), None))
    recorder.tick(scrape(2.0, used_tokens=16))
    recorder.close({"delivered": 1, "lost_batches": 0, "gaps": 0, "restarts": 0, "bad_messages": 0})
    return made


def open_page(db: Path, monkeypatch: pytest.MonkeyPatch, page: str = "overview") -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    if page != "overview":
        at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(at: AppTest) -> list[str]:
    kinds = ("caption", "markdown", "info", "warning", "error", "success")
    return [str(getattr(e, "value", "")) for kind in kinds for e in at.get(kind)]


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def frames(at: AppTest) -> list[Any]:
    return [d.value for d in at.dataframe]


# -- every page, every source: the right "cannot show" lines ---------------------------------------

# the capabilities whose lines each page may show when its source lacks them
PAGE_LINES = {
    "overview": ("usage.split", "locks", "gpu"),
    "memory": ("locks", "slots", "ownership", "swa", "waste", "tenants"),
    "tiers": ("tiers",),
    "tree": ("locks", "ownership"),
    "evictions": ("regret",),
    "leaks": ("leak_checks", "slots", "locks", "ledger"),
    "requests": ("ownership", "latencies"),
    "capacity": ("request_stream",),
    "fleet": (),
}
SOURCES = {"own": "engine", "attach": "attach", "probe": "probe"}


def expected_lines(source: str, page: str) -> set[str]:
    caps = capabilities({} if source == "own" else {"source": PROBE_SOURCE if source == "probe" else ATTACH_SOURCE})
    shown = {name for name in PAGE_LINES[page] if caps.lacks(name)}
    if page == "tree" and caps.has("tree"):
        shown -= {"locks", "ownership"}  # NOTE: the tree draws ref counts and holders in their place
    if page == "leaks":  # NOTE: no leak checks at all, or checks whose culprits are not the slot ledger's
        shown = {"leak_checks", "slots", "locks"} if caps.lacks("leak_checks") else shown & {"ledger"}
    if page == "requests" and caps.lacks("requests"):
        shown -= {"latencies"}  # NOTE: no request records: their counts stand in, not their latencies
    if page == "tiers" and caps.kind == "engine":
        shown = set()  # NOTE: a one-tier cache says so in its own words
    return shown


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("source", SOURCES)
def test_each_page_says_what_its_source_cannot_show_and_nothing_else(
    captures: dict[str, Path], source: str, page: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures[source], monkeypatch, page)
    shown = texts(at)
    every = {(caps.kind, name): caps.cannot_show(name) for caps in (ATTACH, PROBE) for name in CANNOT_SHOW}
    found = {name for (kind, name), line in every.items() if line in shown}
    assert found == expected_lines(source, page), (source, page)
    for line in shown:  # no line is shown twice
        if line in every.values():
            assert shown.count(line) == 1, line


# -- the probe capture: each page renders its data ------------------------------------------------


def test_the_probe_overview_shows_the_census_verdict_and_the_leaked_blocks_as_missing(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["probe"], monkeypatch)
    assert any("Recorded inside vllm 0.32.0 by kvscope's probe" in m.value for m in at.markdown)
    assert len(at.error) == 1 and "leak check failed at step 3: [leaked]" in at.error[0].value
    assert "last taken by request r2" in at.error[0].value
    shown = metrics(at)
    assert shown["full: missing"] == f"{BLOCK:,}"  # the one leaked block, with no request running
    assert shown["full: total"] == f"{NUM_BLOCKS * BLOCK:,}" and "full: protected" not in shown
    assert len(at.get("plotly_chart")) == 1  # usage over time
    clean = open_page(captures["probe-clean"], monkeypatch)
    assert len(clean.success) == 1 and "probe's block census held" in clean.success[0].value
    assert metrics(clean)["full: missing"] == "0"
    # a probe that records cached-free blocks per step: its pool is split, and no line says it is not
    assert metrics(clean)["full: evictable"] == f"{BLOCK:,}" and "full: evictable" not in shown
    split = PROBE.cannot_show("usage.split")
    assert split in texts(at) and split not in texts(clean)


def test_a_probe_run_without_eviction_counts_shows_no_eviction_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SGLang probe at level summary counts no eviction (its usage rows say 0): the Overview and the
    Evictions page show none, and say why, instead of a zero."""
    db = tmp_path / "sglang-summary.db"
    source = {**PROBE_SOURCE, "engine": "sglang", "version": "0.5.23", "lacks": ["evictions"]}
    with SQLRecorder(db, config={"source": source}, label="sglang 0.5.23 probe pid 1") as rec:
        probe_life(rec, leak=False, arrivals=True)
    at = open_page(db, monkeypatch)
    shown = metrics(at)
    assert shown["evictions"] == "–" and not any(label.startswith("evict") and label != "evictions" for label in shown)
    line = capabilities({"source": source}).cannot_show("evictions")
    assert next(m for m in at.metric if m.label == "evictions").help == line
    at.switch_page("kvscope/dashboard/app_pages/evictions.py").run()
    assert [e.value for e in at.info] == [line]  # not "no evictions"


def test_the_probe_leaks_page_names_the_culprit_from_the_census(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["probe"], monkeypatch, "leaks")
    culprits = frames(at)[-1]
    assert culprits.to_dict("records") == [
        {"term": "leaked", "block": 3, "ref count": 1, "accounted": 0, "request": "r2", "event": "alloc", "at step": 2}
    ]
    census = frames(at)[0]
    assert census.loc[0, "leaked"] == "FAILED" and census.loc[0, "orphans"] == "ok"
    assert metrics(at)["verdict"] == "leak"
    assert not any("events replayed" in c.value or "Replayed from" in c.value for c in at.caption)  # no ledger
    assert not at.success  # never "no orphaned slots" for a source the slot ledger does not replay
    assert any("request r2 on Requests" in str(link.proto) for link in at.get("page_link"))
    clean = open_page(captures["probe-clean"], monkeypatch, "leaks")
    assert any("Every census term held" in s.value for s in clean.success)


def test_the_probe_tree_shows_ref_counts_and_the_requests_holding_a_block(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["probe"], monkeypatch, "tree")
    at.slider(key="tree.step").set_value(2).run()
    at.selectbox(key="tree.node").set_value(0).run()
    assert any(c.value.startswith("The root stands for the empty prefix") for c in at.caption)
    at.selectbox(key="tree.node").set_value(1).run()
    assert not at.exception
    detail, holders = frames(at)[0], frames(at)[1]
    shown = dict(zip(detail["field"], detail["value"], strict=True))
    assert shown["ref count (requests holding the block)"] == "1"  # the snapshot's ref count
    assert holders.to_dict("records") == [
        {"request": "r2", "references": 1, "since step": 2, "by": "touch (prefix hit)"}
    ]
    assert any("is held by these requests after step 2" in c.value for c in at.caption)


def test_the_probe_requests_page_shows_latencies_only_when_arrivals_are_recorded(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["probe"], monkeypatch, "requests")
    assert metrics(at)["requests"] == "2" and not any(s.value == "Latency" for s in at.subheader)
    assert not any(s.value == "Why prefix lookups stopped" for s in at.subheader)  # no lookup names a reason
    at = open_page(captures["probe-clean"], monkeypatch, "requests")
    assert any(s.value == "Latency" for s in at.subheader)
    stops = next(f for f in frames(at) if "why the lookup stopped" in f.columns)
    assert stops.to_dict("records") == [
        {"why the lookup stopped": "partial-block", "lookups": 1, "hit tokens": BLOCK, "missed tokens": 20}
    ]
    assert not any(PROBE.cannot_show("latencies") == c.value for c in at.caption)


def test_the_probe_evictions_and_memory_pages_draw_the_blocks(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["probe"], monkeypatch, "evictions")
    assert metrics(at)["evictions (blocks)"] == "1" and metrics(at)["reasons"] == "capacity"
    at = open_page(captures["probe"], monkeypatch, "memory")
    assert [s.value for s in at.subheader] == ["Pools over time"]


# -- live -------------------------------------------------------------------------------------------


def test_a_running_probe_capture_is_followed_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "live-probe.db"
    rec = SQLRecorder(db, config={"source": PROBE_SOURCE}, label="vllm 0.32.0 probe pid 1")
    try:
        rec.step = 1
        rec.usage(usage(1, NUM_BLOCKS - 2, 2))
        rec.flush()
        at = open_page(db, monkeypatch)
        assert "running** · refreshing every second" in at.caption[0].value
        assert "still running" in at.warning[0].value  # inconclusive, in yellow
        assert metrics(at)["full: held by requests"] == f"{2 * BLOCK:,}"
        rec.step = 2
        rec.usage(usage(2, NUM_BLOCKS - 3, 1))
        rec.flush()
        time.sleep(data.LIVE_TTL_S + 0.1)  # the run list (and so the read stamp) is cached for LIVE_TTL_S
        at.run()
        assert metrics(at)["full: held by requests"] == f"{3 * BLOCK:,}"
        leaks = open_page(db, monkeypatch, "leaks")
        assert any("still running" in c.value for c in leaks.caption)
    finally:
        rec.close()
    time.sleep(data.LIVE_TTL_S + 0.1)
    at.run()
    assert not at.exception and "finished" in at.caption[0].value and "refreshing" not in at.caption[0].value
