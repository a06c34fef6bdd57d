"""The Tiers page and the tree coloured by tier, on real captures: a hiradix run recorded by the real
engine into SQLite shows both tiers with the numbers of its usage rows (read here straight from
the file), rates in tokens and bytes; a single-tier run (radix, and every sample capture, schema
version 1 included) gets one caption; the tree's tier legend names the tiers present; a capture
still being written refreshes the page."""

from __future__ import annotations

import base64
import json
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from kvscope.app.runner import kv_fingerprint, to_engine_requests
from kvscope.dashboard import charts, data
from kvscope.engine.config import CacheConfig, EngineConfig, PoolConfig, SchedulerConfig
from kvscope.engine.engine import Engine
from kvscope.engine.model import model_config
from kvscope.telemetry import Capture, PoolTerms, UsageSample
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.workloads import generate
from tests.dashboard.conftest import ROOT, SAMPLES

TIERS_PAGE = "kvscope/dashboard/app_pages/tiers.py"
TREE_PAGE = "kvscope/dashboard/app_pages/tree.py"
HOST_TOKENS = 300  # below the multi-turn working set: nodes leave the host too
BYTES_PER_TOKEN = kv_fingerprint(model_config("tiny"))["full_bytes_per_token"]


def record(path: Path, cache: CacheConfig, num_requests: int) -> Path:
    """A real engine run recorded at level full, with the run config `kvscope run` writes."""
    model = model_config("tiny")
    config = EngineConfig(
        pool=PoolConfig(kv_size_tokens=622, max_running_requests=16, max_context_len=2048),
        cache=cache,
        scheduler=SchedulerConfig(chunked_prefill_size=64),
        device="cpu",
    )
    recorder = SQLRecorder(
        path, level="full", label=cache.kind, config={"engine": config.fingerprint(), "kv": kv_fingerprint(model)}
    )
    engine = Engine(config, model, recorder)
    engine.run(to_engine_requests(generate("multi-turn", num_requests=num_requests, seed=0)))
    recorder.close()
    engine.check_integrity()
    assert engine.stats.num_finished == num_requests
    return path


def record_hiradix(path: Path) -> Path:
    """write_back with a small host: device evictions go to the host, host copies are evicted, and
    later turns load their history back."""
    return record(path, CacheConfig(kind="hiradix", write_policy="write_back", host_tokens=HOST_TOKENS), 40)


@pytest.fixture(scope="module")
def hiradix_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_hiradix(tmp_path_factory.mktemp("tiers") / "hiradix.db")


@pytest.fixture(scope="module")
def radix_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("tiers") / "radix.db", CacheConfig(kind="radix"), num_requests=6)


