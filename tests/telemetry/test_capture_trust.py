"""What a capture guarantees when things go wrong (issue 13, items 1-6): a write that fails
stops recording without losing what was committed; a writer killed while creating a capture
leaves it absent, empty and reusable, or complete; read-only media and odd names read; URLs
go where they say; damaged files and racing writers give one line."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import event

from kvscope.telemetry import EventKind, PoolName, PoolTerms, RunStatus, UsageSample
from kvscope.telemetry import store as store_module
from kvscope.telemetry.queries import Capture
from kvscope.telemetry.recorder import SQLRecorder
from kvscope.telemetry.store import CaptureError, open_reader, open_writer, read_mode

ROOT = Path(__file__).resolve().parents[2]
EVENTS_PER_STEP = 500


def side_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name) and p != path)


def record_step(recorder: SQLRecorder, step: int) -> None:
    recorder.step = step
    slots = np.arange(16)
    for i in range(EVENTS_PER_STEP):
        recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}-{i}", num_tokens=16, slots=slots)
    recorder.usage(UsageSample(step, PoolTerms(100, 50, 30, 20), None, 4, 2, 2, 0, 0, 0, 0, 0, 0, 0))


def finished_capture(path: Path, steps: int = 3, label: str = "before") -> Path:
    with SQLRecorder(path, label=label, flush_interval_s=60) as recorder:
        for step in range(steps):
            record_step(recorder, step)
    return path


def limit_writes(recorder: SQLRecorder, path: Path, extra_bytes: int) -> None:
    """The recorder's writer process may grow the capture's files by `extra_bytes` at most: a
    file-size limit (RLIMIT_FSIZE) on that process, whose writes past it fail as on a full disk
    (SQLite says "database or disk is full", or "disk I/O error" when a write starts past it)."""
    limit = max(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists()) + extra_bytes
    resource.prlimit(recorder.writer_pid, resource.RLIMIT_FSIZE, (limit, limit))


WRITE_REFUSED = ("database or disk is full", "disk I/O error")


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


# -- 1. a write that fails ------------------------------------------------------------------


def test_a_full_disk_stops_recording_with_one_line_and_keeps_what_was_committed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    path = finished_capture(tmp_path / "full.db")
    recorder = SQLRecorder(path, label="full", flush_interval_s=60)
    limit_writes(recorder, path, extra_bytes=160_000)
    step = 0
    while recorder.failure is None and step < 500:
        step += 1
        record_step(recorder, step)
        recorder.flush()
    assert recorder.failure is not None, "the page limit was never reached"
    failed_at = step
    for later in range(failed_at + 1, failed_at + 5):  # recording stopped: dropped, no more lines
        record_step(recorder, later)
        recorder.flush()
    recorder.close(RunStatus.FINISHED)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    # NOTE: each flush ran with its step's rows all in, but the recorder cannot know that a step
    # is over until the next begins: it promises one step less than was written
    expected = f"capture complete through step {failed_at - 2}: "
    assert recorder.failure is not None and recorder.failure.startswith(expected), recorder.failure
    assert recorder.failure.removeprefix(expected) in WRITE_REFUSED and recorder.failure in err

    capture = Capture(path)  # every reader opens it, and finds every committed row
    runs = capture.runs()
    assert list(runs.status) == ["finished", "incomplete"] and runs.error.iloc[1] == recorder.failure
    assert len(capture.events(1, limit=10_000_000)) == 3 * EVENTS_PER_STEP
    steps = capture.events(2, limit=10_000_000).step.value_counts().sort_index()
    assert list(steps.index) == list(range(1, failed_at)) and (steps == EVENTS_PER_STEP).all()
    open_reader(path).dispose()
    out = cli("runs", str(path))
    assert out.returncode == 0 and "incomplete" in out.stdout, out.stderr


def test_a_run_whose_end_cannot_be_written_stays_running_and_close_does_not_raise(tmp_path: Path) -> None:
    path = tmp_path / "readonly-writes.db"
    recorder = SQLRecorder(path, label="stuck", flush_interval_s=60)
    limit_writes(recorder, path, extra_bytes=0)  # the writer's data, and

    @event.listens_for(recorder.engine, "checkout")
    def _refuse_writes(dbapi_conn: object, _record: object, _proxy: object) -> None:
        dbapi_conn.execute("PRAGMA query_only = 1")  # type: ignore[attr-defined]  # the run's end

    record_step(recorder, 1)
    recorder.flush()
    assert recorder.failure is not None
    assert recorder.failure.removeprefix("capture holds no complete step: ") in WRITE_REFUSED, recorder.failure
    recorder.close(RunStatus.FINISHED)
    run = Capture(path).runs().iloc[0]
    assert run.status == "running" and run.ended_at is None


def test_ctrl_c_or_sigterm_inside_the_block_marks_the_run_interrupted(tmp_path: Path) -> None:
    for exc in (KeyboardInterrupt, SystemExit):
        path = tmp_path / f"{exc.__name__}.db"
        with pytest.raises(exc), SQLRecorder(path):
            raise exc()
        assert Capture(path).runs().iloc[0].status == "interrupted"


def test_a_second_ctrl_c_while_closing_still_closes_the_capture(tmp_path: Path) -> None:
    path = tmp_path / "twice.db"
    recorder = SQLRecorder(path, flush_interval_s=60)
    record_step(recorder, 1)

    @event.listens_for(recorder.engine, "before_cursor_execute")
    def _second_ctrl_c(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if statement.startswith("UPDATE runs SET status"):
            os.kill(os.getpid(), signal.SIGINT)  # a real SIGINT, delivered in the middle of close()

    try:
        recorder.close(RunStatus.INTERRUPTED)
    except KeyboardInterrupt:
        pytest.fail("the second Ctrl-C escaped close()")
    assert Capture(path).runs().iloc[0].status == "interrupted"
    assert side_files(path) == [], "the log was not folded into the capture"


# -- 2. killed while the capture is being created ---------------------------------------------


def start_child(path: Path, *flags: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.telemetry.create_proc", str(path), *flags],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_writer_killed_while_creating_leaves_an_absent_empty_or_complete_capture(
    tmp_path: Path, sig: signal.Signals
) -> None:
    rng = random.Random(13)
    outcomes = []
    for attempt in range(16):
        path = tmp_path / f"created-{attempt}.db"
        proc = start_child(path, "--signals")
        go(proc)
        time_s = 0.002 * attempt + rng.uniform(0, 0.002)  # sweeps the first ~35 ms of the child's work
        try:
            proc.wait(timeout=time_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
        proc.communicate(timeout=30)
        outcomes.append(classify_created(path))
    assert set(outcomes) <= {"absent", "empty", "complete"}, outcomes


def classify_created(path: Path) -> str:
    """Absent, empty (readers say so, a writer reuses it) or complete; anything else fails."""
    if not path.exists():
        return "absent"
    try:
        runs = Capture(path).runs()
        outcome = "complete"
        assert set(runs.status) <= {"running", "interrupted", "finished"}
    except CaptureError as err:
        assert "empty capture" in str(err), str(err)
        outcome = "empty"
    SQLRecorder(path, label="reuse").close()  # a writer takes it, whatever the kill left
    assert Capture(path).runs().label.iloc[-1] == "reuse"
    return outcome


def test_an_empty_or_schema_less_file_is_reported_as_empty_and_reused(tmp_path: Path) -> None:
    zero = tmp_path / "zero.db"
    zero.write_bytes(b"")
    schemaless = tmp_path / "schemaless.db"
    conn = sqlite3.connect(schemaless)
    conn.execute("PRAGMA journal_mode = WAL")  # what a writer killed before its first commit leaves
    conn.close()
    for path in (zero, schemaless):
        with pytest.raises(CaptureError, match=r"empty capture \(no run recorded in it yet\)"):
            Capture(path)
        SQLRecorder(path, label="reused").close()
        assert list(Capture(path).runs().label) == ["reused"]


# -- 3. read-only media -----------------------------------------------------------------------


def test_reading_a_closed_capture_leaves_nothing_beside_it(tmp_path: Path) -> None:
    path = finished_capture(tmp_path / "closed.db")
    assert side_files(path) == []
    capture = Capture(path)
    assert len(capture.events(1, limit=10_000)) == 3 * EVENTS_PER_STEP
    capture.close()
    assert cli("runs", str(path)).returncode == 0
    assert side_files(path) == []


# a dashboard's reading process: opens the capture, says so, holds it open until told to read it again
HOLDING_READER = """
import sys
from kvscope.telemetry.queries import Capture
capture = Capture(sys.argv[1])
print(list(capture.runs().status), flush=True)
sys.stdin.readline()
print(list(capture.runs().status), len(capture.events(1, limit=None)), flush=True)
"""


def test_a_run_closed_while_another_process_reads_it_leaves_the_file_whole(tmp_path: Path) -> None:
    """A run that closes while a dashboard holds its capture open cannot take the file out of
    WAL mode, but its log is folded in and emptied: the .db copied alone is the finished run,
    every row and check of it."""
    path = tmp_path / "closed.db"
    with SQLRecorder(path, label="read-while-closing", flush_interval_s=60) as recorder:
        record_step(recorder, 0)
        recorder.flush()
        reader = subprocess.Popen(
            [sys.executable, "-c", HOLDING_READER, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert reader.stdout is not None and reader.stdout.readline() == "['running']\n"
        for step in range(1, 3):
            record_step(recorder, step)
    wal = Path(f"{path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0, "the log must be folded into the file at close"
    alone = tmp_path / "copy" / "closed.db"
    alone.parent.mkdir()
    shutil.copyfile(path, alone)
    copied, original = cli("check", str(alone)), cli("check", str(path))
    assert copied.returncode == original.returncode == 1, copied.stdout + copied.stderr  # its allocations leak
    assert copied.stdout.replace(str(alone), str(path)) == original.stdout
    capture = Capture(alone)
    assert list(capture.runs().status) == ["finished"] and len(capture.events(1, limit=None)) == 3 * EVENTS_PER_STEP
    out, _ = reader.communicate("\n", timeout=60)
    assert out == f"['finished'] {3 * EVENTS_PER_STEP}\n"


@pytest.mark.parametrize(
    ("dir_writable", "wal_mode", "wal_bytes", "has_shm", "mode"),
    [
        (True, True, 4096, True, "ro"),  # SQLite creates what it needs
        (True, False, 0, False, "ro"),
        (False, False, 0, False, "ro"),  # rollback mode needs nothing beside the file
        (False, True, 0, False, "immutable"),  # a WAL-mode file whose log is gone or empty
        (False, True, 0, True, "immutable"),
        (False, True, 4096, True, "ro"),  # SQLite reads an existing log read-only
        (False, True, 4096, False, "wal-unreadable"),
    ],
)
def test_read_mode_decision(dir_writable: bool, wal_mode: bool, wal_bytes: int, has_shm: bool, mode: str) -> None:
    assert read_mode(dir_writable, wal_mode, wal_bytes, has_shm) == mode


def read_only_view(directory: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run argv where `directory` cannot be written: a read-only bind mount in a private mount
    namespace when we are root (chmod does not stop root), chmod 555 otherwise."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: no way to make a directory read-only here")
        probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
        if probe.returncode != 0:
            pytest.skip("root without mount namespaces: no way to make a directory read-only here")
        script = (
            'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && touch "$0/probe" 2>/dev/null '
            '&& echo "still writable" && exit 97; exec "$@"'
        )
        return subprocess.run(
            ["unshare", "--mount", "sh", "-c", script, str(directory), *argv],
            capture_output=True,
            text=True,
            check=False,
            cwd=ROOT,
            env=env,
        )
    directory.chmod(0o555)
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT, env=env)
    finally:
        directory.chmod(0o755)


def wal_mode_copy(source: Path, target: Path, with_log: bool) -> Path:
    """`source` as an older kvscope or a killed writer left it: in WAL mode, with its committed
    data in the -wal (with_log) or folded into the file with no -wal/-shm beside it."""
    shutil.copy(source, target)
    conn = sqlite3.connect(target, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    if with_log:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("UPDATE runs SET label = 'in the log'")
        for suffix in ("", "-wal", "-shm"):  # copies taken while the writer holds the file
            shutil.copy(f"{target}{suffix}", f"{target.with_name('killed.db')}{suffix}")
    conn.close()
    return target.with_name("killed.db") if with_log else target


def test_a_capture_on_read_only_media_opens_and_gains_no_files(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    closed = finished_capture(media / "closed.db")
    old_style = wal_mode_copy(closed, media / "old-style.db", with_log=False)
    killed = wal_mode_copy(closed, media / "killed-src.db", with_log=True)
    (media / "killed-src.db").unlink()
    before = sorted(p.name for p in media.iterdir())
    assert "killed.db-wal" in before and "old-style.db-wal" not in before
    out = read_only_view(
        media, [sys.executable, "-m", "tests.telemetry.read_proc", str(closed), str(old_style), str(killed)]
    )
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert results == [{"statuses": ["finished"], "events": [3 * EVENTS_PER_STEP]}] * 3
    assert sorted(p.name for p in media.iterdir()) == before


# -- 4. paths and URLs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["what?.db", "a%20b.db", "run#1.db", "file:x.db", "sp ace.db"])
def test_a_path_is_a_file_of_exactly_that_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    SQLRecorder(name, label="relative").close()
    SQLRecorder(tmp_path / name, label="absolute").close()
    assert sorted(os.listdir(tmp_path)) == [name]
    assert list(Capture(name).runs().label) == ["relative", "absolute"]
    assert list(Capture(tmp_path / name).runs().label) == ["relative", "absolute"]


def test_a_sqlite_url_names_its_file_for_writers_and_readers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    url = f"sqlite:///{tmp_path / 'sub' / 'url.db'}"  # sqlite:////abs/...
    assert url.startswith("sqlite:////")
    SQLRecorder(url, label="by-url").close()
    SQLRecorder(f"sqlite:///{tmp_path / 'sub' / 'what%3F.db'}", label="quoted").close()
    assert sorted(os.listdir(tmp_path)) == ["sub"] and sorted(os.listdir(tmp_path / "sub")) == ["url.db", "what?.db"]
    assert list(Capture(url).runs().label) == ["by-url"]
    assert list(Capture(tmp_path / "sub" / "what?.db").runs().label) == ["quoted"]
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    with pytest.raises(CaptureError, match="no such file"):
        Capture(missing)
    assert not (tmp_path / "missing.db").exists()


@pytest.mark.parametrize(
    "url", ["mysql://kvscope@127.0.0.1:1/captures", "postgresql://u:secret@127.0.0.1:1/c", "bogus://host/db"]
)
def test_a_server_url_is_never_a_local_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.chdir(tmp_path)
    for open_it in (SQLRecorder, Capture):
        with pytest.raises(CaptureError) as err:
            open_it(url)
        message = str(err.value)
        assert "\n" not in message and "cannot open the database" in message and "secret" not in message
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("target", "message"),
    [("/dev/null", "/dev/null: not a regular file"), ("a-directory", "a-directory: is a directory")],
)
def test_a_device_or_directory_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-directory").mkdir()
    for open_it in (SQLRecorder, Capture):
        with pytest.raises(CaptureError, match=re.escape(message)):
            open_it(target)
    assert os.listdir(tmp_path) == ["a-directory"] and os.listdir(tmp_path / "a-directory") == []


# -- 5. a damaged page --------------------------------------------------------------------------


def damaged_capture(path: Path) -> Path:
    """A real capture with the root page of its packed event columns overwritten by garbage
    (every read of an event column passes through it)."""
    finished_capture(path, steps=40)
    conn = sqlite3.connect(path)
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    # NOTE: the file's layout moves with the schema; dbstat says where the table's root is
    (root,) = conn.execute("SELECT pageno FROM dbstat WHERE name = 'event_columns' AND path = '/'").fetchone()
    conn.close()
    with path.open("r+b") as fh:
        fh.seek(page_size * (root - 1))
        fh.write(random.Random(5).randbytes(page_size))
    return path


def test_a_damaged_page_is_one_line_for_readers_and_writers(tmp_path: Path) -> None:
    path = damaged_capture(tmp_path / "damaged.db")
    before = path.read_bytes()
    for open_it in (Capture, open_reader, open_writer, SQLRecorder):
        with pytest.raises(CaptureError, match="damaged capture") as err:
            open_it(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
    out = cli("runs", str(path))
    assert out.returncode == 2 and "damaged capture" in out.stderr and "Traceback" not in out.stderr
    assert path.read_bytes() == before and side_files(path) == []


def test_a_damaged_page_met_by_a_read_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = damaged_capture(tmp_path / "big.db")
    monkeypatch.setattr(store_module, "QUICK_CHECK_MAX_BYTES", 0)  # as for a capture too big to check at open
    capture = Capture(path)
    with pytest.raises(CaptureError, match="damaged capture"):
        capture.events(1, limit=10_000_000)
    with pytest.raises(CaptureError, match="damaged capture"):
        for _ in capture.event_stream(1, ["seq", "slots"]):
            pass


# -- 6. two runs starting on one new file -------------------------------------------------------


def test_two_runs_starting_on_one_new_file_both_land(tmp_path: Path) -> None:
    for attempt in range(5):
        path = tmp_path / f"race-{attempt}.db"
        children = [start_child(path), start_child(path)]
        for child in children:
            go(child)
        for child in children:
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0 and out == "done\n", err
        capture = Capture(path)
        runs = capture.runs()
        assert list(runs.status) == ["finished", "finished"]
        assert [len(capture.events(int(i))) for i in runs.id] == [100, 100]


def open_writer_at_barrier(path: str, barrier: Any, outcomes: Any) -> None:
    barrier.wait()
    try:
        open_writer(path).dispose()
        outcomes.put("opened")
    except CaptureError as err:
        outcomes.put(str(err))


def test_writers_opening_one_new_file_at_the_same_instant_all_open(tmp_path: Path) -> None:
    """Connections switching one new file to WAL at once can deadlock, and SQLite then fails one
    at once with "database is locked", whatever the busy timeout: the writer tries again. The
    race is rare (about one open in a hundred before the fix), hence the many attempts."""
    context = multiprocessing.get_context("fork")
    outcomes = context.Queue()
    writers, attempts = 4, 100
    for attempt in range(attempts):
        path = tmp_path / f"instant-{attempt}.db"
        path.touch()  # an empty file, as a creation that was stopped leaves it: every writer reuses it
        barrier = context.Barrier(writers)
        procs = [
            context.Process(target=open_writer_at_barrier, args=(str(path), barrier, outcomes)) for _ in range(writers)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [0] * writers
    results = [outcomes.get(timeout=10) for _ in range(writers * attempts)]
    assert [r for r in results if r != "opened"] == []


def test_a_hot_journal_left_by_a_killed_writer_still_reads(tmp_path: Path) -> None:
    """A writer killed while switching the journal mode leaves a hot -journal, which a
    read-only connection may not roll back: readers read the file as it is, writers roll back."""
    path = finished_capture(tmp_path / "live.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("UPDATE runs SET label = 'uncommitted'")
    hot = tmp_path / "hot.db"
    for suffix in ("", "-journal"):  # the files as a SIGKILL at this moment leaves them
        shutil.copy(f"{path}{suffix}", f"{hot}{suffix}")
    conn.rollback()
    conn.close()
    assert side_files(hot) == ["hot.db-journal"]
    runs = Capture(hot).runs()
    assert list(runs.label) == ["before"] and list(runs.status) == ["finished"]
    SQLRecorder(hot, label="after").close()
    assert list(Capture(hot).runs().label) == ["before", "after"] and side_files(hot) == []


def test_a_second_snapshot_at_the_same_step_does_not_stop_recording(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The engine snapshots the tree at the end of a run, which can be a step that already has
    one: that must not read as a failed write (the run would end 'incomplete')."""
    path = tmp_path / "snap.db"
    node = (0, None, 0, "", 1, 0.0, 0, None, False, 0)
    with SQLRecorder(path, level="summary") as recorder:
        recorder.tree_snapshot(250, [node])
        recorder.flush()
        recorder.tree_snapshot(250, [node])
        assert recorder.failure is None
    assert "kvscope recorder" not in capfd.readouterr().err
    capture = Capture(path)
    assert capture.runs().status.iloc[0] == "finished" and capture.snapshot_steps(1) == [250]


