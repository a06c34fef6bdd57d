"""Every page on attached captures (`kvscope attach`: a real engine watched from outside), through
the real app (AppTest) on real SQLite files: a vLLM-like source (used tokens only, one tier, a
cache reset), an SGLang-like one (its pool split, a host tier with backups, a load-back and a host
eviction, a known-bad stream warning, lost batches) and a bare one (a capacity and nothing else).
The numbers shown are read back from the files here; the verdict is never "clean"; what a source
does not provide is one caption, never a chart.

NOTE: the vLLM- and SGLang-like captures are written by kvscope attach's own recorder
(AttachRecorder) from the decoder's events (wire.Stored / Removed / Cleared batches) and
normalized scrapes (EngineSample), as `kvscope attach` writes them (schema version 5: NULL in
the usage columns a source does not report).
"""

from __future__ import annotations

import base64
import json
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.attach.recorder import AttachRecorder
from kvscope.attach.scrape import EngineSample
from kvscope.attach.wire import Batch, Cleared, Removed, Stored, WireEvent
from kvscope.dashboard import attached, charts
from kvscope.dashboard.verdict import attached_verdict
from kvscope.telemetry import Capture, EventKind
from kvscope.telemetry.capabilities import Capabilities
from tests.dashboard.conftest import PAGES, ROOT

URL = "http://127.0.0.1:30000"
ATTACHED = Capabilities("attach", "vllm", None, frozenset())  # NOTE: the lines name no engine
T0 = 1_700_000_000.0

# what each page says it cannot show, on every attached capture (capabilities a `kvscope attach` source lacks)
CAPTIONS = {
    "overview": ("locks",),
    "memory": ("locks", "slots", "ownership", "swa", "waste"),
    "tree": ("locks", "ownership"),
    "leaks": ("leak_checks", "slots", "locks"),
    "requests": ("ownership",),
    "tiers": (),
    "evictions": (),
    "capacity": (),
    "fleet": (),
}


def source(
    engine: str, version: str, block_size: int, capacity: int, provides: list[str], warnings: list[str]
) -> dict[str, Any]:
    return {
        "kind": "attach",
        "engine": engine,
        "version": version,
        "url": URL,
        "model": "tiny-llama",
        "block_size": block_size,
        "capacity_tokens": capacity,
        "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": None, "topic": "kv", "bind": False},
        "warnings": warnings,
        "provides": sorted(provides),
    }


def tokens(count: int, start: int) -> tuple[int, ...]:
    return tuple(range(start, start + count))


def batch(*events: WireEvent) -> Batch:
    return Batch(T0, tuple(events), None)


def scrape(capacity: int, **given: int | None) -> EngineSample:
    """One normalized scrape: what `given` names, None (not provided) for the rest."""
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
    assert set(given) <= set(fields)
    return EngineSample(T0, capacity, *(given.get(f) for f in fields))


def vllm_like(path: Path) -> Path:
    """vLLM 0.32.0: blocks of 32 on the device only, used tokens (kv_cache_usage_perc x capacity),
    prefix-cache counters, running/waiting, preemptions; two pages evicted, then the cache
    cleared and two new pages stored (the last one short); no lost batch."""
    src = source("vllm", "0.32.0", 32, 384, ["evictions", "hit_rate", "pages", "requests.counts", "usage.used"], [])
    recorder = AttachRecorder(path, src, snapshot_every=2, flush_interval_s=0.05)
    vllm = {"num_waiting": 0, "preemptions_total": 0}
    recorder.apply(
        batch(
            Stored((11, 12, 13), None, tokens(96, 3), 32, "device"),
            Stored((21, 22), None, tokens(64, 200), 32, "device"),
        )
    )
    recorder.tick(scrape(384, **vllm, used_tokens=160, num_running=2, prompt_tokens_total=600, cached_tokens_total=128))
    recorder.apply(batch(Removed((13, 22), "device")))
    recorder.tick(scrape(384, **vllm, used_tokens=96, num_running=1, prompt_tokens_total=900, cached_tokens_total=256))
    recorder.apply(batch(Cleared()))
    recorder.apply(batch(Stored((31, 32), None, tokens(52, 300), 32, "device")))
    recorder.tick(scrape(384, **vllm, used_tokens=52, num_running=1, prompt_tokens_total=1000, cached_tokens_total=300))
    recorder.close({"delivered": 4, "lost_batches": 0, "gaps": 0, "restarts": 0, "bad_messages": 1})
    return path


