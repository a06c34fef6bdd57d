"""The probe against SGLang 0.5.23's real memory classes (PagedTokenToKVPoolAllocator, ReqToTokenPool,
UnifiedRadixCache with the Python and the Rust tree core, classic RadixCache, the SWA and Mamba pools
(HybridReqToTokenPool, MambaPool, MambaSlotAllocator), release_kv_cache, the SchedulerInvariantChecker),
installed by SGLang's own load_plugins() and driven through the scheduler's request life by
sglang_probe_driver.py, started under `kvscope instrument` the way an operator starts
SGLang. The capture's leak checks are the probe's page census; `kvscope check` and `report leaks`
judge it. About 40 s per run, mostly SGLang's imports. The clean life, the tail leak, the lock leak
and the double free, and the busy and drain censuses and the crashed run of SGLang's own loop, run on
every release a family of the probe lists as tested (RELEASES: 0.5.18 to 0.5.22 from their unpacked
wheels ahead of the venv's packages; the Rust tree core from 0.5.21 on), each release's cases in one
driver process (its SGLang imported once, a forked child per case: `batched`, `looped`).

Run by `make test-engines` (`pytest -m engines`; KVSCOPE_SGLANG_PYTHON names the venv's python).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from kvscope.probe.sglang import FAMILIES
from kvscope.telemetry import Capture

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("sglang_probe_driver.py")
EXIT_DRIVER = Path(__file__).with_name("sglang_exit_driver.py")
LOOP_DRIVER = Path(__file__).with_name("sglang_loop_driver.py")
EVERY_STEPS = 4  # NOTE: the loop driver's busy census period (it lifts the cost budget: its steps take microseconds)
SGLANG_PYTHON = os.environ.get(
    "KVSCOPE_SGLANG_PYTHON",
    str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope" / "sglang-venv" / "bin" / "python"),
)
# NOTE: the venv's own SGLang; every other release a family lists as tested runs from its unpacked wheel
# (`make sglang-src`: SGLANG_SRC/<release>/sglang), first on the driver's path, with the venv's packages
VENV_RELEASE = "0.5.23"
SGLANG_SRC = Path(
    os.environ.get(
        "KVSCOPE_SGLANG_SRC", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvscope" / "sglang-src"
    )
)
RELEASES = [release for family in FAMILIES for release in family.releases]
TREES = [("unified", "UnifiedTreeCore"), ("rust", "RustUnifiedTreeCore"), ("classic", "RadixCache")]


def has_rust_core(release: str) -> bool:
    """UnifiedRadixCache's Rust tree core (CacheInitParams.tree_core_backend) came with SGLang 0.5.21."""
    return tuple(map(int, release.split("."))) >= (0, 5, 21)


def has_checkpoint(release: str) -> bool:
    """The trees' checkpoint came with SGLang 0.5.22: before, a prefill's tokens go into the tree through
    cache_unfinished_req after the prefill (the driver calls it then), which moves the request's lock."""
    return tuple(map(int, release.split("."))) >= (0, 5, 22)


def rust_or_unified(release: str) -> str:
    return "rust" if has_rust_core(release) else "unified"


pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(
        not Path(SGLANG_PYTHON).exists(), reason=f"no SGLang venv at {SGLANG_PYTHON}: `make test-engines` makes it"
    ),
]


def release_path(release: str) -> list[str]:
    """What goes before the repository on the driver's path for `release`: nothing for the venv's own."""
    if release == VENV_RELEASE:
        return []
    source = SGLANG_SRC / release
    if not (source / "sglang").is_dir():
        pytest.skip(f"SGLang {release}'s source is not unpacked in {SGLANG_SRC}: `make sglang-src` unpacks it")
    return [str(source)]


def kvscope(
    *args: str, env: dict[str, str] | None = None, path: list[str] | None = None, timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "SGLANG_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, **(env or {}), "PYTHONPATH": os.pathsep.join([*(path or []), str(ROOT)])},
        timeout=timeout_s,
        check=False,
    )