def test_a_reader_keeps_its_locks_while_another_run_is_recorded_and_closed(tmp_path: Path) -> None:
    """Opening a capture reads its header, which must not drop this process's SQLite locks on
    the file (POSIX locks go with the close of any descriptor of it). Dropped, the recorder's
    writer process takes itself for the file's last user when it closes, folds the log and
    deletes it under this process's connections: the run's end lands in a log nobody reads and
    the file reads as damaged."""
    path = tmp_path / "killed.db"
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_WAL_MODE, str(path)], cwd=ROOT, check=False)
    assert killed.returncode == -signal.SIGKILL and side_files(path) == ["killed.db-shm", "killed.db-wal"]
    reader = Capture(path)
    assert list(reader.runs().label) == ["killed"]
    with SQLRecorder(path, label="after", flush_interval_s=60) as recorder:
        record_step(recorder, 0)
    assert recorder.failure is None
    capture = Capture(path)
    assert list(capture.runs().label) == ["killed", "after"] and capture.runs().status.iloc[1] == "finished"
    assert len(capture.events(2, limit=None)) == EVENTS_PER_STEP
    assert list(reader.runs().label) == ["killed", "after"]


# a run started in a WAL-mode capture, then SIGKILL: its rows are in the log beside the file
KILLED_IN_WAL_MODE = """
import os, signal, sys
from kvscope.telemetry import schema
from kvscope.telemetry.store import open_writer
engine = open_writer(sys.argv[1])
with engine.begin() as conn:
    conn.execute(schema.runs.insert().values(label="killed", status="running", started_at=0.0, level="full",
                                             config="{}"))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_whose_log_is_too_full_for_its_end_folds_the_log_and_ends(tmp_path: Path) -> None:
    """The run's end is one more page in the log. When the log has no room left for it (a full
    disk, a file-size limit: here the recording process may write no byte past the log's last
    committed frame), close folds the log into the file and writes the end there: the run is
    marked as it ended, not left 'running'."""
    path = tmp_path / "tight.db"
    done = subprocess.run(
        [sys.executable, "-c", END_WITHOUT_ROOM, str(path)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "recording stopped" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    capture = Capture(path)
    run = capture.runs().iloc[0]
    assert (run.status, run.error) == ("finished", None)
    assert len(capture.events(1, limit=None)) == 3 * EVENTS_PER_STEP
    assert side_files(path) == []


# three steps written, then RLIMIT_FSIZE on this process at the log's last commit + 100 bytes
END_WITHOUT_ROOM = f"""
import os, resource, signal, struct, sys
import numpy as np
from kvscope.telemetry import EventKind, PoolName, SQLRecorder
path = sys.argv[1]
recorder = SQLRecorder(path, label="tight", flush_interval_s=60)
for step in range(3):
    recorder.step = step
    for i in range({EVENTS_PER_STEP}):
        recorder.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{{step}}-{{i}}", num_tokens=16,
                        slots=np.arange(16))
    recorder.flush()
with open(path + "-wal", "rb") as log:
    wal = log.read()
frame = 24 + struct.unpack(">I", wal[8:12])[0]
commits = [32 + (i + 1) * frame for i in range((len(wal) - 32) // frame)
           if struct.unpack(">I", wal[32 + i * frame + 4 : 32 + i * frame + 8])[0]]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = commits[-1] + 100
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
recorder.close()
"""
