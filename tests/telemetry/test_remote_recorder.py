"""RemoteRecorder: a recording process without SQLAlchemy (a real engine's venv) hands its buffer to
a host process that owns the run; what it records reads back as SQLRecorder's would, and a dead
host or a bad target stops recording in one line without raising into the recording process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvscope.probe import census_checks, take_census
from kvscope.probe.census import BlockView
from kvscope.telemetry import (
    Capture,
    EventKind,
    EvictReason,
    LeakCheck,
    PoolName,
    PoolTerms,
    RequestRecord,
    UsageSample,
)
from kvscope.telemetry.remote import RecorderStartError, RemoteRecorder

ROOT = Path(__file__).resolve().parents[2]


def test_what_it_records_reads_back(tmp_path: Path) -> None:
    target = tmp_path / "remote.db"
    rec = RemoteRecorder(target, level="full", label="remote", config={"source": {"kind": "probe"}})
    rec.step = 1
    rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r1", num_tokens=2, slots=[4, 5], aux=0)
    rec.record(EventKind.FREE, pool=PoolName.FULL, rid="r1", num_tokens=2, slots=[5, 4], aux=0)
    rec.usage(UsageSample(1, PoolTerms(352, 320, 0, 0), None, 0, 0, 1, 0, 100, 64, 1, 1, 0, 0, full_used=32))
    rec.leak_check(LeakCheck(1, "leaked", 11, 10, 0, 0, 1, 0, violation="1 block leaked: block 4"))
    done = RequestRecord("r1", None, 100, "finished", 64, 1)
    done.mark("finish", 1, 2.5)
    rec.request(done)
    rec.close()
    capture = Capture(target)
    try:
        run = capture.runs().iloc[-1]
        assert run.status == "finished" and '"kind": "probe"' in run.config
        events = capture.events(int(run.id), limit=100)
        assert list(events.kind) == ["alloc", "free"] and list(events.rid) == ["r1", "r1"]
        checks = capture.leak_checks(int(run.id))
        assert list(checks.message) == [
            "[leaked] total=11, available=10, evictable=0, protected=0, held=1, uncached=0: 1 block leaked: block 4"
        ]
        assert list(capture.requests(int(run.id)).cached_tokens) == [64]
        assert capture.usage(int(run.id)).cum_hit_tokens.tolist() == [64]
    finally:
        capture.close()


def test_the_probes_retention_reaches_its_host_and_drops_the_oldest_events(tmp_path: Path) -> None:
    """KVSCOPE_KEEP_EVENTS / KVSCOPE_MAX_SIZE (probe.core.Settings) travel with the open message: the
    host's writer keeps the window and says what it dropped."""
    target = tmp_path / "kept.db"
    rec = RemoteRecorder(target, retention=(0.05, 4 << 30))
    for step in range(1, 16):
        rec.step = step
        rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid=f"r{step}", num_tokens=2, slots=[step, step + 100], aux=0)
        rec.flush()
        time.sleep(0.15)
    rec.close()
    capture = Capture(target)
    try:
        kept = capture.run_retention(rec.run_id)
        assert kept is not None and (kept.keep_events_s, kept.max_bytes) == (0.05, 4 << 30)
        assert int(kept.first_seq) > 0 and int(capture.events(rec.run_id, limit=None).seq.min()) == int(kept.first_seq)
    finally:
        capture.close()


def test_an_idle_point_reaches_the_capture_while_the_run_is_open(tmp_path: Path) -> None:
    """A live reader sees the census of the last idle point, not only what a later batch pushes out."""
    target = tmp_path / "live.db"
    rec = RemoteRecorder(target)
    rec.step = 3
    rec.leak_check(LeakCheck(3, "leaked", 11, 11, 0, 0, 0, 0))
    rec.idle()
    deadline, seen = time.monotonic() + 20, 0
    while time.monotonic() < deadline and not seen:
        capture = Capture(target)
        try:
            seen = len(capture.leak_checks(rec.run_id))
        finally:
            capture.close()
        time.sleep(0.2)
    rec.close()
    assert seen == 1


def test_a_bad_target_is_one_line_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    with pytest.raises(RecorderStartError, match=r"^.*bad\.db: not a kvscope capture \(not a SQLite database\)$"):
        RemoteRecorder(bad)
    with pytest.raises(RecorderStartError, match="cannot start the recorder's host process with /nonexistent/py"):
        RemoteRecorder(tmp_path / "x.db", python="/nonexistent/py")


def test_a_dead_host_stops_recording_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = RemoteRecorder(tmp_path / "dead.db")
    os.kill(rec.host_pid, signal.SIGKILL)
    time.sleep(0.2)
    for step in range(3):
        rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r", num_tokens=1, slots=[1])
        rec.idle()
        rec.step = step
    rec.close()
    assert rec.failure == "the recorder's host process ended"
    assert capsys.readouterr().err.count("kvscope recorder: recording stopped") == 1


