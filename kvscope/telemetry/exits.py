"""How a process is ending, as the status its run closes with when its owner did not close it first.
Standard library only: the probe's side of RemoteRecorder (inside an engine) imports it.

NOTE: the status a run closes with (RunStatus's values), by how the process ends
    normal end, sys.exit(0) / sys.exit()       finished
    an uncaught exception                       crashed, error = its one line ("ValueError: ..."; one with
                                                no message by where it was raised: "AssertionError at
                                                vllm/v1/core/block_pool.py:300: assert block.ref_cnt == 0")
    KeyboardInterrupt (Ctrl-C, SIGINT)          interrupted, error "KeyboardInterrupt"
    sys.exit(N), N != 0 (or a message)          crashed, error "exited with code N" ("exited: message")
    killed (SIGKILL, SIGTERM's default action,  no exit handler runs: the recorder's host closes the run
    os._exit)                                   crashed, "ended without closing" (remote.py)
NOTE: where the cause is read
    A multiprocessing child (vLLM's EngineCore, SGLang's scheduler) runs its finalizers while the
    exception that ends it is still in flight: sys.exc_info() names it, SystemExit and its code too.
    A main program runs atexit after the exception was handled: sys.excepthook (hooked here, chained
    to the previous hook, never swallowing) saw an uncaught one, and sys.exit (wrapped here) saw its
    code. A SystemExit raised directly in a main program (not through sys.exit) leaves no trace: it
    reads as a normal end. A thread's uncaught exception does not end the process and changes nothing.
"""

from __future__ import annotations

import linecache
import sys
import threading
from typing import Any, NamedTuple

FINISHED, CRASHED, INTERRUPTED = "finished", "crashed", "interrupted"  # NOTE: RunStatus's values (records.py)


class ExitStatus(NamedTuple):
    status: str
    error: str | None


class _Seen:
    installed = False
    uncaught: BaseException | None = None  # the main program's uncaught exception (sys.excepthook)
    exit_code: Any = None  # the argument of the last sys.exit call
    exit_called = False


_SEEN = _Seen()
_LOCK = threading.Lock()


def watch_exits() -> None:
    """Hook sys.excepthook and wrap sys.exit in this process (once; a forked child inherits both)."""
    with _LOCK:
        if _SEEN.installed:
            return
        _SEEN.installed = True
        previous_hook, previous_exit = sys.excepthook, sys.exit

        def excepthook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
            _SEEN.uncaught = value
            previous_hook(kind, value, traceback)

        def exit(*args: Any) -> Any:
            _SEEN.exit_called, _SEEN.exit_code = True, args[0] if args else None
            return previous_exit(*args)

        exit.__doc__ = previous_exit.__doc__
        sys.excepthook = excepthook
        sys.exit = exit


def status_of(err: BaseException | None) -> ExitStatus:
    """The closing status of a process that ends by `err` (None: it ended normally)."""
    if err is None:
        return ExitStatus(FINISHED, None)
    if isinstance(err, SystemExit):
        code = err.code
        if code is None or code == 0:
            return ExitStatus(FINISHED, None)
        if isinstance(code, int):
            return ExitStatus(CRASHED, f"exited with code {code}")
        return ExitStatus(CRASHED, f"exited: {one_line(str(code))}")
    if isinstance(err, KeyboardInterrupt):
        return ExitStatus(INTERRUPTED, "KeyboardInterrupt")
    return ExitStatus(CRASHED, one_line(f"{type(err).__name__}: {err}" if str(err) else _bare(err)))


def _bare(err: BaseException) -> str:
    """An exception without a message (a bare `assert`) by where it was raised: its type, the innermost
    frame's file and line, and that line's source ("AssertionError at vllm/v1/core/block_pool.py:300:
    assert block.ref_cnt == 0")."""
    name = type(err).__name__
    tb = err.__traceback__
    if tb is None:
        return name
    while tb.tb_next is not None:
        tb = tb.tb_next
    path, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    parts = path.replace("\\", "/").split("/")
    where = "/".join(parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-2:])
    source = linecache.getline(path, line).strip()
    return f"{name} at {where}:{line}" + (f": {source}" if source else "")


def exit_status() -> ExitStatus:
    """How this process is ending, read from an exit handler (atexit or a multiprocessing finalizer)."""
    in_flight = sys.exc_info()[1]
    if in_flight is not None:
        return status_of(in_flight)
    uncaught = _SEEN.uncaught or getattr(sys, "last_value", None)
    if uncaught is not None:
        return status_of(uncaught)
    if _SEEN.exit_called:
        return status_of(SystemExit(_SEEN.exit_code))
    return ExitStatus(FINISHED, None)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0][:500] if lines else ""
