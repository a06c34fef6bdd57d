"""The engine-neutral core of the probe: activation from the environment, the patcher, the guard
every wrapper runs its recording under, and the hand-off to kvscope's recorder.

NOTE: activation (the tracers' convention: entry points inert unless the environment says so)
    KVSCOPE_CAPTURE   a capture file or database URL; unset: the probe patches nothing
    KVSCOPE_LEVEL     summary (census, usage, requests) or full (and every block event); default the
                      engine's (DEFAULT_LEVEL: full on vLLM, where it costs under 1 µs per call; summary
                      on SGLang, where full costs 2-3 µs per allocator or tree call, docs/probe.md)
    KVSCOPE_PYTHON    the interpreter of the recorder's host process (one with kvscope's dependencies;
                      `kvscope instrument` passes its own), default this one
NOTE: when the census runs while the engine is busy (between steps; 0 turns a bound off, both 0: only
    at idle edges and at drain); the defaults are measured (benchmarks/bench_census.py, RESULTS.md)
    KVSCOPE_CENSUS_EVERY_STEPS  after this many engine steps since the last census, default 100
    KVSCOPE_CENSUS_EVERY_S      or after this many seconds since the last census, default 10
    and never sooner than CENSUS_BUDGET_X times the last census's own duration (its engine-thread
    time stays at most 1/CENSUS_BUDGET_X of the time between censuses, whatever the pool's size)
NOTE: a lingering request (finished or aborted, still in the engine's table: a delayed free for a KV
    transfer, or a free that never came) is a leak only once it has lingered past both bounds
    KVSCOPE_LINGER_STEPS        engine steps, default 1000
    KVSCOPE_LINGER_S            seconds, default 600 (above vLLM's own 480 s default timeout for a
                                KV consumer that never reads a finished prefill's blocks)
NOTE: retention (docs/captures.md): what the capture keeps of the events, an engine running for weeks
    KVSCOPE_KEEP_EVENTS         a window (90s, 30m, 6h, 7d); default none
    KVSCOPE_MAX_SIZE            a size (512MiB, 20GiB, 20GB; none: no bound), default 4GiB
NOTE: never into the engine
    A patch is all or nothing: every target is resolved before the first is replaced; one that is
    missing (or an engine version the table does not name) patches nothing, prints one line and
    records why in the capture. A wrapper calls the engine's method exactly as before; only
    kvscope's part runs under `guarded`, and its first exception stops recording (one line).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvscope.telemetry import NULL_RECORDER, Recorder
from kvscope.telemetry.exits import CRASHED, FINISHED, INTERRUPTED, ExitStatus, status_of
from kvscope.telemetry.retention import parse_duration_s, parse_size_bytes

if TYPE_CHECKING:
    from kvscope.telemetry.remote import RemoteRecorder

LEVELS = ("summary", "full")
# NOTE: the level when KVSCOPE_LEVEL is unset: what stays within the probe's 1 µs per wrapped operation on
# each engine's real calls (RESULTS.md: bench_probe, bench_probe_sglang). SGLang's full hooks every allocator
# and tree call at 2-3 µs each there, so it is a debugging level on SGLang, asked for by name.
DEFAULT_LEVEL = {"vllm": "full", "sglang": "summary"}


CENSUS_BUDGET_X = 100  # NOTE: a busy census's engine-thread time <= 1% of the time between censuses
# NOTE: the last census by how the engine ended: after a normal shutdown (drain); after an engine error (crash:
# it reads what the error left, a step's half-done work included); none when a shutdown was asked for and an
# error followed (interrupted: the signal's doing, not the engine's)
LAST_CENSUS = {FINISHED: "drain", CRASHED: "crash"}
DEFAULT_MAX_BYTES = 4 * 2**30  # NOTE: KVSCOPE_MAX_SIZE's default: an engine runs for weeks (as serve's --max-size)


class Settings(NamedTuple):
    capture: str
    level: str
    python: str | None
    census_every_steps: int = 100
    census_every_s: float = 10.0
    linger_steps: int = 1000
    linger_s: float = 600.0
    keep_events_s: float | None = None
    max_bytes: int | None = DEFAULT_MAX_BYTES


def settings_from_env(environ: dict[str, str] | None = None, *, engine: str) -> Settings | None:
    """The probe's settings, or None when KVSCOPE_CAPTURE is unset (the probe stays inert); the level
    is `engine`'s default (DEFAULT_LEVEL) unless KVSCOPE_LEVEL names one. A bound that is not a number
    >= 0 raises ValueError naming it (the plugin hook makes it one line)."""
    env = os.environ if environ is None else environ
    capture = env.get("KVSCOPE_CAPTURE", "").strip()
    if not capture:
        return None
    level = env.get("KVSCOPE_LEVEL", "").strip() or DEFAULT_LEVEL[engine]
    defaults = Settings("", "", None)
    return Settings(
        capture,
        level,
        env.get("KVSCOPE_PYTHON") or None,
        int(_bound(env, "KVSCOPE_CENSUS_EVERY_STEPS", defaults.census_every_steps, whole=True)),
        _bound(env, "KVSCOPE_CENSUS_EVERY_S", defaults.census_every_s),
        int(_bound(env, "KVSCOPE_LINGER_STEPS", defaults.linger_steps, whole=True)),
        _bound(env, "KVSCOPE_LINGER_S", defaults.linger_s),
        _retention_value(env, "KVSCOPE_KEEP_EVENTS", parse_duration_s, None),
        _retention_value(env, "KVSCOPE_MAX_SIZE", parse_size_bytes, defaults.max_bytes),
    )


def _retention_value(env: Mapping[str, str], name: str, parse: Callable[[str], Any], default: Any) -> Any:
    text = env.get(name, "").strip()
    if not text:
        return default
    if text.lower() == "none":
        return None
    try:
        return parse(text)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _bound(env: Mapping[str, str], name: str, default: float, *, whole: bool = False) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        value = -1
    if not value >= 0 or value == float("inf"):
        kind = "a whole number" if whole else "a number of seconds"
        raise ValueError(f"{name} must be {kind} >= 0, got {text!r}")
    return value


def census_clock() -> float:
    """The clock a census's own cost is read on: the engine thread's CPU seconds. Not the wall clock: a
    census descheduled for a second on a loaded machine would put the next one off by CENSUS_BUDGET_X
    seconds for CPU it never used."""
    return time.thread_time()


def busy_census_due(
    settings: Settings | None, steps_since: int, since_s: float, cost_s: float, budget_x: float = CENSUS_BUDGET_X
) -> bool:
    """A busy census is due: `steps_since` engine steps or `since_s` seconds since the last census ended
    reach a setting, and `since_s` is at least `budget_x` times the last census's own time (`cost_s`)."""
    if settings is None:
        return False
    every_steps, every_s = settings.census_every_steps, settings.census_every_s
    due = (every_steps > 0 and steps_since >= every_steps) or (every_s > 0 and since_s >= every_s)
    return due and since_s >= budget_x * cost_s