def test_the_host_outlives_the_recording_processs_tree(tmp_path: Path) -> None:
    """An engine that SIGKILLs its own process tree at shutdown (vLLM does) does not reach the host:
    it closes the run, crashed, when its channel closes without a close."""
    code = (
        "import os, signal, sys\n"
        "from kvscope.telemetry.remote import RemoteRecorder\n"
        f"rec = RemoteRecorder({str(tmp_path / 'tree.db')!r})\n"
        "print(rec.host_pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == -signal.SIGKILL
    host = int(out.stdout)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        capture = Capture(tmp_path / "tree.db")
        try:
            status = capture.runs().iloc[-1].status
        finally:
            capture.close()
        if status != "running":
            break
        time.sleep(0.2)
    assert status == "crashed", f"the host (pid {host}) did not close the run"


def test_a_multiprocessing_child_that_exits_closes_its_run_as_finished(tmp_path: Path) -> None:
    """vLLM's EngineCore is a multiprocessing child: it never runs atexit, its finalizers close the run."""
    code = (
        "import multiprocessing as mp, sys\n"
        "from kvscope.telemetry.remote import RemoteRecorder\n"
        "def engine(path):\n"
        "    rec = RemoteRecorder(path)\n"
        "    raise SystemExit(0)\n"
        "if __name__ == '__main__':\n"
        f"    p = mp.get_context('fork').Process(target=engine, args=({str(tmp_path / 'mp.db')!r},))\n"
        "    p.start(); p.join(); print(p.exitcode)\n"
    )
    script = tmp_path / "engine.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert out.stdout.strip() == "0", out.stderr
    capture = Capture(tmp_path / "mp.db")
    try:
        assert capture.runs().iloc[-1].status == "finished"
    finally:
        capture.close()


def test_kvscope_check_judges_a_probe_run_by_its_census(tmp_path: Path) -> None:
    """A probe run (source kind probe) is judged by its census checks, not by the slot ledger."""
    target = tmp_path / "census.db"
    rec = RemoteRecorder(target, config={"source": {"kind": "probe", "engine": "vllm", "version": "0.32.0"}})
    view = BlockView({1: 1, 2: 0}, set(), [2], 1)
    for step, tables in ((1, [{"r1": []}]), (2, [{}])):
        rec.step = step
        rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r1", num_tokens=1, slots=[1])
        result = take_census(
            view if step == 2 else BlockView({1: 0, 2: 0}, set(), [1, 2], 2), tables, [], set(), {1: ("r1", 2, "alloc")}
        )
        for check in census_checks(step, result):
            rec.leak_check(check)
    rec.close()
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", str(target)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.strip().endswith(
        "1 block leaked: block 1 ref 1, accounted 0; last taken by request r1 (alloc at step 2); culprit unknown: "
        "the census sees a reference no table accounts for, not whose take lacked its release"
    )


def test_the_item_sink_reads_back_as_record_does(tmp_path: Path) -> None:
    """The probe's hot wrappers hand flat ITEM_FIELDS tuples (slots as tuples of ints) to item_sink();
    each event reads back exactly as the same event given to record() with list slots."""
    target = tmp_path / "sink.db"
    rec = RemoteRecorder(target, level="full")
    rec.step = 2
    rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r1", num_tokens=2, slots=[4, 5], aux=1)
    rec.record(
        EventKind.EVICT,
        pool=PoolName.FULL,
        rid="r1",
        node_id=6,
        num_tokens=16,
        slots=[6],
        reason=EvictReason.CAPACITY,
        aux=1,
    )
    sink = rec.item_sink()
    sink((2, time.monotonic(), EventKind.ALLOC._value_, PoolName.FULL._value_, "r1", None, 2, 1, None, None, (4, 5)))
    sink(
        (
            2,
            time.monotonic(),
            EventKind.EVICT._value_,
            PoolName.FULL._value_,
            "r1",
            6,
            16,
            1,
            EvictReason.CAPACITY._value_,
            None,
            (6,),
        )
    )
    rec.close()
    capture = Capture(target)
    try:
        events = capture.events(int(capture.runs().iloc[-1].id), limit=100).drop(columns=["seq", "t_mono"])
        rows = [repr(row) for row in events.itertuples(index=False)]
        assert len(rows) == 4 and rows[:2] == rows[2:]
        assert events.slots.iloc[2] == np.array([4, 5], "<i4").tobytes() and events.reason.iloc[3] == "capacity"
    finally:
        capture.close()