def sglang_like(path: Path) -> Path:
    """SGLang 0.5.5 with HiCache: pages of 16; two device pages backed up to the host and a page
    stored on the host only; then one device page moved to the host, one evicted, the host-only
    page loaded back; then the backup dropped from the host and another device page evicted.
    Its pool split, host tier and host-hit counter; two lost batches; a known-bad stream warning."""
    warnings = ["SGLang 0.5.5 <= 0.5.6: split-remove bug: the rebuilt tree is unreliable"]
    src = source(
        "sglang",
        "0.5.5",
        16,
        1024,
        ["evictions", "hit_rate", "host_tier", "pages", "requests.counts", "usage.split", "usage.used"],
        warnings,
    )
    recorder = AttachRecorder(path, src, snapshot_every=2, flush_interval_s=0.05)

    def tick(
        available: int,
        evictable: int,
        running: int,
        prompts: int,
        hits: int,
        evicted: int,
        host_used: int,
        host_hits: int,
    ) -> None:
        recorder.tick(
            scrape(
                1024,
                available_tokens=available,
                evictable_tokens=evictable,
                used_tokens=1024 - available - evictable,
                host_used_tokens=host_used,
                host_total_tokens=2048,
                num_running=running,
                num_waiting=0,
                prompt_tokens_total=prompts,
                cached_tokens_total=hits,
                host_cached_tokens_total=host_hits,
                evicted_tokens_total=evicted,
            )
        )

    recorder.apply(
        batch(
            Stored((1, 2, 3), None, tokens(48, 3), 16, "device"),
            Stored((4,), None, tokens(16, 100), 16, "device"),
            Stored((5,), 4, tokens(16, 116), 16, "host"),
            Stored((1, 2), None, tokens(32, 3), 16, "host"),
        )
    )
    tick(900, 64, 1, 200, 48, 0, 48, 0)
    recorder.apply(
        batch(Removed((2,), "device"), Removed((3,), "device"), Stored((5,), 4, tokens(16, 116), 16, "device"))
    )
    tick(940, 48, 1, 400, 112, 32, 32, 16)
    recorder.apply(batch(Removed((2,), "host"), Removed((4,), "device")))
    tick(960, 32, 0, 480, 160, 48, 32, 32)
    recorder.close({"delivered": 3, "lost_batches": 2, "gaps": 1, "restarts": 0, "bad_messages": 0})
    return path


def bare(path: Path) -> Path:
    """A source that gives its capacity and nothing else: its KV events not subscribed (the
    recorder still writes its root-only snapshot at close), every usage column NULL but the
    capacity."""
    recorder = AttachRecorder(
        path, {**source("vllm", "0.9.0", 16, 512, [], []), "kv_events": None}, flush_interval_s=0.05
    )
    for _ in range(3):
        recorder.tick(scrape(512))
    recorder.close({"delivered": 0, "lost_batches": 0, "gaps": 0, "restarts": 0, "bad_messages": 0})
    return path


BUILDERS = {"vllm": vllm_like, "sglang": sglang_like, "bare": bare}


@pytest.fixture(scope="module")
def captures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("attached")
    return {name: build(folder / f"{name}.db") for name, build in BUILDERS.items()}