def drive(scenario: str, tree: str, capture: Path, level: str = "full", release: str = VENV_RELEASE) -> dict[str, Any]:
    """The driver under `kvscope instrument` on SGLang `release`; its JSON line, and stderr for the
    probe's lines."""
    out = kvscope(
        "instrument",
        "--capture",
        str(capture),
        "--level",
        level,
        "--",
        SGLANG_PYTHON,
        "-W",
        "ignore",
        str(DRIVER),
        scenario,
        tree,
        path=release_path(release),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr
    assert result["served"], result["error"]
    return result


def cases_of(release: str) -> list[str]:
    """The driver's cases (SCENARIO:TREE) the per-release tests below read, run in one driver process per
    release (sglang_probe_driver.run_cases: SGLang imported once, a child per case with its own capture):
    the clean life on each tree the release has, the tail leak, the lock leak and the double free; on 0.5.18,
    whose HiRadixCache overrides the tree methods the probe patches, a tree class that does so."""
    trees = [tree for tree, _ in TREES if tree != "rust" or has_rust_core(release)]
    cases = [f"clean:{tree}" for tree in [*trees, *(["overriding"] if release == "0.5.18" else [])]]
    return [*cases, f"leak-tail:{rust_or_unified(release)}", "lock-leak:unified", "double-free:classic"]


CASE_TIMEOUT_S = 300  # NOTE: a case's share of a driver process's time limit (a loaded machine runs one in minutes)


def run_cases(driver: Path, release: str, cases: list[str], out_dir: Path, env: dict[str, str] | None = None) -> Any:
    """`driver` --cases under `kvscope instrument` on SGLang `release`: case -> its exit code, stdout, stderr
    and capture (run_cases in sglang_probe_driver.py); a str saying why when the driver process failed."""
    command = ["instrument", "--capture", str(out_dir / "parent.db"), "--level", "full", "--", SGLANG_PYTHON]
    command += ["-W", "ignore", str(driver), "--cases", str(out_dir), *cases]
    try:
        out = kvscope(*command, env=env, path=release_path(release), timeout_s=300 + CASE_TIMEOUT_S * len(cases))
    except subprocess.TimeoutExpired as err:
        return f"SGLang {release}'s cases ran past {err.timeout} s"
    if out.returncode != 0:
        return out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def case_result(run: Any, case: str) -> tuple[dict[str, Any], Path]:
    """One case of run_cases: its JSON line with its stderr, and its capture (a failed driver process fails
    each of its cases' tests, run once)."""
    if isinstance(run, str):
        pytest.fail(run)
    found = run[case]
    assert found["code"] == 0, found["stderr"][-3000:]
    result: dict[str, Any] = json.loads(found["stdout"].strip().splitlines()[-1])
    result["stderr"] = found["stderr"]
    return result, Path(found["capture"])


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(scenario, tree, release) -> (the driver's result, its capture), every case of a release run at its
    first ask (cases_of)."""
    runs: dict[str, Any] = {}

    def case(scenario: str, tree: str, release: str) -> tuple[dict[str, Any], Path]:
        if release not in runs:
            out_dir = tmp_path_factory.mktemp(f"sglang-{release}")
            runs[release] = run_cases(DRIVER, release, cases_of(release), out_dir)
        result, capture = case_result(runs[release], f"{scenario}:{tree}")
        assert result["served"], result["error"]
        return result, capture

    return case


def check_clean(capture: Path) -> subprocess.CompletedProcess[str]:
    """`kvscope check` on the capture, which must say clean (exit 0)."""
    check = kvscope("check", str(capture))
    assert check.returncode == 0, check.stdout + check.stderr
    return check


def full_census(point: dict[str, Any]) -> dict[str, Any]:
    assert point["census"] is not None
    return next(c for c in point["census"] if c["pool"] == "full")


@pytest.mark.parametrize(
    ("tree", "core", "release"),
    [(tree, core, release) for release in RELEASES for tree, core in TREES if tree != "rust" or has_rust_core(release)],
)
def test_a_clean_request_life_checks_clean_on_each_tree(batched: Any, tree: str, core: str, release: str) -> None:
    result, capture = batched("clean", tree, release)
    assert result["said"] == "registered" and result["patched"] and result["core"] == core
    assert set(result["made_by"].values()) == {"sglang_hooks.py"}, result[
        "made_by"
    ]  # patched directly, no AROUND layer
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False, False]
    assert all(c["ok"] for p in result["points"] for c in p["census"])
    assert full_census(result["points"][1])["live"] == 3  # req-D's three pages, running across the idle point
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        source = json.loads(run.config)["source"]
        assert (source["engine"], source["dp_rank"]) == ("sglang", None) and " probe pid " in run.label
        events = db.events(int(run.id), limit=10_000)
        assert {"alloc", "free", "match", "insert", "lock", "unlock", "evict"} <= set(events.kind), set(events.kind)
        assert events[events.kind == "alloc"].rid.isna().all()  # a batch's (prepare): bind names each page's taker
        allocs = events[events.kind == "alloc"]
        rows = zip(allocs.step, allocs.pool, allocs.slots, strict=True)
        taken = [(step, pool, page) for step, pool, pages in rows for page in array("i", pages)]
        assert len(taken) == len(set(taken))  # one alloc event per page and step: bind names takers silently
        hits = events[(events.kind == "match") & (events.rid == "req-B")]
        assert list(hits.num_tokens) == [12]  # the shared 12-token system prompt, three pages
        checks = db.leak_checks(int(run.id))
        assert set(checks.pool) == {"full", "req"} and checks.ok.astype(bool).all()
        assert set(db.requests(int(run.id)).rid) == {"req-A", "req-B", "req-C", "req-D", "req-E"}
        steps = db.snapshot_steps(int(run.id))
        assert steps == sorted(set(checks.step)), steps  # a tree snapshot at each idle census
        nodes = db.tree_at(int(run.id), steps[1])
        assert nodes.parent_id.isna().sum() == 1  # one root; every other node hangs below it
        body = nodes[nodes.parent_id.notna()]
        assert set(body.parent_id.astype(int)) <= set(nodes.node_id.astype(int))
        resident = body[~body.tombstone.astype(bool)]
        assert resident.num_tokens.sum() == full_census(result["points"][1])["tree"] * 4  # the tree's pages
        if tree != "rust":  # the Rust core keeps its nodes (and their tokens) in Rust: pages, no preview
            assert any(p.startswith("100 101 102 103") for p in body.token_preview), list(body.token_preview)
        usage = db.usage(int(run.id))
        assert list(usage.step) == list(range(1, int(usage.step.max()) + 1))  # a usage sample per step
        assert (usage.full_total == 64).all() and usage.full_available.between(0, 64).all()
        at_idle = usage.set_index("step").loc[steps]
        assert list(at_idle.full_available) == [c["free"] * 4 for c in map(full_census, result["points"])]
    finally:
        db.close()
    check = check_clean(capture)
    assert f"clean: 3 censuses (3 idle) of the sglang {release} probe's page census held" in check.stdout


def test_a_tree_class_that_overrides_a_patched_tree_method_stops_recording_in_one_line(batched: Any) -> None:
    """SGLang 0.5.18 builds HiRadixCache for a plain model with --enable-hierarchical-cache, and it overrides
    the RadixCache methods the probe patches (match, insert, evict, locks): its calls would go unseen and the
    lock ledger be partial. A tree class overriding one (OverridingRadixCache's inc_lock_ref) stops recording
    at its first step, in one line naming the class and the method; the run closes incomplete and `kvscope
    check` says inconclusive (exit 3), never clean."""
    result, capture = batched("clean", "overriding", "0.5.18")
    said = (
        "kvscope probe: recording stopped: SGLang 0.5.18: OverridingRadixCache.inc_lock_ref overrides the tree "
        "method the probe patched, so its calls go unseen; nothing more is recorded (no partial ledger)"
    )
    assert said in result["stderr"] and all(p["census"] is None for p in result["points"])
    run, checks, _ = stored(capture)
    assert run.status == "incomplete" and checks.empty, (run.status, checks)
    check = kvscope("check", str(capture))
    assert check.returncode == 3 and "inconclusive: the capture is incomplete" in check.stdout, check.stdout


def test_a_data_parallel_replicas_run_names_its_rank(tmp_path: Path) -> None:
    """A scheduler a DP controller spawned for replica 1 (SGLang publishes the rank for the process): its
    run is labelled and configured with the rank, as the vLLM probe's are."""
    capture = tmp_path / "dp.db"
    result = drive("dp", "unified", capture)
    assert all(c["ok"] for p in result["points"] for c in p["census"])
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert json.loads(run.config)["source"]["dp_rank"] == 1
        assert run.label.startswith("sglang 0.5.23 probe dp 1 pid "), run.label
    finally:
        db.close()


@pytest.mark.parametrize("release", RELEASES)
def test_a_forgotten_tail_page_is_named_with_its_request_before_sglang_raises(
    tmp_path: Path, batched: Any, release: str
) -> None:
    result, capture = batched("leak-tail", rust_or_unified(release), release)
    page = result["injected"][0]["page"]
    point = result["points"][1]
    assert point["sglang"]["raised"].startswith("pool memory leak detected!")  # SGLang's own check: totals only
    line = (
        f"page census (SGLang's leak check failed) at step 10, capture {capture} run 1: [full] 1 page leaked "
        f"(in no free list, tree or live row): page {page} (slots {page * 4}-{page * 4 + 3}) last taken by "
        "request req-C (decode at step 9)"
    )
    assert f"kvscope probe: {line}" in result["stderr"]  # written before the ValueError, into SGLang's log
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"page {page} (slots {page * 4}-{page * 4 + 3}) last taken by request req-C" in check.stdout
    report = kvscope("report", "leaks", str(capture))
    assert "first failure at step 10" in report.stdout and "verdict: leak (kvscope check exits 1)" in report.stdout
    assert "suspect requests" in report.stdout and "req-C" in report.stdout
    log = tmp_path / "server.log"  # the process's stderr: the probe's line, then SGLang's own message
    log.write_text(result["stderr"])
    explained = kvscope("report", "engine-log", str(log))
    assert "pool memory leak detected!" in explained.stdout and "cannot tell" not in explained.stdout
    assert f"culprits: kvscope report leaks {capture} --run 1" in explained.stdout
    assert "last taken by request req-C (decode at step 9)" in explained.stdout


@pytest.mark.parametrize("release", RELEASES)
def test_a_leaked_lock_sglangs_identity_passes_is_named(batched: Any, release: str) -> None:
    result, capture = batched("lock-leak", "unified", release)
    node = result["injected"][0]["node"]
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False, False]  # protected counts as balanced
    assert full_census(result["points"][1])["locks"] == {str(node): ["req-B"]}
    db = Capture(capture)
    try:
        run_id = int(db.runs().iloc[-1].id)
        nodes = db.tree_at(run_id, db.snapshot_steps(run_id)[1])
        assert nodes.set_index("node_id").loc[node].lock_ref == 1  # the snapshot shows the stale lock
        locks = db.events(run_id, kinds=["lock"], limit=None)
        assert locks.rid.notna().all(), locks  # each taken in its request's own call: admission, cache step
    finally:
        db.close()
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    locked_at = 4 if has_checkpoint(release) else 5  # NOTE: the lock its prefill's cache_unfinished_req moved, its own
    line = f"1 tree node still locked by finished requests: node {node} locked by request req-B at step {locked_at}"
    assert line in check.stdout


@pytest.mark.parametrize("release", RELEASES)
def test_a_double_free_is_named_with_the_request_it_was_made_for(batched: Any, release: str) -> None:
    result, capture = batched("double-free", "classic", release)
    page = result["injected"][0]["page"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"1 page freed while in use (a double free): page {page} free and in the tree; last released for "
        "request bad-free"
    ) in check.stdout


@pytest.mark.parametrize("tree", ["classic", "rust"])
def test_a_page_a_double_free_handed_to_a_running_request_while_the_tree_keeps_it_is_named(
    tmp_path: Path, tree: str
) -> None:
    """The tree's page freed again, then taken by req-D's prefill: in no free list, so free / tree /
    row sets balance; it has two owners (the tree and req-D's own row part), and SGLang's identity
    counts it twice and raises. The census before the raise names both holders and the releaser."""
    capture = tmp_path / f"reused-{tree}.db"
    result = drive("double-free-reused", tree, capture)
    page = result["injected"][0]["page"]
    assert result["points"][1]["sglang"]["raised"].startswith("pool memory leak detected!")
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"1 page held twice (a double free handed out a page still in use): page {page} in the tree and request "
        "req-D's row; last released for request bad-free (free at step"
    ) in check.stdout


def test_a_rust_tree_holding_a_page_twice_is_stored_as_evidence_and_its_census_kept(tmp_path: Path) -> None:
    """req-D's release puts the page a double free handed it into a second node of the Rust tree: the
    snapshot lists the page twice (it was a UNIQUE failure that stopped the recorder and lost the
    census). The page's row is its first place, the preview says where else; the census is stored."""
    capture = tmp_path / "in-tree.db"
    result = drive("double-free-in-tree", "rust", capture)
    page = result["injected"][0]["page"]
    assert "recording stopped" not in result["stderr"], result["stderr"][-2000:]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"page {page} in 2 tree nodes; last released for request bad-free" in check.stdout
    db = Capture(capture)
    try:
        run_id = int(db.runs().iloc[-1].id)
        nodes = db.tree_at(run_id, db.snapshot_steps(run_id)[1]).set_index("node_id")
        assert nodes.loc[page].token_preview.endswith("(a page held twice)")
        assert set(nodes.parent_id.dropna().astype(int)) <= set(nodes.index)
    finally:
        db.close()


@pytest.mark.parametrize(
    ("scenario", "tree", "why"),
    [
        ("row-leak", "unified", "SGLang's request-row check failed"),
        ("row-leak", "rust", "SGLang's request-row check failed"),
        ("row-leak", "classic", "SGLang's request-row check failed"),
        ("row-leak-unhooked", "unified", "SGLang's idle check raised"),
    ],
)
def test_a_leaked_row_is_named_before_sglangs_strict_row_check_raises(
    tmp_path: Path, scenario: str, tree: str, why: str
) -> None:
    """req-A's release forgets its row: SGLang's page identity holds, and in its real Scheduler.on_idle
    _check_req_pool raises (strict, its default) before on_idle's end, where the probe's idle census
    ran. The census runs on that raise (the hook on _check_req_pool; without it, the hook around
    on_idle), is stored, and SGLang's error goes on unchanged."""
    capture = tmp_path / f"{scenario}-{tree}.db"
    result = drive(scenario, tree, capture)
    row = result["injected"][0]["row"]
    assert result["points"][0]["sglang"]["raised"].startswith("req_to_token_pool memory leak detected!")
    line = (
        f"page census ({why}) at step 4, capture {capture} run 1: [req] 1 row leaked (in no free list, tree or "
        f"live row): row {row} last taken by request req-A (alloc at step 0)"
    )
    assert f"kvscope probe: {line}" in result["stderr"]
    db = Capture(capture)
    try:
        checks = db.leak_checks(int(db.runs().iloc[-1].id))
        first_check = checks[checks.step == checks.step.min()].set_index("pool")
        assert not bool(first_check.loc["req"].ok) and f"row {row} last taken" in first_check.loc["req"].message
    finally:
        db.close()


@pytest.mark.parametrize("tree", ["unified", "classic"])
def test_a_lock_leaked_in_a_prefill_batch_is_named_with_its_own_request(tmp_path: Path, tree: str) -> None:
    """Two requests in one prefill batch, matched before either is admitted (req-Q last): each one's
    admission lock and its re-lock by SGLang's checkpoint_kv_cache after the prefill are its own, not
    the last matched request's; req-P's leaked lock names req-P, and the lock events replayed (the
    Radix tree page's holders) leave req-P's lock alone held: no finished bystander holds one."""
    from kvscope.dashboard.leak_views import held_locks

    capture = tmp_path / f"batch-{tree}.db"
    result = drive("batch-lock-leak", tree, capture)
    node = result["injected"][0]["node"]
    assert full_census(result["points"][-1])["locks"] == {str(node): ["req-P"]}
    db = Capture(capture)
    try:
        run_id = int(db.runs().iloc[-1].id)
        locks = db.events(run_id, kinds=["lock", "unlock"], limit=None)
        held = held_locks(locks, int(locks.step.max()))
        assert [(int(n), r) for n, r in zip(held.node_id, held.rid, strict=True)] == [(node, "req-P")], held
        cached = db.requests(run_id).set_index("rid").cached_tokens.to_dict()
        assert cached == {"req-A": 0, "req-P": 12, "req-Q": 12}  # SGLang's Req.cached_tokens: the 12-token prefix hit
    finally:
        db.close()


def test_a_double_free_a_batchs_free_group_released_blames_no_bystander(tmp_path: Path) -> None:
    """A free group gathers several requests' frees and releases them at its end, in no request's call:
    the double free's releaser is unknown, said so, and not the request that last matched (req-D)."""
    capture = tmp_path / "group.db"
    result = drive("group-double-free", "classic", capture)
    page = result["injected"][0]["page"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"page {page} free and in the tree; last released by a batch's free group at step 10 (request unknown"
    ) in check.stdout
    assert "req-D" not in check.stdout


def test_a_retracted_request_is_counted_and_its_row_written_once_it_finishes(tmp_path: Path) -> None:
    """SGLang's retract_decode takes req-R2 out of a decode batch of two (its release is a retraction,
    not its end); req-R2 comes back and finishes: its row says finished with 1 retraction, a retract
    event names it, the usage samples count 1 retraction; the idle census is clean."""
    capture = tmp_path / "retract.db"
    result = drive("retract", "unified", capture)
    assert all(c["ok"] for p in result["points"] for c in p["census"])
    db = Capture(capture)
    try:
        run_id = int(db.runs().iloc[-1].id)
        rows = db.requests(run_id).set_index("rid")
        assert (rows.loc["req-R2"].status, int(rows.loc["req-R2"].num_retractions)) == ("finished", 1)
        assert int(rows.loc["req-R1"].num_retractions) == 0
        events = db.events(run_id, limit=None)
        assert list(events[events.kind == "retract"].rid) == ["req-R2"]
        assert int(db.usage(run_id).cum_retractions.max()) == 1
    finally:
        db.close()
    check_clean(capture)


def test_a_leak_and_a_double_free_that_cancel_pass_sglangs_identity_and_not_the_census(tmp_path: Path) -> None:
    capture = tmp_path / "pair.db"
    result = drive("leak-and-double-free", "unified", capture)
    leaked, freed = (i["page"] for i in result["injected"])
    point = result["points"][1]
    assert point["sglang"]["leak"] is False and point["sglang"]["raised"] is None  # the two errors cancel
    census = full_census(point)
    assert (census["leaked"], census["doubleref"]) == ([leaked], [freed])
    assert (census["culprits"], census["releasers"]) == ({str(leaked): "req-C"}, {str(freed): "bad-free"})
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"page {leaked} (slots" in check.stdout and f"page {freed} free and in the tree" in check.stdout
    report = kvscope("report", "leaks", str(capture), "--json")
    assert json.loads(report.stdout)["verdict"] == "leak"


def test_a_streaming_sessions_record_and_lock_between_turns_are_held_not_leaked(tmp_path: Path) -> None:
    """Between a streaming session's turns no request holds its row, its pages past the tree's prefix or
    the prefix lock its first turn took: the session does (SGLang counts them as session_held). The
    census counts them held by `session sess-1`, not leaked; closing the session frees them."""
    capture = tmp_path / "session.db"
    result = drive("session-close", "unified", capture)
    lines = [p["sglang"]["line"] for p in result["points"]]
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False, False]
    assert ["session_held=8," in lines[0], "session_held=12," in lines[1], "session_held=0," in lines[2]] == [True] * 3
    assert all(c["ok"] for p in result["points"] for c in p["census"]), result["points"]
    assert [full_census(p)["live"] for p in result["points"]] == [5, 6, 0]  # its row: the prefix and its own pages
    db = Capture(capture)
    try:
        run_id = int(db.runs().iloc[-1].id)
        nodes = db.tree_at(run_id, db.snapshot_steps(run_id)[0]).set_index("node_id")
        prefix = nodes[nodes.owner == "session sess-1"]  # the shared prefix the session's row holds, and locks
        assert len(prefix) == 1 and prefix.iloc[0].num_tokens == 12 and prefix.iloc[0].lock_ref == 1
    finally:
        db.close()
    check = check_clean(capture)
    assert "clean: 3 censuses (3 idle)" in check.stdout