def engine_ending(err: BaseException | None, *, shutdown_asked: bool) -> ExitStatus:
    """How an engine's loop ended, from the exception that ended it (None: it returned; telemetry/exits.py).
    An error raised after a shutdown was asked for is the signal's doing, not the engine's (a signal to the
    whole process group stops the step in flight): interrupted, with the error's line."""
    ending = status_of(err)
    if ending.status == CRASHED and shutdown_asked and not isinstance(err, SystemExit):
        return ExitStatus(INTERRUPTED, f"a shutdown was asked for while a step ran: {ending.error}")
    return ending


class Target(NamedTuple):
    """One method to wrap: `module`.`cls`.`method`, by a wrapper factory taking the original."""

    module: str
    cls: str
    method: str
    factory: Callable[[Callable[..., Any]], Callable[..., Any]]

    @property
    def name(self) -> str:
        return f"{self.cls}.{self.method}"


class PatchResult(NamedTuple):
    patched: list[str]
    missing: list[str]  # empty when every target was patched; else nothing was


def patch_all(targets: list[Target]) -> PatchResult:
    """Replace every target's method by its wrapper, or none when any target is missing."""
    resolved, missing = [], []
    for target in targets:
        try:
            cls = getattr(importlib.import_module(target.module), target.cls)
            original = cls.__dict__[target.method]
        except (ImportError, AttributeError, KeyError):
            missing.append(f"{target.module}.{target.name}")
            continue
        if not callable(original):
            missing.append(f"{target.module}.{target.name}")
            continue
        resolved.append((cls, target, original))
    if missing:
        return PatchResult([], missing)
    for cls, target, original in resolved:
        wrapper = target.factory(original)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = original.__name__
        setattr(cls, target.method, wrapper)
    return PatchResult([t.name for _, t, _ in resolved], [])


def unpatch_all(targets: list[Target]) -> None:
    """Put the originals back (tests; a probe never unpatches a running engine)."""
    for target in targets:
        cls = getattr(importlib.import_module(target.module), target.cls)
        wrapper = cls.__dict__.get(target.method)
        if wrapper is not None and hasattr(wrapper, "__wrapped__"):
            setattr(cls, target.method, wrapper.__wrapped__)