def test_an_event_block_reads_back_as_the_same_events_given_to_the_item_sink(tmp_path: Path) -> None:
    """The SGLang probe's fold hands its alloc / free events as one event block (columns); the
    capture holds exactly what the same events give one by one through item_sink(), in place
    between the events around the block (seq, t_mono and slots included)."""
    one_by_one, blocked = tmp_path / "items.db", tmp_path / "block.db"
    before = (4, 1.25, "match", "full", "r1", None, 12, 4, None, None, None)
    events = [
        (3, 1.0, "alloc", "full", "r1", None, 8, 0, None, None, [3, 4]),
        (3, 1.0, "alloc", "swa", "r1", None, 4, 0, None, None, [3, 4]),
        (4, 2.5, "free", "full", None, None, 4, 0, None, None, [7]),
        (4, 2.5, "free", "full", "r2", None, 0, 0, None, None, []),
    ]
    after = (4, 2.5, "lock", "full", "r2", 9, 1, 0, None, None, None)
    rec = RemoteRecorder(one_by_one, level="full")
    sink = rec.item_sink()
    for event in (before, *events, after):
        sink(event)
    rec.close()
    rec = RemoteRecorder(blocked, level="full")
    rec.item_sink()(before)
    rec.event_block(
        (
            {3: 1.0},
            2.5,
            (3, 3, 4, 4),
            bytes([0, 0, 1, 1]),
            ("alloc", "free"),
            bytes([0, 1, 0, 0]),
            ("full", "swa"),
            ("r1", "r1", None, "r2"),
            np.array([8, 4, 4, 0], np.int64).tobytes(),
            np.array([2, 2, 1, 0], np.int64).tobytes(),
            np.array([3, 4, 3, 4, 7], np.int64).tobytes(),
        )
    )
    rec.item_sink()(after)
    rec.close()
    read = []
    for path in (one_by_one, blocked):
        capture = Capture(path)
        try:
            frame = capture.events(int(capture.runs().iloc[-1].id), limit=100)
            read.append([repr(row) for row in frame.itertuples(index=False)])
        finally:
            capture.close()
    assert len(read[1]) == 6 and read[0] == read[1]


def test_the_event_stream_reads_back_as_record_does(tmp_path: Path) -> None:
    """The vLLM probe's hot wrappers append flat records to event_stream() (a clock record per step,
    then (kind, rid, group, num_slots) or an eviction's (evict, rid, group, num_tokens), the block
    ids in a list beside); what reads back is exactly what record() gives for the same events, at
    the step and time of their clock record."""
    plain, streamed = tmp_path / "plain.db", tmp_path / "stream.db"
    rec = RemoteRecorder(plain, level="full")
    rec.step = 3
    rec.record(EventKind.ALLOC, pool=PoolName.FULL, rid="r1", num_tokens=2, slots=[4, 5], aux=1)
    rec.record(
        EventKind.EVICT, pool=PoolName.FULL, rid="r1", node_id=6, num_tokens=16, slots=[6], reason=EvictReason.CAPACITY
    )
    rec.record(EventKind.MATCH, pool=PoolName.FULL, rid="r2", num_tokens=16, aux=3, node_id=1)
    rec.record(EventKind.UNLOCK, pool=PoolName.FULL, rid=None, num_tokens=1, slots=[4], aux=-1)
    rec.close()
    rec = RemoteRecorder(streamed, level="full")
    stream = rec.event_stream()
    rec.step = 3
    stream.tick(3, time.monotonic_ns())
    stream.slots.extend([4, 5])
    stream.records.extend(("alloc", "r1", 1, 2))
    stream.slots.append(6)
    stream.records.extend(("evict", "r1", 0, 16))
    rec.record(EventKind.MATCH, pool=PoolName.FULL, rid="r2", num_tokens=16, aux=3, node_id=1)
    rec.idle()  # NOTE: a hand-off between two events of one step: the next batch opens with its clock
    stream.slots.append(4)
    stream.records.extend(("unlock", None, -1, 1))
    rec.close()
    read = []
    for path in (plain, streamed):
        capture = Capture(path)
        try:
            events = capture.events(int(capture.runs().iloc[-1].id), limit=100)
            read.append([repr(row) for row in events.drop(columns=["t_mono"]).itertuples(index=False)])
        finally:
            capture.close()
    assert len(read[1]) == 4 and read[0] == read[1]