def test_a_lock_leaked_on_the_node_a_session_holds_locked_is_named(tmp_path: Path) -> None:
    """Two open locks on one node whose takers have finished: the session's (kept) and req-L's (never
    released). The census takes one as the session's and names the other."""
    capture = tmp_path / "session-lock.db"
    result = drive("session-lock-leak", "unified", capture)
    node = result["injected"][0]["node"]
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False]  # SGLang's identity passes
    assert [full_census(p)["locks"] for p in result["points"]] == [{str(node): ["req-L"]}] * 2
    assert [full_census(p)["leaked"] for p in result["points"]] == [[], []]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"1 tree node still locked by finished requests: node {node} locked by request req-L at step" in check.stdout


@pytest.mark.parametrize("tree", ["unified", "rust", "classic"])
def test_level_summary_patches_no_allocator_or_tree_method_and_a_request_holding_a_prefix_lock_is_clean(
    tmp_path: Path, tree: str
) -> None:
    """Level summary registers only the batch, request and idle hooks: SGLang's allocator and tree
    methods stay its own. Its census reads locks from the tree's own counts: a request running across
    the idle point with a lock on the shared prefix is a live holder, not a leak."""
    capture = tmp_path / f"shared-{tree}.db"
    result = drive("shared", tree, capture, "summary")
    assert result["said"] == "registered" and not result["patched"]
    assert set(result["made_by"].values()) == {"radix_cache.py", "unified_radix_cache.py"}, result["made_by"]
    assert "protected=12" in result["points"][1]["sglang"]["line"]  # req-D's lock on the 12-token system prompt
    assert all(c["ok"] for p in result["points"] for c in p["census"])
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert run.level == "summary" and db.events(int(run.id), limit=10).empty
        assert set(db.requests(int(run.id)).rid) == {"req-A", "req-B", "req-C", "req-D", "req-E"}
    finally:
        db.close()
    check = check_clean(capture)
    assert "clean: 3 censuses (3 idle) of the sglang 0.5.23 probe's page census held" in check.stdout


