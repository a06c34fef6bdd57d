"""`kvscope attach`: watch a running SGLang, vLLM or kvscope server and record what it shows.

    kvscope attach --url http://127.0.0.1:8000 --kv-events ipc:///tmp/kv.sock --topic kv --capture a.db

NOTE: the order of things
    1. discover the server (kvscope.attach.discover): one line of what it is, then one warning line
       each for a stream version known to be wrong; an unreachable URL or a bad endpoint, an older
       capture: one line, exit 2, no capture made
    2. subscribe to its KV events (--kv-events, else what the server advertises; none: metrics
       only), catching up from the replay socket when there is one
    3. loop: the delivered batches go into the page forest and the capture as events; every
       --scrape-s one scrape of /metrics is one step (a usage row); a progress line on a terminal
    4. the end: --duration-s reached, or SIGINT / SIGTERM / SIGHUP (the normal stop): capture
       'finished', a summary, exit 0. The server
       stops answering: a warning line per failed scrape, and after MAX_FAILED_SCRAPES in a row
       one line, capture 'interrupted' with that line as its error, exit 1. Attach itself fails
       (an error of its own): the capture closed 'crashed' with the error, one line, exit 1.
vLLM's stream does not begin with a clear, so a publisher restart (the subscriber's `restarts`
grows) clears the forest here (its pages are recorded as evicted, reason reset).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import zmq

from kvscope.app.progress import Progress
from kvscope.app.report import retention_lines, run_retention
from kvscope.attach.discover import EngineInfo, discover
from kvscope.attach.errors import AttachError
from kvscope.attach.recorder import AttachRecorder, attach_ready, source_config
from kvscope.attach.scrape import EngineSample, scrape
from kvscope.attach.subscriber import EventSubscriber
from kvscope.telemetry import Retention, RunStatus, display_name

MAX_FAILED_SCRAPES = 5
POLL_MS = 50
EXIT_SERVER_GONE = 1
EXIT_CRASHED = 1
# NOTE: a stop signal is the normal way to end attach (docs/attach.md), as for serve: the run is 'finished'
NORMAL_STOPS = ("SIGINT", "SIGTERM", "SIGHUP")


@dataclass
class Outcome:
    status: str
    error: str | None
    reason: str  # why it ended, in words


def default_capture_path(engine: str) -> str:
    return f"runs/{time.strftime('%Y%m%d-%H%M%S')}-attach-{engine}.db"


def attach_verb(args: argparse.Namespace) -> int:
    try:
        return attach(args)
    except (AttachError, zmq.ZMQError) as err:
        print(f"kvscope attach: error: {err}", file=sys.stderr)
        return 2


def events_endpoint(args: argparse.Namespace, info: EngineInfo) -> dict[str, Any] | None:
    """The stream to subscribe: the flags, else what the server advertises (flags override its fields)."""
    found = dict(info.kv_events) if info.kv_events else None
    if args.kv_events is None and found is None:
        return None
    stream = found or {"endpoint": None, "replay_endpoint": None, "topic": "", "bind": False}
    if args.kv_events is not None:
        stream["endpoint"] = args.kv_events
    if args.replay is not None:
        stream["replay_endpoint"] = args.replay
    if args.topic is not None:
        stream["topic"] = args.topic
    if args.bind:
        stream["bind"] = True
    return stream


def found_line(info: EngineInfo, url: str, stream: dict[str, Any] | None, capture: str) -> str:
    what = f"{info.engine} {info.version}" if info.version else info.engine
    parts = [
        f"model {info.model or '?'}",
        f"block {info.block_size or '?'} tokens",
        f"capacity {info.capacity_tokens if info.capacity_tokens is not None else '?'} tokens",
    ]
    events = (
        f"events {stream['endpoint']}" + (f" (topic {stream['topic']!r})" if stream.get("topic") else "")
        if stream
        else "no KV events (metrics only: give --kv-events to see pages)"
    )
    return f"kvscope attach: {what} at {url}: {', '.join(parts)}; {events}; capture {capture}"


def attach(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    capture = args.capture or None
    if capture is not None:
        attach_ready(capture)  # NOTE: before anything is asked of the server: an older capture is refused at once
    info = discover(args.url, engine=args.engine, timeout_s=args.timeout_s)
    stream = events_endpoint(args, info)
    capture = capture or default_capture_path(info.engine)
    print(found_line(info, args.url, stream, display_name(capture)), file=sys.stderr, flush=True)
    for warning in info.warnings:
        print(f"kvscope attach: warning: {warning}", file=sys.stderr, flush=True)
    subscriber = subscribe(stream) if stream is not None else None
    counters: dict[str, Any] = {}
    try:
        retention = Retention(getattr(args, "keep_events", None), getattr(args, "max_size", None))
        recorder = AttachRecorder(capture, source_config(info, args.url, stream), retention=retention)
        try:
            outcome = watch(args, info, subscriber, recorder)
        except (KeyboardInterrupt, SystemExit) as stop:
            outcome = stopped(stop_name(stop), recorder.ticks)
        except Exception as err:  # NOTE: attach's own failure: the run is 'crashed', never left to exit-time close
            error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
            outcome = Outcome(RunStatus.CRASHED, f"{error} at scrape {recorder.ticks}", f"crashed ({error})")
    finally:
        if subscriber is not None:
            counters = stream_counters(subscriber)
            subscriber.close()
    recorder.close(counters, outcome.status, outcome.error)
    summary = summarize(recorder, counters, display_name(capture), outcome)
    summary["retention"] = run_retention(str(capture), recorder.run_id) if retention.bounded else None
    if args.json:
        out.write(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    else:
        out.write(summary_text(summary))
    if outcome.status == RunStatus.CRASHED:
        print(
            f"kvscope attach: error: attach {outcome.reason}; capture {display_name(capture)} closed as crashed",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CRASHED
    if recorder.sql.failure:
        return 4
    return EXIT_SERVER_GONE if outcome.reason.startswith("the server") else 0


def stopped(signal_name: str, ticks: int) -> Outcome:
    """The outcome of a stop signal: SIGINT, SIGTERM and SIGHUP are attach's normal stop (a
    'finished' run); any other leaves it 'interrupted'."""
    reason = f"stopped by {signal_name}"
    if signal_name in NORMAL_STOPS:
        return Outcome(RunStatus.FINISHED, None, reason)
    return Outcome(RunStatus.INTERRUPTED, f"{signal_name} at scrape {ticks}", reason)


def subscribe(stream: dict[str, Any]) -> EventSubscriber:
    """The subscriber on `stream`; AttachError (one line) for an endpoint ZMQ refuses."""
    try:
        subscriber = EventSubscriber(
            stream["endpoint"],
            replay_endpoint=stream.get("replay_endpoint"),
            topic=stream.get("topic") or "",
            bind=bool(stream.get("bind")),
        )
    except zmq.ZMQError as err:
        raise AttachError(
            f"cannot {'bind' if stream.get('bind') else 'subscribe to'} KV events at {stream['endpoint']!r}: {err}"
        ) from err
    stream["endpoint"] = subscriber.endpoint  # NOTE: a bound wildcard port, resolved
    return subscriber


def stop_name(stop: BaseException) -> str:
    signum = getattr(stop, "signum", None)
    if signum is None and isinstance(stop, SystemExit) and isinstance(stop.code, int) and stop.code > 128:
        signum = stop.code - 128
    if signum is None:
        return "SIGINT" if isinstance(stop, KeyboardInterrupt) else type(stop).__name__
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def watch(
    args: argparse.Namespace, info: EngineInfo, subscriber: EventSubscriber | None, recorder: AttachRecorder
) -> Outcome:
    """The loop; returns when --duration-s is reached or the server is gone (signals raise)."""
    progress = Progress(interval_s=0.5)
    start = time.monotonic()
    deadline = start + args.duration_s if args.duration_s is not None else None
    next_scrape = start
    failed = 0
    restarts = 0
    try:
        if subscriber is not None and subscriber.replay_endpoint is not None:
            for frame in poll_catch_up(subscriber):
                recorder.apply(frame.batch)
        while True:
            now = time.monotonic()
            if subscriber is not None:
                wait_ms = max(0, min(POLL_MS, int((next_scrape - now) * 1000)))
                for frame in subscriber.poll(wait_ms):
                    if subscriber.restarts != restarts and info.engine == "vllm":
                        restarts = subscriber.restarts
                        recorder.clear()
                    recorder.apply(frame.batch)
            else:
                time.sleep(max(0.0, min(POLL_MS / 1000, next_scrape - now)))
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                recorder.tick(scrape_or_none(args, info, recorder))
                return Outcome(RunStatus.FINISHED, None, f"--duration-s {args.duration_s:g} reached")
            if now < next_scrape:
                continue
            next_scrape = now + args.scrape_s
            try:
                sample: EngineSample | None = scrape(args.url, info, timeout_s=args.timeout_s)
                failed = 0
            except AttachError as err:
                sample = None
                failed += 1
                progress.close()
                progress.drawn = False
                print(
                    f"kvscope attach: warning: scrape {failed} of {MAX_FAILED_SCRAPES} failed: {err}",
                    file=sys.stderr,
                    flush=True,
                )
                if failed >= MAX_FAILED_SCRAPES:
                    line = f"the server stopped answering ({failed} scrapes in a row failed; the last: {err})"
                    recorder.tick(None)
                    return Outcome(RunStatus.INTERRUPTED, line, line)
            recorder.tick(sample)
            if progress.due():
                progress.draw(progress_line(recorder, subscriber, time.monotonic() - start))
    finally:
        progress.close()


def poll_catch_up(subscriber: EventSubscriber) -> list[Any]:
    """The history the replay socket still holds, then whatever is already waiting."""
    subscriber.catch_up()
    return subscriber.poll(0)


def scrape_or_none(args: argparse.Namespace, info: EngineInfo, recorder: AttachRecorder) -> EngineSample | None:
    try:
        return scrape(args.url, info, timeout_s=args.timeout_s)
    except AttachError as err:
        print(f"kvscope attach: warning: the last scrape failed: {err}", file=sys.stderr, flush=True)
        return None


def hit_rate(sample: EngineSample | None) -> float | None:
    if sample is None or not sample.prompt_tokens_total or sample.cached_tokens_total is None:
        return None
    return sample.cached_tokens_total / sample.prompt_tokens_total


def progress_line(recorder: AttachRecorder, subscriber: EventSubscriber | None, elapsed_s: float) -> str:
    device = recorder.forest.tiers["device"]
    rate = hit_rate(recorder.last_sample)
    stream = f", {subscriber.delivered} batches, {subscriber.lost_batches} lost" if subscriber is not None else ""
    return (
        f"attached {elapsed_s:.0f} s: {device.num_pages} pages ({device.num_tokens} tokens) cached, "
        f"{recorder.evictions} evicted, hit {'?' if rate is None else f'{rate:.0%}'}{stream}  "
    )


def stream_counters(subscriber: EventSubscriber) -> dict[str, Any]:
    return {
        "delivered": subscriber.delivered,
        "replayed": subscriber.replayed,
        "lost_batches": subscriber.lost_batches,
        "gaps": [list(gap) for gap in subscriber.gaps],
        "duplicates": subscriber.duplicates,
        "restarts": subscriber.restarts,
        "bad_messages": subscriber.bad_messages,
        "last_error": subscriber.last_error,
        "replay_timeouts": subscriber.replay_timeouts,
    }


def summarize(recorder: AttachRecorder, counters: dict[str, Any], capture: str, outcome: Outcome) -> dict[str, Any]:
    device = recorder.forest.tiers["device"]
    host = recorder.forest.tiers["host"]
    sample = recorder.last_sample
    return {
        "source": recorder.source,
        "capture": capture,
        "run_id": recorder.run_id,
        "status": outcome.status,
        "ended": outcome.reason,
        "error": outcome.error,
        "ticks": recorder.ticks,
        "pages": {
            "device": device.num_pages,
            "device_tokens": device.num_tokens,
            "host": host.num_pages,
            "host_tokens": host.num_tokens,
        },
        "evictions": recorder.evictions,
        "evicted_tokens": device.num_removed_tokens,
        "resets": recorder.forest.resets,
        "stream": counters,
        "hit_rate": hit_rate(sample),
        "prompt_tokens_total": sample.prompt_tokens_total if sample else None,
        "cached_tokens_total": sample.cached_tokens_total if sample else None,
    }


def summary_text(summary: dict[str, Any]) -> str:
    pages, stream = summary["pages"], summary["stream"]
    kept = summary.get("retention")
    rate = summary["hit_rate"]
    lines = [
        f"ended             {summary['ended']}",
        f"cached pages      {pages['device']} on the device ({pages['device_tokens']} tokens)"
        + (f", {pages['host']} on the host ({pages['host_tokens']} tokens)" if pages["host"] else ""),
        f"evictions         {summary['evictions']} pages ({summary['evicted_tokens']} tokens), "
        f"{summary['resets']} resets",
        f"hit rate          {'not known' if rate is None else f'{rate:.1%}'} "
        f"({summary['cached_tokens_total']} of {summary['prompt_tokens_total']} prompt tokens)",
        *(
            [
                f"stream            {stream['delivered']} batches, {stream['lost_batches']} lost, "
                f"{stream['restarts']} restarts, {stream['bad_messages']} bad messages"
            ]
            if stream
            else []
        ),
        f"scrapes           {summary['ticks']}",
        *[f"{'retention' if i == 0 else '':<18}{line}" for i, line in enumerate(retention_lines(kept) if kept else [])],
        f"capture           {summary['capture']} (run {summary['run_id']}, {summary['status']})",
    ]
    return "\n".join(lines) + "\n"