class Block:
    """A slot object as a hot caller appends it (vLLM's KVCacheBlock has its id as block_id)."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


def test_slot_objects_are_mapped_to_their_ids_and_the_host_names_who_took_and_released_them(tmp_path: Path) -> None:
    """A hot caller appends its slot objects (the stream's slot_ids gives their ints once per
    hand-off, record()'s int slots among them), and keeps no ledger of its own:
    the host's, from the stream's hot records, says who last took and released each slot."""
    target = tmp_path / "objects.db"
    rec = RemoteRecorder(target, level="full")
    stream = rec.event_stream()
    stream.slot_ids = lambda slots: [s if type(s) is int else s.block_id for s in slots]
    stream.tick(1, time.monotonic_ns())
    stream.slots.extend([Block(4), Block(5)])
    stream.records.extend(("alloc", "r1", 0, 2))
    rec.idle()
    stream.tick(2, time.monotonic_ns())
    stream.slots.append(Block(5))
    stream.records.extend(("lock", "r2", 0, 1))
    rec.record(EventKind.INSERT, pool=PoolName.FULL, rid="r2", node_id=5, num_tokens=16, slots=[5])
    stream.slots.extend([Block(4), Block(5)])
    stream.records.extend(("free", "r1", 0, 1, "unlock", "r1", 0, 1))
    assert rec.stream_ledger([4, 5, 6]) == (
        {4: ("r1", 1, "alloc"), 5: ("r2", 2, "lock")},
        {4: ("r1", 2, "free"), 5: ("r1", 2, "unlock")},
    )
    rec.close()
    assert rec.stream_ledger([4]) is None  # NOTE: recording over: nobody can say
    capture = Capture(target)
    try:
        events = capture.events(int(capture.runs().iloc[-1].id), limit=100)
        slots = [np.frombuffer(s, "<i4").tolist() for s in events.slots]
        assert list(events.kind) == ["alloc", "lock", "insert", "free", "unlock"]
        assert slots == [[4, 5], [5], [5], [4], [5]]
    finally:
        capture.close()


def test_slots_left_by_a_failed_hot_caller_are_dropped(tmp_path: Path) -> None:
    """A hot wrapper that fails between its block ids and its record leaves ids with no event
    (recording stops there): the events before it read back whole, the stray ids are dropped."""
    target = tmp_path / "stray.db"
    rec = RemoteRecorder(target, level="full")
    stream = rec.event_stream()
    stream.tick(1, time.monotonic_ns())
    stream.slots.extend([7, 8])
    stream.records.extend(("free", "r1", 0, 2))
    stream.slots.append(9)  # NOTE: the failed call's id
    rec.close()
    capture = Capture(target)
    try:
        events = capture.events(int(capture.runs().iloc[-1].id), limit=100)
        assert list(events.kind) == ["free"] and events.slots.iloc[0] == np.array([7, 8], "<i4").tobytes()
    finally:
        capture.close()


@pytest.mark.parametrize("other_thread", [False, True], ids=["main-thread-only", "with-another-thread"])
def test_a_signal_during_a_send_is_delivered_after_it_not_inside_it(other_thread: bool) -> None:
    """vLLM's EngineCore raises SystemExit from its SIGTERM handler; raised inside a send it would
    cut a message in two. Held, the handler runs once the message is out, also while other threads
    run (the engine has some; a thread signal mask let the kernel hand the signal to one of them)."""
    import os
    import signal
    import threading

    from kvscope.telemetry.remote import signals_held

    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    if other_thread:
        helper.start()
    order: list[str] = []
    engine_handler = lambda *_: order.append("handler")  # noqa: E731
    before = signal.signal(signal.SIGTERM, engine_handler)
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes: the point where Python runs a pending handler
                pass
            order.append("send finished")
        order.append("after")
        handler_after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
        stop.set()
    assert order == ["send finished", "handler", "after"]
    assert handler_after is engine_handler, "the engine's own handler is back after the send"


def test_a_sigterm_during_the_close_is_delivered_after_the_run_is_closed(tmp_path: Path) -> None:
    """vLLM's EngineCore takes SIGTERM twice at shutdown (its own, then its manager's) and raises
    SystemExit from the handler. Arriving while the close hands on its last batch, it was delivered
    right after that send and the close message never went out: the run read 'interrupted'."""
    import os
    import signal

    target = tmp_path / "close.db"
    rec = RemoteRecorder(target)
    rec.step = 1
    rec.usage(UsageSample(1, PoolTerms(352, 320, 0, 0), None, 0, 0, 1, 0, 100, 64, 1, 1, 0, 0, full_used=32))
    channel, real_send = rec._channel, rec._channel.send

    def send_under_sigterm(*args: Any) -> None:
        if args[0][0] == "batch":
            os.kill(os.getpid(), signal.SIGTERM)  # the engine's manager, during the last hand-off
        real_send(*args)

    def engine_handler(*_: Any) -> None:
        raise SystemExit(0)

    channel.send = send_under_sigterm  # type: ignore[method-assign]
    before = signal.signal(signal.SIGTERM, engine_handler)
    try:
        with pytest.raises(SystemExit):
            rec.close()
    finally:
        signal.signal(signal.SIGTERM, before)
        channel.close()
        rec._process.wait(timeout=30)
    capture = Capture(target)
    try:
        assert capture.runs().iloc[-1].status == "finished"
    finally:
        capture.close()