@pytest.mark.parametrize(
    ("scenario", "tree", "named"),
    [
        (
            "leak-and-double-free",
            "unified",
            [
                "1 page leaked (in no free list, tree or live row): page {leaked} (slots {slots}) last taken by "
                "request req-C (decode at step 9)",
                "1 page freed while in use (a double free): page {freed} free and in the tree; taken by request "
                "req-A (extend at step 1), who freed it is recorded at level full",
            ],
        ),
        (
            "lock-leak",
            "rust",
            [
                "3 pages under a tree lock no live request or session holds (a lock never released; who locked it "
                "is recorded at level full): pages 1, 2, 3 taken by request req-A (extend at step 1)"
            ],
        ),
        (
            "session-lock-leak",
            "unified",
            ["3 pages under a tree lock no live request or session holds", "pages 1, 2, 3 taken by request req-A"],
        ),
        (
            "swa-leak",
            "swa",
            [
                "leak check failed at step 10: [swa]",
                "1 page leaked (in no free list, tree or live row): page {swa} (slots",
                "request req-C (decode at",
            ],
        ),
        (
            "mamba-double-free",
            "mamba",
            [
                "leak check failed at step 10: [mamba]",
                "1 slot freed while in use (a double free): slot {slot} free and in the tree; taken by request "
                "req-A (extend at step 1), who freed it is recorded at level full",
            ],
        ),
    ],
)
def test_level_summary_names_the_leak_the_double_free_and_the_stale_lock_without_per_operation_hooks(
    tmp_path: Path, scenario: str, tree: str, named: list[str]
) -> None:
    """Without the allocator's and the tree's hooks the census still finds each fault from SGLang's
    own state (free lists, tree values, rows, the tree's lock counts), and names pages by the request
    whose row took them (the binds); who freed or locked them is level full's (the cancelling pair:
    SGLang's identity passes, the census does not; a stale lock stacked on the node a streaming
    session holds locked)."""
    capture = tmp_path / f"{scenario}.db"
    result = drive(scenario, tree, capture, "summary")
    assert not result["patched"]
    pages = [i["page"] for i in result["injected"] if "page" in i]
    if scenario in ("swa-leak", "mamba-double-free"):
        named = [n.format(swa=pages[0] if pages else None, slot=result["injected"][0].get("slot")) for n in named]
    if scenario == "leak-and-double-free":
        assert result["points"][1]["sglang"]["leak"] is False  # the two errors cancel in SGLang's identity
        leaked, freed = pages
        named = [n.format(leaked=leaked, slots=f"{leaked * 4}-{leaked * 4 + 3}", freed=freed) for n in named]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    for line in named:
        assert line in check.stdout, check.stdout
    report = kvscope("report", "leaks", str(capture), "--json")
    assert json.loads(report.stdout)["verdict"] == "leak"