def open_page(db: Path, monkeypatch: pytest.MonkeyPatch, page: str = TIERS_PAGE) -> AppTest:
    monkeypatch.setenv("KVSCOPE_DB", str(db))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    at.switch_page(page).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def usage_rows(db: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        rows = [dict(r) for r in conn.execute("SELECT * FROM usage WHERE run_id = 1 ORDER BY step")]
    conn.close()
    return rows


def count_events(db: Path, column: str, value: str) -> int:
    """Events of run 1 whose `column` is `value`, read through the Capture API (either layout)."""
    capture = Capture(db)
    try:
        events = capture.events(1, limit=None, columns=[column])
    finally:
        capture.close()
    return int((events[column] == value).sum())


def figures(at: AppTest) -> dict[str, dict[str, Any]]:
    """Each chart's plotly spec by its first trace's name."""
    specs = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    return {spec["data"][0].get("name", ""): spec for spec in specs}


def trace(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in spec["data"] if t.get("name") == name)


def values(spec: dict[str, Any], name: str, axis: str = "y") -> list[float]:
    """A trace's values (plotly sends numeric arrays base64-encoded: {"dtype", "bdata"})."""
    raw = trace(spec, name)[axis]
    if isinstance(raw, dict):
        return [float(v) for v in np.frombuffer(base64.b64decode(raw["bdata"]), dtype=raw["dtype"])]
    return [float("nan") if v is None else float(v) for v in raw]


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def test_the_tiers_page_shows_both_tiers_with_the_captures_numbers(
    hiradix_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = usage_rows(hiradix_db)
    assert len(rows) < data.MAX_POINTS  # not downsampled: every row is a point
    last = rows[-1]
    assert last["cum_loaded_tokens"] > 0 and last["cum_host_hit_tokens"] > 0  # both directions happened
    at = open_page(hiradix_db, monkeypatch)
    shown = metrics(at)
    device_allocated = last["full_total"] - last["full_available"]
    host_allocated = last["host_total"] - last["host_available"]
    assert shown["device tokens allocated"] == f"{device_allocated:,} of {last['full_total']:,}"
    assert shown["host tokens allocated"] == f"{host_allocated:,} of {last['host_total']:,}"
    assert shown["host-tier share of hits"] == f"{last['cum_host_hit_tokens'] / last['cum_hit_tokens']:.1%}"
    assert shown["tokens written to host"] == f"{last['cum_written_tokens']:,}"
    assert shown["tokens loaded from host"] == f"{last['cum_loaded_tokens']:,}"
    host_evictions = count_events(hiradix_db, "kind", "host_evict")
    to_host = count_events(hiradix_db, "reason", "to-host")
    assert host_evictions > 0 and to_host > 0
    assert (shown["host evictions"], shown["device evictions kept on host"]) == (f"{host_evictions:,}", f"{to_host:,}")

    specs = figures(at)
    tokens = specs["device allocated"]
    assert values(tokens, "host allocated") == [float(r["host_total"] - r["host_available"]) for r in rows]
    assert values(tokens, "device allocated") == [float(r["full_total"] - r["full_available"]) for r in rows]
    assert set(values(tokens, "host total")) == {float(HOST_TOKENS + 1)}  # + the host pool's reserved slot
    seconds = np.diff([r["t_mono"] for r in rows])
    loaded = np.diff([r["cum_loaded_tokens"] for r in rows]) / seconds
    rates = specs[charts.tiers.WRITTEN]
    assert values(rates, charts.tiers.LOADED) == pytest.approx(list(loaded), nan_ok=True)
    share = values(specs["host-tier share of hit tokens"], "host-tier share of hit tokens")
    assert share[-1] == pytest.approx(last["cum_host_hit_tokens"] / last["cum_hit_tokens"])


def test_rates_in_bytes_are_tokens_times_the_kv_bytes_of_a_token(
    hiradix_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = open_page(hiradix_db, monkeypatch)
    in_tokens = values(figures(at)[charts.tiers.WRITTEN], charts.tiers.WRITTEN)
    at.radio(key="tiers.unit").set_value("bytes").run()
    spec = figures(at)[charts.tiers.WRITTEN]
    assert spec["layout"]["yaxis"]["title"]["text"] == "bytes / s"
    in_bytes = values(spec, charts.tiers.WRITTEN)
    assert in_bytes == pytest.approx([v * BYTES_PER_TOKEN for v in in_tokens], nan_ok=True)
    assert max(in_bytes) > 0


def test_a_capture_without_the_kv_size_shows_tokens_and_says_why(
    hiradix_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older = tmp_path / "no-kv.db"
    older.write_bytes(hiradix_db.read_bytes())
    with sqlite3.connect(older) as conn:
        config = json.loads(conn.execute("SELECT config FROM runs WHERE id = 1").fetchone()[0])
        del config["kv"]
        conn.execute("UPDATE runs SET config = ? WHERE id = 1", (json.dumps(config),))
    conn.close()
    at = open_page(older, monkeypatch)
    assert not at.get("radio")
    assert any("In tokens only" in c.value and "full_bytes_per_token" in c.value for c in at.caption)
    assert "MiB" not in metrics(at)["written rate (run average)"]


def test_a_single_tier_run_gets_one_caption(radix_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(radix_db, monkeypatch)
    assert [c.value for c in at.caption if "one tier" in c.value] == [
        "This run used the radix cache: one tier (the device). A host tier needs `--cache hiradix` (and a capture "
        "of schema version 4 or later)."
    ]
    assert not at.get("plotly_chart") and not at.metric and not at.error


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_older_and_single_tier_samples_open_the_tiers_page(sample: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(sample, monkeypatch)
    assert at.header[0].value == "Tiers"
    assert any("one tier (the device)" in c.value for c in at.caption)


def test_damaged_events_are_one_line_and_the_usage_charts_stay(
    hiradix_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscope.telemetry import store

    path = tmp_path / "damaged.db"
    path.write_bytes(hiradix_db.read_bytes())
    with sqlite3.connect(path) as conn:
        # NOTE: chunks without summaries (as written before schema 10) nor their run's fold (14): the page's
        # eviction sums then read the events themselves, which are damaged below
        conn.execute("UPDATE event_chunks SET kind_counts = NULL, groups = NULL")
        conn.execute("DELETE FROM run_summaries")
        conn.commit()
        conn.execute("VACUUM")
        page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
        # NOTE: every page of the packed event columns (leaves and the blobs' overflow pages)
        leaves = [
            p
            for (p,) in conn.execute(
                "SELECT pageno FROM dbstat WHERE name = 'event_columns' AND pagetype IN ('leaf', 'overflow')"
            )
        ]
    conn.close()
    with path.open("r+b") as fh:
        for page in leaves:  # the events only: runs and usage stay readable
            fh.seek(page_size * (page - 1))
            fh.write(random.Random(page).randbytes(page_size))
    monkeypatch.setattr(store, "QUICK_CHECK_MAX_BYTES", 0)
    at = open_page(path, monkeypatch)
    assert [e.value for e in at.error] == [f"{path}: damaged capture (database disk image is malformed)"]
    assert len(at.get("plotly_chart")) == 3 and "host evictions" not in metrics(at)


def tier_legend(at: AppTest) -> list[str]:
    icicle = next(
        spec
        for spec in map(json.loads, (c.proto.spec for c in at.get("plotly_chart")))
        if spec["data"][0]["type"] == "icicle"
    )
    return sorted(t["name"] for t in icicle["data"] if t["type"] == "scatter")


def test_the_tree_coloured_by_tier_names_the_tiers_present(hiradix_db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(hiradix_db, monkeypatch)
    at.button(key="tiers.to_tree").click().run()  # the Tiers page's way to the tree
    assert not at.exception and at.header[0].value == "Radix tree"
    assert at.selectbox(key="tree.color").value == "tier"
    step = int(at.slider(key="tree.step").value)
    capture = Capture(hiradix_db)
    nodes = capture.tree_at(1, step)
    capture.close()
    counts = nodes[nodes["parent_id"].notna()]["tier"].value_counts()  # NOTE: the root is no node of the legend
    assert len(counts) >= 2  # a finished write_back run keeps host-only nodes beside device ones
    assert tier_legend(at) == sorted(f"{tier} ({n:,} node{'' if n == 1 else 's'})" for tier, n in counts.items())


def test_a_table_without_tiers_is_all_device() -> None:
    from tests.dashboard.test_charts import NODES

    fig = charts.tree_figure(charts.subtree_values(NODES), "tier")
    assert [t.name for t in fig.data if t.type == "scatter"] == ["device (4 nodes)"]  # NOTE: the root is no node
    assert set(fig.data[0].marker.colors) == {charts.TIER_COLORS["device"]}


def test_copy_rates_divide_by_the_time_between_rows() -> None:
    usage = pd.DataFrame(
        {
            "step": [0, 4, 9],
            "t_mono": [0.0, 2.0, 2.0],
            "cum_written_tokens": [0, 100, 150],
            "cum_loaded_tokens": [0, 0, 30],
        }
    )
    rates = charts.copy_rates(usage, bytes_per_token=8)
    assert rates["written_tokens_per_s"].iloc[0] == 50 and rates["written_bytes_per_s"].iloc[0] == 400
    assert rates["loaded_tokens_per_s"].isna().iloc[1]  # no time passed: no rate, never infinity


@pytest.fixture
def live_capture(tmp_path: Path) -> Iterator[tuple[Path, SQLRecorder]]:
    recorder = SQLRecorder(tmp_path / "live.db", level="summary", label="live-tiers")
    try:
        yield tmp_path / "live.db", recorder
    finally:
        recorder.close()


def host_sample(step: int) -> UsageSample:
    """Step s: the host holds 10 s tokens of 200, 5 s of the 20 s hit tokens came from it."""
    return UsageSample(
        step,
        PoolTerms(100, 60, 30, 10),
        None,
        4,
        2,
        2,
        0,
        40 * step,
        20 * step,
        step,
        step,
        0,
        0,
        host=PoolTerms(200, 200 - 10 * step, 10 * step, 0),
        cum_host_hit_tokens=5 * step,
        cum_written_tokens=10 * step,
        cum_loaded_tokens=5 * step,
    )


def test_a_running_capture_refreshes_the_tiers_page(
    live_capture: tuple[Path, SQLRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    db, recorder = live_capture
    for step in range(1, 4):
        recorder.step = step
        recorder.usage(host_sample(step))
    recorder.flush()
    at = open_page(db, monkeypatch)
    assert any(c.value.startswith("run 1 · **running** · refreshing every second") for c in at.caption)
    assert metrics(at)["host tokens allocated"] == "30 of 200"
    assert metrics(at)["host-tier share of hits"] == "25.0%"
    recorder.step = 4
    recorder.usage(host_sample(4)._replace(host=PoolTerms(200, 120, 80, 0), cum_host_hit_tokens=40))
    recorder.flush()
    time.sleep(data.LIVE_TTL_S + 0.1)  # the run list (and so the read stamp) is cached for LIVE_TTL_S
    at.run()
    assert not at.exception
    assert metrics(at)["host tokens allocated"] == "80 of 200"
    assert metrics(at)["host-tier share of hits"] == "50.0%"
    assert values(figures(at)["device allocated"], "host allocated") == [10.0, 20.0, 30.0, 80.0]


def test_copy_locks_are_held_by_their_copy_and_released_at_its_ack(hiradix_db: Path) -> None:
    from kvscope.dashboard.leak_views import held_locks
    from kvscope.telemetry import Capture, EventKind

    capture = Capture(hiradix_db)
    locks = capture.events(1, kinds=[EventKind.LOCK, EventKind.UNLOCK], limit=10_000_000)
    copy_locks = locks[locks["rid"].isna() & locks["reason"].isin(["write", "load"])]
    assert len(copy_locks) > 0
    last_step = int(capture.step_range(1).iloc[0]["hi"])
    assert held_locks(locks, last_step).empty  # a finished run: every copy was acknowledged
    first = copy_locks.iloc[0]
    during = held_locks(locks[locks["seq"] <= first["seq"]], int(first["step"]))
    assert f"{first['reason']} {int(first['aux'])}" in set(during["rid"])  # named by its copy, not "None"