@dataclass
class ProbeState:
    """The probe's recorder and whether it still records. One per process."""

    recorder: Recorder = NULL_RECORDER
    active: bool = False
    reason: str | None = None  # why recording stopped (or never started)
    engine: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self, reason: str) -> None:
        """Recording stops for good: one line; the engine goes on untouched."""
        if not self.active and self.reason is not None:
            return
        self.active = False
        self.reason = reason
        say(f"recording stopped: {reason}")
        with suppress(Exception):  # NOTE: never into the engine
            self.recorder.close("incomplete", reason)

    def recording(self) -> tuple[bool, str | None]:
        """Whether the probe records now (active, and its recorder has not failed) and, when not, why: what
        /metrics exports as kvscope_probe_recording and its reason (metrics.py)."""
        failure = getattr(self.recorder, "failure", None)
        recording = self.active and failure is None
        return recording, None if recording else self.reason or failure


def say(line: str) -> None:
    print(f"kvscope probe: {line}", file=sys.stderr, flush=True)


def error_line(err: BaseException) -> str:
    """An exception as the one line the probe says and stores: its type and its text's first line."""
    return f"{type(err).__name__}: {err}".splitlines()[0]


def run_label(engine: str, version: str, pid: int, dp_rank: int | None = None) -> str:
    """A probe run's label in the capture (`vllm 0.32.0 probe dp 1 pid 4242`; no `dp R` without a rank)."""
    rank = "" if dp_rank is None else f"dp {dp_rank} "
    return f"{engine} {version} probe {rank}pid {pid}"


@contextmanager
def guarded(state: ProbeState) -> Iterator[None]:
    """kvscope's part of a wrapper: its first exception stops recording, never reaches the engine."""
    try:
        yield
    except Exception as err:
        state.stop(error_line(err))


def open_recorder(settings: Settings, *, label: str, config: dict[str, Any]) -> RemoteRecorder:
    """kvscope's recorder for this process (RemoteRecorder: nothing here imports SQLAlchemy)."""
    from kvscope.telemetry.remote import RemoteRecorder

    if settings.level not in LEVELS:
        raise ValueError(f"KVSCOPE_LEVEL must be summary or full, got {settings.level!r}")
    return RemoteRecorder(
        settings.capture,
        level=settings.level,
        label=label,
        config=config,
        python=settings.python,
        retention=(settings.keep_events_s, settings.max_bytes),
    )


class OpensPerProcess(Protocol):
    """A probe whose recorder belongs to one process (a forked or spawned child opens its own)."""

    state: ProbeState
    settings: Settings | None
    pid: int
    version: str
    dp_rank: int | None

    def config(self, *, patched: bool, reason: str | None = None) -> dict[str, Any]: ...

    def unwire(self) -> None:
        """Forget the hot path's sinks (a child must not write into its parent's buffers)."""

    def wire(self, rec: Any) -> None:
        """Point the hot path at `rec`, just opened."""


def process_recorder(probe: OpensPerProcess, engine: str) -> Any:
    """The probe's recorder in this process, opened at the process's first event; None once
    recording stopped (an open that fails stops it, never reaching the engine)."""
    if not probe.state.active:
        return None
    if probe.pid != os.getpid():
        probe.pid = os.getpid()
        assert probe.settings is not None
        with guarded(probe.state):
            probe.unwire()
            rec = probe.state.recorder = open_recorder(
                probe.settings,
                label=run_label(engine, probe.version, probe.pid, probe.dp_rank),
                config=probe.config(patched=True),
            )
            probe.wire(rec)
        if not probe.state.active:
            return None
    return probe.state.recorder


def installed_version(*dists: str) -> str:
    """The version of the first of these distributions installed here ("unknown": none is)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in dists:
        with suppress(PackageNotFoundError):
            return version(name)
    return "unknown"


def register_never_raising(register: Callable[[], str]) -> None:
    """An engine's plugin hook: `register` patches or refuses; whatever it raises is one line here."""
    try:
        register()
    except Exception as err:  # NOTE: never into the engine
        say(f"not recording: {error_line(err)}")


def refuse(state: ProbeState, settings: Settings | None, reason: str, *, label: str, config: dict[str, Any]) -> str:
    """One line, and the refusal recorded in the capture once per server: by its first process
    (KVSCOPE_PROBE_REFUSED is inherited by the engine's later processes, forked or spawned)."""
    say(reason)
    state.reason = reason
    if os.environ.get("KVSCOPE_PROBE_REFUSED") is None and settings is not None:
        os.environ["KVSCOPE_PROBE_REFUSED"] = "1"
        with guarded(state):
            open_recorder(settings, label=label, config=config).close("crashed", f"probe refused: {reason}")
    return reason