def test_an_swa_pool_checks_clean_beside_the_full_pool(tmp_path: Path) -> None:
    """SGLang's SWATokenToKVPoolAllocator (a full and an SWA sub-pool) under UnifiedRadixCache with its
    SWA component: the census covers the swa pool (through SGLang's full -> SWA slot mapping)."""
    capture = tmp_path / "swa-clean.db"
    result = drive("clean", "swa", capture)
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False, False]
    swa = [next(c for c in p["census"] if c["pool"] == "swa") for p in result["points"]]
    assert all(c["ok"] for c in swa) and swa[1]["live"] == 3  # req-D's SWA peers, running across the idle point
    db = Capture(capture)
    try:
        checks = db.leak_checks(int(db.runs().iloc[-1].id))
        assert list(checks.pool).count("swa") == 3 and checks.ok.astype(bool).all()
    finally:
        db.close()
    check_clean(capture)


def test_an_swa_page_stranded_by_a_full_only_free_is_named_with_its_request(tmp_path: Path) -> None:
    """The tail page freed through the full sub-allocator alone: the full pool balances, its SWA peer
    is in no free list, tree or live row; the census names it and req-C before SGLang raises."""
    capture = tmp_path / "swa-leak.db"
    result = drive("swa-leak", "swa", capture)
    page = result["injected"][0]["page"]
    point = result["points"][1]
    assert point["sglang"]["raised"].startswith("swa pool memory leak detected!")  # SGLang's own: totals only
    named = (
        f"1 page leaked (in no free list, tree or live row): page {page} (slots {page * 4}-{page * 4 + 3}) "
        "last taken by request req-C (decode at step 9)"
    )
    assert f"[swa] {named}" in result["stderr"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "leak check failed at step 10: [swa] total=" in check.stdout and named in check.stdout
    report = kvscope("report", "leaks", str(capture))
    assert "verdict: leak (kvscope check exits 1)" in report.stdout and "req-C" in report.stdout


def test_the_padding_page_an_swa_double_free_handed_out_is_named_with_the_free_that_put_it_there(
    tmp_path: Path,
) -> None:
    """Issue 38's report (SGLang's padding page 0 in an SWA free list: "total=432 for a 416-token pool"),
    on SGLang's own SWATokenToKVPoolAllocator: req-C's first page's SWA peer freed out of the window twice;
    the second free reads the mapping the first cleared (the padding slot) and, with SGLang's invariant
    checks off (its default), puts page 0 in the SWA free list; req-D's prefill takes it. The census names
    page 0 in req-D's row and req-C's free (before: page 0 counted as a held page, and every census clean)."""
    capture = tmp_path / "swa-padding.db"
    result = drive("swa-padding", "swa", capture)
    assert result["points"][1]["sglang"]["raised"].startswith("swa pool memory leak detected!")  # totals only
    named = (
        "[swa] 1 page id outside 1..16 in use (handed out from the free list): page 0 in request req-D's row, "
        "taken by request req-D (extend at step 10); last released for request req-C (free at step 9)"
    )
    assert named in result["stderr"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "page 0 in request req-D's row" in check.stdout and "req-C (free at step 9)" in check.stdout
    db = Capture(capture)
    try:
        blocks = db.census_blocks(int(db.runs().iloc[-1].id))
    finally:
        db.close()
    stray = blocks[blocks.term == "s.stray"]
    assert set(stray.block) == {0} and set(stray.releaser_rid) == {"req-C"}, blocks


def mamba_census(point: dict[str, Any]) -> dict[str, Any]:
    assert point["census"] is not None
    return next(c for c in point["census"] if c["pool"] == "mamba")


def test_a_mamba_pool_checks_clean_beside_the_full_pool(tmp_path: Path) -> None:
    """SGLang's HybridReqToTokenPool with its MambaPool (4 slots) under UnifiedRadixCache with its Mamba
    component: every slot is free, a tree node's state, or a live request's; the hooks on
    MambaSlotAllocator record pool mamba, and the bind names each slot's request."""
    capture = tmp_path / "mamba-clean.db"
    result = drive("clean", "mamba", capture)
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False, False]
    mamba = [mamba_census(p) for p in result["points"]]
    assert all(c["ok"] for c in mamba) and all(c["ok"] for p in result["points"] for c in p["census"])
    assert [(c["free"], c["tree"], c["live"]) for c in mamba] == [(3, 1, 0), (0, 3, 1), (0, 4, 0)]  # req-D runs at 2
    db = Capture(capture)
    try:
        run_id = int(db.runs().iloc[-1].id)
        checks = db.leak_checks(run_id)
        assert list(checks.pool).count("mamba") == 3 and checks.ok.astype(bool).all()
        events = db.events(run_id, limit=10_000)
        slots = events[events.pool == "mamba"]
        # A, B (a copy of A's state, taken at its match), C, D; then the tree evicts a state for req-E, which takes it:
        # the eviction is the tree's, in no request's call (req-E's match no longer makes it the context)
        assert list(slots.kind) == ["alloc"] * 4 + ["free", "alloc"]
        assert slots[slots.kind == "free"].rid.isna().all() and list(slots.num_tokens) == [1] * 6
    finally:
        db.close()
    check_clean(capture)


def test_a_mamba_pool_with_sglangs_extra_buffer_checks_clean(tmp_path: Path) -> None:
    """With SGLang's Mamba extra buffer a request holds its state and two ping-pong track slots (8 slots,
    page size 4; the scheduler's tracking is not driven, so the tree keeps no state): the census counts
    all three as the live request's, and each release frees the slots it took, the track slots read from
    the row's mapping, which the next request's row rewrites (the hook copies that view)."""
    capture = tmp_path / "mamba-buffer.db"
    result = drive("clean", "mamba-buffer", capture)
    assert [p["sglang"]["leak"] for p in result["points"]] == [False, False, False]
    mamba = [mamba_census(p) for p in result["points"]]
    assert all(c["ok"] for c in mamba) and [c["live"] for c in mamba] == [0, 3, 0]  # req-D's three slots at 2
    db = Capture(capture)
    try:
        events = db.events(int(db.runs().iloc[-1].id), limit=10_000)
        slots = events[events.pool == "mamba"]
        taken = sorted(s for pages in slots[slots.kind == "alloc"].slots for s in array("i", pages))
        freed = sorted(s for pages in slots[slots.kind == "free"].slots for s in array("i", pages))
        assert len(taken) == 15 and freed == taken  # five requests, three slots each, each given back once
        assert list(slots[slots.kind == "free"].rid.drop_duplicates()) == ["req-A", "req-B", "req-C", "req-E", "req-D"]
    finally:
        db.close()
    check_clean(capture)


def test_a_mamba_slot_a_finished_request_never_freed_is_named_with_the_request(tmp_path: Path) -> None:
    """req-C finishes uncached and its release drops its Mamba slot without freeing it: SGLang's own
    check raises with totals; the census names the slot and req-C (the bind's taker) first."""
    capture = tmp_path / "mamba-leak.db"
    result = drive("mamba-leak", "mamba", capture)
    slot = result["injected"][0]["slot"]
    point = result["points"][1]
    assert point["sglang"]["raised"].startswith("pool memory leak detected! [mamba]")  # SGLang's own: totals only
    named = (
        f"1 slot leaked (in no free list, tree or live row): slot {slot} last taken by request req-C (extend at step 8)"
    )
    assert f"[mamba] {named}" in result["stderr"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert "leak check failed at step 10: [mamba] total=4" in check.stdout and named in check.stdout
    report = kvscope("report", "leaks", str(capture))
    assert "verdict: leak (kvscope check exits 1)" in report.stdout and f"slot {slot} last taken by request req-C" in (
        report.stdout
    )
    log = tmp_path / "server.log"  # the process's stderr: the probe's line, then SGLang's own message
    log.write_text(result["stderr"])
    explained = kvscope("report", "engine-log", str(log))
    assert f"kvscope's probe (line 3, step 10): [mamba] {named}" in explained.stdout
    assert f"culprits: kvscope report leaks {capture} --run 1" in explained.stdout


def test_a_mamba_double_free_is_named_with_the_request_it_was_made_for(tmp_path: Path) -> None:
    capture = tmp_path / "mamba-double.db"
    result = drive("mamba-double-free", "mamba", capture)
    slot = result["injected"][0]["slot"]
    assert result["points"][1]["sglang"]["raised"].startswith("pool memory leak detected! [mamba]")
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"[mamba] total=4, available=0, evictable=3, protected=0, held=1, uncached=0: 1 slot freed while in use "
        f"(a double free): slot {slot} free and in the tree; last released for request bad-free (free at step 10)"
    ) in check.stdout
    report = kvscope("report", "leaks", str(capture), "--json")
    assert json.loads(report.stdout)["verdict"] == "leak"


@pytest.mark.parametrize(
    ("scenario", "line"),
    [
        (
            "missing-target",
            "SGLang 0.5.23: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.gone_in_0_5_24 not found "
            "(UnifiedRadixCache has no 'gone_in_0_5_24'); nothing patched",
        ),
        (
            "changed-tree-parameters",
            "SGLang 0.5.23: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.dec_lock_ref takes (self, "
            "node_id, params, skip_swa) where the probe needs (self, node, params, ...); nothing patched",
        ),
        (
            "changed-mamba-parameters",
            "SGLang 0.5.23: sglang.srt.mem_cache.allocator.mamba.MambaSlotAllocator.free takes (self, free_index) "
            "where the probe needs (self, seq_lens, seq_lens_cpu, last_loc, ...); nothing patched",
        ),
        (
            "changed-trailing-parameters",
            "SGLang 0.5.23: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict_for_alloc takes other "
            "parameters; nothing patched",
        ),
    ],
)
def test_a_target_whose_code_differs_from_its_familys_patches_nothing(tmp_path: Path, scenario: str, line: str) -> None:
    """One line naming the target; no hook registered (not even on the targets that match); SGLang
    serves on (a gone method, a changed shape, a direct method one parameter short of SGLang's)."""
    assert_refused(drive(scenario, "unified", tmp_path / f"{scenario}.db"), line, tmp_path / f"{scenario}.db")


def test_a_tested_release_whose_allocator_changed_shape_refuses_in_one_line(tmp_path: Path) -> None:
    """The family's table faked to want alloc(self, seq_lens, seq_lens_cpu, last_loc): one refusal line
    naming the target and the parameters SGLang's method has; nothing patched."""
    capture = tmp_path / "changed.db"
    line = (
        "SGLang 0.5.23: sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc takes (self, "
        "need_size) where the probe needs (self, seq_lens, seq_lens_cpu, last_loc, ...); nothing patched"
    )
    assert_refused(drive("changed-parameters", "unified", capture), line, capture)


def assert_refused(result: dict[str, Any], line: str, capture: Path) -> None:
    assert result["stderr"].count("kvscope probe:") == 1 and f"kvscope probe: {line}\n" in result["stderr"]
    assert not result["patched"] and not result["active"]
    check = kvscope("check", str(capture))
    assert check.returncode == 3, check.stdout + check.stderr
    assert "probe refused" in check.stdout


def test_a_release_no_family_lists_as_tested_loads_by_its_shapes_and_says_so(tmp_path: Path) -> None:
    """SGLang 0.5.23 taken as untested: its code matches family 0.5.23, so the probe loads as that
    family and says so in one line; the capture is recorded as on a tested release."""
    capture = tmp_path / "untested.db"
    result = drive("untested-release", "unified", capture)
    assert result["said"] == "registered" and result["patched"]
    assert result["stderr"].count("kvscope probe:") == 1
    assert "kvscope probe: SGLang 0.5.23: not tested; its shapes match family 0.5.23\n" in result["stderr"]
    check_clean(capture)


@pytest.mark.parametrize(("tree", "below_root"), [("unified", "4 nodes"), ("rust", "14 nodes")])
def test_the_radix_tree_page_draws_sglangs_tree(
    tmp_path: Path, tree: str, below_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dashboard's Radix tree page on the probe's capture: the last idle census's snapshot (the
    Python core's nodes; the Rust core's pages, 4 tokens each), 56 tokens in the tree either way."""
    from streamlit.testing.v1 import AppTest

    capture = tmp_path / f"tree-{tree}.db"
    drive("clean", tree, capture)
    monkeypatch.setenv("KVSCOPE_DB", str(capture))
    monkeypatch.chdir(ROOT)
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    at.switch_page("kvscope/dashboard/app_pages/tree.py").run()
    assert not at.exception, [e.value for e in at.exception]
    captions = [c.value for c in at.caption]
    assert any(c.startswith(f"Step 11: {below_root} below the root, 56 cached tokens") for c in captions), captions


@pytest.mark.parametrize("mode", ["plain", "spawn"])
def test_the_calls_since_the_last_fold_reach_the_capture_when_the_process_exits(tmp_path: Path, mode: str) -> None:
    """The exit-time fold (drain_at_exit, registered with atexit and multiprocessing's Finalize so
    that it runs before the recorder closes its run): a process that ends between two folds, without a
    census, still leaves every allocator call since the last fold in the capture (sglang_exit_driver.py:
    SGLang's real allocator, in the process itself or a spawned child, as SGLang's scheduler is)."""
    capture = tmp_path / f"exit-{mode}.db"
    out = kvscope(
        "instrument",
        "--capture",
        str(capture),
        "--level",
        "full",
        "--",
        SGLANG_PYTHON,
        "-W",
        "ignore",
        str(EXIT_DRIVER),
        mode,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    calls = json.loads(out.stdout.strip().splitlines()[-1])["calls"]
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        assert run.status == "finished", (run.status, out.stderr[-2000:])
        events = db.events(int(run.id), limit=100)
        recorded = [
            (kind, sorted(array("i", slots).tolist())) for kind, slots in zip(events.kind, events.slots, strict=True)
        ]
    finally:
        db.close()
    assert recorded == [tuple(c) for c in calls], (recorded, calls)


def loop_cases_of(release: str) -> list[str]:
    """sglang_loop_driver.py's scenarios the tests below read on `release`, run in one driver process per
    release (run_cases): the busy and drain censuses and the crashed run on every release; the many-page
    leak and the interrupted run on the venv's own."""
    return ["busy", "crash", *(["busy-many", "interrupted"] if release == VENV_RELEASE else [])]


@pytest.fixture(scope="module")
def looped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(scenario, release) -> (sglang_loop_driver.py's result, its capture): SGLang `release`'s own scheduler
    loop, never idle, a busy census due every EVERY_STEPS steps; every scenario of a release run at its first
    ask (loop_cases_of)."""
    runs: dict[str, Any] = {}
    env = {"KVSCOPE_CENSUS_EVERY_STEPS": str(EVERY_STEPS), "KVSCOPE_CENSUS_EVERY_S": "0"}

    def case(scenario: str, release: str = VENV_RELEASE) -> tuple[dict[str, Any], Path]:
        if release not in runs:
            out_dir = tmp_path_factory.mktemp(f"sglang-loop-{release}")
            runs[release] = run_cases(LOOP_DRIVER, release, loop_cases_of(release), out_dir, env)
        return case_result(runs[release], scenario)

    return case


def stored(capture: Path) -> tuple[Any, Any, Any]:
    """The run's row, its leak checks (the census's kind on each) and its census_blocks."""
    db = Capture(capture)
    try:
        run = db.runs().iloc[-1]
        return run, db.leak_checks(int(run.id)), db.census_blocks(int(run.id))
    finally:
        db.close()


def by_census(checks: Any) -> list[tuple[int, str, bool]]:
    """(step, kind, every pool held) of each census, in order."""
    oks = checks.groupby("step").ok.all()
    kinds = checks.drop_duplicates("step").set_index("step").census
    return [(int(step), str(kinds[step]), bool(ok)) for step, ok in oks.items()]


@pytest.mark.parametrize("release", RELEASES)  # NOTE: before 0.5.20 the point is process_input_requests
def test_a_scheduler_that_is_never_idle_gets_busy_censuses_that_name_a_leaked_page_and_a_drain_census(
    looped: Any, release: str
) -> None:
    """SGLang's own event loop never reaches on_idle (a batch every iteration); the busy census at the start
    of an iteration, due every EVERY_STEPS steps, names the page a released request kept within EVERY_STEPS
    steps, with its request; none says anything before it; the ShutdownReq's drain census names it too, and
    the requests still running then get their rows, unfinished."""
    result, capture = looped("busy", release)
    fault = result["injected"]
    assert result["raised"] is None and result["iterations"] == 40 and result["said"] == "closed"
    run, checks, blocks = stored(capture)
    assert (run.status, run.error) == ("finished", None)
    censuses = by_census(checks)
    kinds = [kind for _, kind, _ in censuses]
    assert kinds[-1] == "drain" and set(kinds[:-1]) == {"busy"} and len(kinds) >= 10, kinds
    clean = [c for c in censuses if c[0] < fault["step"]]
    assert len(clean) >= 3 and all(ok for _, _, ok in clean), censuses  # NOTE: no false positive while busy
    first = next(c for c in censuses if not c[2])
    assert first[1] == "busy" and fault["step"] <= first[0] <= fault["step"] + EVERY_STEPS, (first, fault)
    assert not any(ok for step, _, ok in censuses if step >= first[0])  # a leak stays: every later census names it
    named = blocks[(blocks.step == first[0])]
    assert list(zip(named.term, named.block, named.taker_rid, strict=True)) == [
        ("leaked", fault["pages"][0], fault["rid"])
    ]
    assert set(blocks.step) == {step for step, _, ok in censuses if not ok}
    check = kvscope("check", str(capture))
    assert check.returncode == 1 and f"page {fault['pages'][0]} (slots" in check.stdout, check.stdout + check.stderr
    report = json.loads(kvscope("report", "leaks", str(capture), "--json").stdout)
    assert report["censuses"] == {"busy": len(kinds) - 1, "drain": 1}
    tally = result["tally"]  # NOTE: the /metrics tally: every census by kind, and their engine-thread time
    assert tally["kinds"] == report["censuses"] and tally["censuses"] == len(kinds) and tally["census_s"] > 0
    db = Capture(capture)
    try:
        requests = db.requests(int(run.id)).set_index("rid")
    finally:
        db.close()
    assert result["running"] and set(requests.index[requests.status == "unfinished"]) == set(result["running"])
    assert requests.loc[result["running"]].finish_step.isna().all() and len(requests) == len(set(requests.index))


def test_every_page_a_busy_census_names_is_stored_more_than_its_message_names(looped: Any) -> None:
    """A running request's call takes 10 pages it never gives back: the busy census's message names 8 and
    counts the rest; census_blocks holds all 10 with their taker, and `report leaks` lists every one."""
    result, capture = looped("busy-many")
    fault = result["injected"]
    assert len(fault["pages"]) == 10
    _, checks, blocks = stored(capture)
    first = next(c for c in by_census(checks) if not c[2])
    assert first[1] == "busy" and first[0] <= fault["step"] + EVERY_STEPS
    message = checks[(checks.step == first[0]) & (checks.pool == "full")].message.iloc[0]
    assert "10 pages leaked" in message and "(+2 more)" in message
    named = blocks[blocks.step == first[0]]
    assert sorted(named.block) == fault["pages"] and set(named.term) == {"leaked"}
    assert set(named.taker_rid) == {fault["rid"]} and set(named.taker_event) == {"alloc"}
    report = kvscope("report", "leaks", str(capture))
    assert report.returncode == 0, report.stderr
    for page in fault["pages"]:
        assert f"leaked: page {page}; last taken for request {fault['rid']}" in report.stdout, report.stdout
    listed = json.loads(kvscope("report", "leaks", str(capture), "--json").stdout)["census_blocks"]
    assert sorted(b["block"] for b in listed if b["step"] == first[0]) == fault["pages"]


@pytest.mark.parametrize("release", RELEASES)
def test_a_scheduler_loop_that_raises_leaves_a_crashed_run_with_a_crash_census_that_check_calls_a_leak(
    looped: Any, release: str
) -> None:
    """SGLang's strict busy check (self_check_during_busy) raises from its own loop on the page a released
    request kept; run_scheduler_process catches it and the process ends normally. The run is crashed with
    SGLang's line, its last census (kind crash) names the page, and `kvscope check` says leak."""
    result, capture = looped("crash", release)
    assert result["raised"].startswith("AssertionError: Full Pool Mem Leak Detected!"), result
    run, checks, blocks = stored(capture)
    assert run.status == "crashed" and run.error == result["raised"], (run.status, run.error)
    censuses = by_census(checks)
    assert censuses[-1][1] == "crash" and not censuses[-1][2] and all(ok for _, _, ok in censuses[:-1]), censuses
    assert list(blocks[blocks.step == censuses[-1][0]].block) == result["injected"]["pages"]
    check = kvscope("check", str(capture))
    assert check.returncode == 1, check.stdout + check.stderr
    assert f"leak check failed at step {censuses[-1][0]}: [full]" in check.stdout, check.stdout


def test_an_error_after_a_shutdown_request_closes_the_run_interrupted_without_a_last_census(looped: Any) -> None:
    """A ShutdownReq sets gracefully_exit and the same iteration's batch fails (a signal to the process group
    stops the step in flight): interrupted with the error's line, no drain or crash census."""
    result, capture = looped("interrupted")
    assert result["raised"] == "RuntimeError: cancelled"
    run, checks, _ = stored(capture)
    assert (run.status, run.error) == (
        "interrupted",
        "a shutdown was asked for while a step ran: RuntimeError: cancelled",
    )
    assert {kind for _, kind, _ in by_census(checks)} == {"busy"}


DESCRIBE = """
import json, sys
sys.path.insert(0, {root!r})
from tests.engines.sglang_standins import install
install()
from kvscope.probe.sglang import FAMILIES, describe_installed
print(json.dumps(describe_installed(families=tuple(f for f in FAMILIES if f.name not in {drop!r}))))
"""


@pytest.mark.parametrize(
    ("release", "family", "differs", "drop"),
    [
        ("0.5.23", "0.5.23", None, ()),  # NOTE: 0.5.22's family is its clean runs' (registered, its label)
        ("0.5.21", "0.5.21", None, ()),
        ("0.5.20", "0.5.20", None, ()),
        ("0.5.19", "0.5.19", None, ()),
        ("0.5.18", "0.5.18", None, ()),
        # NOTE: without its own family 0.5.18 matches none: the first shape 0.5.19's differs in
        (
            "0.5.18",
            None,
            "nearest 0.5.19: sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free_rows not found",
            ("0.5.18",),
        ),
    ],
)
def test_each_release_loads_as_the_family_docs_probe_md_names_or_says_which_target_differs(
    release: str, family: str | None, differs: str | None, drop: tuple[str, ...]
) -> None:
    """What `kvscope probe-check` reads of each release (describe_installed, SGLang's real modules): the
    family it loads as, tested; or none, naming the nearest family's first differing target, with every
    target's shape and match listed (docs/probe.md's version table). `drop`: families left out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCOPE_", "SGLANG_"))}
    out = subprocess.run(
        [SGLANG_PYTHON, "-W", "ignore", "-c", DESCRIBE.format(root=str(ROOT), drop=set(drop))],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join([*release_path(release), str(ROOT)])},
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    described = json.loads(out.stdout.strip().splitlines()[-1])
    assert (described["version"], described["family"], described["loads"]) == (release, family, family is not None)
    assert described["tested"] is (family is not None) and "pages" in described["records"]
    assert [f["name"] for f in described["families"]] == [f.name for f in FAMILIES if f.name not in drop]
    matched = [row["match"] for row in described["targets"]]
    if differs is None:
        assert described["line"] == "" and all(matched)
    else:
        assert described["line"].startswith(f"SGLang {release}: not tested and matches no known family ({differs}")
        assert not all(matched) and described["line"].endswith("; nothing patched")


def test_probe_check_says_sglang_0518_loads_as_its_own_family_with_every_shape(tmp_path: Path) -> None:
    """`kvscope probe-check --python` on SGLang 0.5.18 (its unpacked wheel first on the venv's path; a
    sitecustomize puts the GPU-only imports' stand-ins in for SGLang's python alone): it loads with family
    0.5.18, tested, every shape matching, among them the row pool's free(self, req) and the row and
    protected length read on Req; exit 0. The JSON says the same."""
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nif sys.executable == {SGLANG_PYTHON!r}:\n"
        f"    sys.path.insert(0, {str(ROOT)!r})\n"
        "    from tests.engines.sglang_standins import install\n    install()\n"
    )
    path = [str(tmp_path), *release_path("0.5.18")]
    text = kvscope("probe-check", "--python", SGLANG_PYTHON, path=path)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    found = json.loads(kvscope("probe-check", "--python", SGLANG_PYTHON, "--json", path=path).stdout)
    [engine] = found["engines"]
    targets = {t["target"]: t for t in engine["targets"]}
    assert lines[0] == f"SGLang 0.5.18: the probe loads with family 0.5.18 (tested; {len(targets)} shapes match)"
    assert (engine["version"], engine["family"], engine["loads"], engine["tested"]) == ("0.5.18", "0.5.18", True, True)
    assert engine["default_level"] == "summary"  # NOTE: SGLang's full costs 2-3 µs per allocator or tree call
    assert "    --level summary (the default): the census, usage, requests, tree snapshots" in lines, lines
    assert all(t["match"] for t in engine["targets"]) and "DIFFERS" not in text.stdout
    rows = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
    assert targets[f"{rows}.free"]["params"] == ["self", "req"] and f"{rows}.free_rows" not in targets
    assert "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict_for_alloc" not in targets
    req = [t for t in engine["targets"] if t["target"] == "sglang.srt.managers.schedule_batch.Req"]
    assert {"req_pool_idx", "cache_protected_len"} <= {name for t in req for name in t["reads"]}