def open_page(db: Path, monkeypatch: pytest.MonkeyPatch, page: str = "overview") -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    if page != "overview":
        at.switch_page(f"kvscope/dashboard/app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def rows(db: Path, sql: str) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        found = [dict(r) for r in conn.execute(sql)]
    conn.close()
    return found


def last_usage(db: Path) -> dict[str, Any]:
    return rows(db, "SELECT * FROM usage WHERE run_id = 1 ORDER BY step DESC LIMIT 1")[0]


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def texts(at: AppTest) -> list[str]:
    return [e.value for kind in ("caption", "markdown", "info", "warning", "error", "success") for e in at.get(kind)]


def event_rows(db: Path, columns: list[str], kinds: list[EventKind] | None = None) -> list[dict[str, Any]]:
    """Run 1's events as records, read through the Capture API (either layout)."""
    capture = Capture(db)
    try:
        return list(capture.events(1, kinds=kinds, limit=None, columns=columns).to_dict("records"))
    finally:
        capture.close()


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_on_an_attached_capture_with_its_captions(
    captures: dict[str, Path], name: str, page: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures[name], monkeypatch, page)
    assert at.header[0].value.lower().startswith(page[:4] if page != "tree" else "radix")
    shown = texts(at)
    for thing in CAPTIONS[page]:
        assert shown.count(ATTACHED.cannot_show(thing)) == 1, (page, thing)
    assert not at.success  # nothing is ever called clean
    assert any(f"Attached to {name if name != 'bare' else 'vllm'}" in t for t in shown)


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_the_overview_shows_the_source_and_the_captures_numbers(
    captures: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = captures[name]
    at = open_page(db, monkeypatch)
    config = json.loads(rows(db, "SELECT config FROM runs")[0]["config"])["source"]
    assert any(f"Attached to {config['engine']} {config['version']} at {URL}" in m.value for m in at.markdown)
    last = last_usage(db)
    shown = metrics(at)
    assert shown["capacity (tokens)"] == f"{last['full_total']:,}"
    assert shown["used (tokens)"] == f"{last['full_used']:,}"
    snapshot = rows(
        db, "SELECT tier, num_tokens FROM tree_snapshots WHERE step = (SELECT max(step) FROM tree_snapshots)"
    )
    assert shown["cached tokens"] == f"{sum(r['num_tokens'] for r in snapshot if 'device' in r['tier']):,}"
    assert shown["hit rate: tokens"] == f"{last['cum_hit_tokens'] / last['cum_prompt_tokens']:.1%}"
    first = rows(db, "SELECT * FROM usage ORDER BY step LIMIT 1")[0]
    span = (last["cum_hit_tokens"] - first["cum_hit_tokens"]) / (last["cum_prompt_tokens"] - first["cum_prompt_tokens"])
    assert shown["hit rate while attached"] == f"{span:.1%}"
    assert shown["running / waiting"] == f"{last['num_running']} / {last['num_waiting']}"
    counters = json.loads(rows(db, "SELECT body FROM reports WHERE kind = 'attach'")[0]["body"])
    for key in attached.COUNTERS:
        assert shown[key.replace("_", " ")] == f"{counters[key]:,}"
    verdict = [i.value for i in at.info if attached.VERDICT_TITLE in i.value]
    assert len(verdict) == 1 and "engine-log" in verdict[0] and "clean" not in verdict[0].lower()
    warnings = [w.value for w in at.warning]
    for line in config["warnings"]:
        assert any(line in w for w in warnings)
    assert any("may be incomplete" in w for w in warnings) == (counters["lost_batches"] > 0)
    if "usage.split" in config["provides"]:
        assert shown["available (tokens)"] == f"{last['full_available']:,}"
        assert shown["evictable (tokens)"] == f"{last['full_evictable']:,}"
    else:
        assert "available (tokens)" not in shown
        assert any(c.value.startswith("Free and evictable tokens: not provided.") for c in at.caption)


def test_a_source_without_counters_says_not_provided(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["bare"], monkeypatch)
    shown = metrics(at)
    assert shown["capacity (tokens)"] == "512"
    for label in (
        "used (tokens)",
        "cached tokens",
        "hit rate: tokens",
        "hit rate while attached",
        "running / waiting",
        "evicted tokens",
        "preemptions",
    ):
        assert shown[label] == "not provided", label
    assert rows(captures["bare"], "SELECT count(*) AS n FROM tree_snapshots")[0]["n"] >= 1  # the root only
    for page in ("memory", "requests", "tree", "evictions"):
        at = open_page(captures["bare"], monkeypatch, page)
        assert not at.get("plotly_chart"), page  # nothing to draw: captions, never an empty chart


def test_evicted_tokens_are_labelled_by_where_the_number_comes_from(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM exports no eviction counter: its number is the KV events' device removals."""
    vllm = metrics(open_page(captures["vllm"], monkeypatch))
    assert "evicted tokens (engine counter)" not in vllm
    assert vllm["evicted tokens (from KV events)"] == f"{last_usage(captures['vllm'])['cum_evicted_tokens']:,}"
    sglang = metrics(open_page(captures["sglang"], monkeypatch))
    assert sglang["evicted tokens (engine counter)"] == f"{last_usage(captures['sglang'])['cum_evicted_tokens']:,}"


def legend_counts(at: AppTest) -> int:
    """The nodes the icicle's legend counts, over its entries ("device (3 nodes)")."""
    spec = next(
        json.loads(c.proto.spec)
        for c in at.get("plotly_chart")
        if json.loads(c.proto.spec)["data"][0]["type"] == "icicle"
    )
    names = [t["name"] for t in spec["data"][1:]]
    return sum(int(n.rsplit("(", 1)[1].split()[0].replace(",", "")) for n in names)


def test_the_tree_legend_counts_the_pages_the_caption_names(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["sglang"], monkeypatch, "tree")
    caption = next(c.value for c in at.caption if c.value.startswith("Snapshot at step "))
    assert legend_counts(at) == int(caption.split(": ", 1)[1].split(" pages")[0].replace(",", ""))


def test_the_evictions_page_counts_the_evict_events_by_reason(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, reasons in (("vllm", {"capacity", "reset"}), ("sglang", {"capacity", "to-host"})):
        db = captures[name]
        evicts = event_rows(db, ["reason", "num_tokens"], kinds=[EventKind.EVICT])
        at = open_page(db, monkeypatch, "evictions")
        shown = metrics(at)
        assert shown["evictions (pages)"] == f"{len(evicts):,}"
        assert shown["evicted tokens"] == f"{sum(e['num_tokens'] for e in evicts):,}"
        assert shown["reasons"] == ", ".join(sorted(reasons)) == ", ".join(sorted({e["reason"] for e in evicts}))
        table = at.dataframe[0].value
        assert (
            dict(zip(table["reason"], table["num_evictions"], strict=True))
            == pd.Series([e["reason"] for e in evicts]).value_counts().to_dict()
        )
        assert len(at.get("plotly_chart")) == 1


def test_the_tiers_page_shows_the_host_tier_only_when_provided(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["vllm"], monkeypatch, "tiers")
    assert any("provides no host tier" in c.value for c in at.caption) and not at.get("plotly_chart")
    db = captures["sglang"]
    at = open_page(db, monkeypatch, "tiers")
    last, shown = last_usage(db), metrics(at)
    host_used = last["host_total"] - last["host_available"]
    assert shown["host tokens allocated"] == f"{host_used:,} of {last['host_total']:,}"
    assert shown["host-tier share of hits"] == f"{last['cum_host_hit_tokens'] / last['cum_hit_tokens']:.1%}"
    counts = pd.Series([r["kind"] for r in event_rows(db, ["kind"])]).value_counts().to_dict()
    assert shown["backed up to the host"] == str(counts["write"])
    assert shown["loaded back"] == str(counts["revive"])
    assert shown["host evictions"] == str(counts["host_evict"])
    snapshot = rows(
        db, "SELECT tier, num_tokens FROM tree_snapshots WHERE step = (SELECT max(step) FROM tree_snapshots)"
    )
    host_tokens = sum(r["num_tokens"] for r in snapshot if "host" in r["tier"])
    assert host_tokens > 0 and shown["host-tier pages' tokens"] == f"{host_tokens:,}"
    assert len(at.get("plotly_chart")) == 1


def icicle_colours(at: AppTest) -> dict[str, str]:
    spec = next(
        json.loads(c.proto.spec)
        for c in at.get("plotly_chart")
        if json.loads(c.proto.spec)["data"][0]["type"] == "icicle"
    )
    icicle = spec["data"][0]
    return dict(zip(icicle["ids"], icicle["marker"]["colors"], strict=True))


def test_the_tree_page_colours_pages_by_tier(captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    db = captures["sglang"]
    steps = [r["step"] for r in rows(db, "SELECT DISTINCT step FROM tree_snapshots ORDER BY step")]
    assert len(steps) >= 2
    at = open_page(db, monkeypatch, "tree")
    for step in (steps[-1], steps[0]):
        if step != steps[-1]:
            at.select_slider(key="attached.tree.step").set_value(step).run()
            assert not at.exception
        pages = rows(db, f"SELECT node_id, tier FROM tree_snapshots WHERE step = {step} AND parent_id IS NOT NULL")
        assert any(c.value.startswith(f"Snapshot at step {step}: {len(pages)} pages") for c in at.caption)
        expected = {str(r["node_id"]): charts.TIER_COLORS[attached.tier_category(r["tier"])] for r in pages}
        assert expected.items() <= icicle_colours(at).items()
        assert sorted(at.dataframe[0].value["node_id"].tolist()) == sorted(r["node_id"] for r in pages)
    tiers = {r["tier"] for r in rows(db, "SELECT tier FROM tree_snapshots WHERE parent_id IS NOT NULL")}
    assert {"device", "device+host", "host"} <= tiers  # every colour is drawn somewhere


def test_the_requests_page_draws_what_the_engine_reports(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    db = captures["vllm"]
    at = open_page(db, monkeypatch, "requests")
    specs = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    running = next(t for s in specs for t in s["data"] if t.get("name") == "running")
    assert decode(running["y"]) == [r["num_running"] for r in rows(db, "SELECT num_running FROM usage ORDER BY step")]
    rate = next(t for s in specs for t in s["data"] if t.get("name") == "token hit rate")
    usage = rows(db, "SELECT cum_hit_tokens, cum_prompt_tokens FROM usage ORDER BY step")
    assert decode(rate["y"]) == pytest.approx([r["cum_hit_tokens"] / r["cum_prompt_tokens"] for r in usage])


def decode(raw: Any) -> list[float]:
    if isinstance(raw, dict):
        return [float(v) for v in np.frombuffer(base64.b64decode(raw["bdata"]), dtype=raw["dtype"])]
    return [float(v) for v in raw]


def test_the_verdict_of_an_attached_run_is_never_clean() -> None:
    verdict = attached_verdict()
    assert verdict.level == "not known" and "engine-log" in " ".join(verdict.lines)


def test_an_engine_run_has_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    with sqlite3.connect(ROOT / "sample_runs" / "shared-prefix.db") as conn:
        conn.row_factory = sqlite3.Row
        run = conn.execute("SELECT * FROM runs").fetchone()
    conn.close()
    assert attached.source_of(pd.Series(dict(run))) is None
    assert attached.source_of(pd.Series({"config": json.dumps({"source": {"kind": "other"}})})) is None
    assert attached.counters_of("not json") is None and attached.counters_of(None) is None


def test_the_capacity_page_names_the_engines_pool_and_draws_no_curve(
    captures: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(captures["vllm"], monkeypatch, "capacity")
    assert any(c.value.startswith("The attached engine's pool: 384 tokens in 12 pages of 32.") for c in at.caption)
    assert metrics(at)["pages of 32"]  # the planner plans in the engine's page size
    assert any(
        c.value.startswith("Hit rate vs cache capacity for this engine's traffic: not provided.") for c in at.caption
    )
    assert not at.get("plotly_chart")


def test_a_running_attach_shows_its_scrapes_and_no_counters_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "live.db"
    src = source("vllm", "0.32.0", 32, 384, ["hit_rate", "pages", "usage.used"], [])
    recorder = AttachRecorder(db, src, snapshot_every=1, flush_interval_s=0.05)
    try:
        recorder.apply(batch(Stored((7,), None, tokens(32, 3), 32, "device")))
        recorder.tick(scrape(384, used_tokens=32, prompt_tokens_total=64, cached_tokens_total=16))
        recorder.sql.flush()
        at = open_page(db, monkeypatch)
        assert any("**running**" in c.value for c in at.caption)
        shown = metrics(at)
        assert (shown["used (tokens)"], shown["cached tokens"], shown["hit rate: tokens"]) == ("32", "32", "25.0%")
        assert "lost batches" not in shown
        assert any("stored when `kvscope attach` ends" in c.value for c in at.caption)
        assert not at.success and any(attached.VERDICT_TITLE in i.value for i in at.info)
    finally:
        recorder.close({"delivered": 1, "lost_batches": 0, "gaps": 0, "restarts": 0, "bad_messages": 0})
