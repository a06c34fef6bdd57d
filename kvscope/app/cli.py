"""The `kvscope` command: every verb's arguments, and the dispatch to the verb's module.

    demo            demo.py     the pools, slot by slot
    run             runner.py   a workload or trace through the engine into a capture
    runs, report leaks, check, diff
                    report.py   read a capture
    plan, replay    plan.py     capacity on a GPU, hit rate vs cache capacity
    serve           serve.py    the engine behind an OpenAI-compatible HTTP server
    load            load.py     traffic for a server, through the official openai client
    attach          attach.py   a running SGLang / vLLM / kvscope server's KV cache into a capture

A handler returns the exit code. Bad input raises ValueError, OSError or CaptureError with one
line, which `main` prints as `kvscope <verb>: error: <line>` and exits 2; a stop signal exits
128 + its number with one line (kvscope/__main__.py).
A malformed flag value is argparse's error, printed the same way (`Parser`). Sizes take unit
suffixes (units.py); help states each default once (`HelpFormatter`).

NOTE: runner.py, demo.py and serve.py load torch, so they are imported only when their verb runs:
`--help`, the capture readers, `plan` and `replay` never load it (replays run in workers).
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvscope import __version__
from kvscope.app.instrument import add_instrument_parser
from kvscope.app.plan import plan_verb, replay_verb
from kvscope.app.report import check_verb, diff_verb, engine_log_verb, report_verb, runs_verb
from kvscope.app.units import (
    byte_size,
    finite_float,
    on_off,
    pinned_file,
    port_number,
    positive_count,
    promote_threshold,
    thread_count,
    token_count,
    token_counts,
)
from kvscope.app.upgrade import upgrade_verb
from kvscope.engine import AUTO, CACHE_KINDS
from kvscope.engine import cli_help as cache_help
from kvscope.engine.config import SCHEDULE_POLICIES, WRITE_POLICIES
from kvscope.planning import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MEM_FRACTION_STATIC,
    EXACTNESS,
    KV_DTYPES,
    PRESETS,
)
from kvscope.telemetry import CaptureError
from kvscope.workloads import WORKLOADS

SubParsers = Any  # argparse._SubParsersAction, private in typeshed
POLICY_HELP = "lru, lfu, fifo, mru, filo, priority, slru"
# NOTE: one flag name per concept across verbs; an older spelling still parses, hidden from --help
# (docs/cli.md lists them): old spelling -> the name every verb uses now
OLD_SPELLINGS = {
    "--swa-ratio": "--swa-full-tokens-ratio",  # run, serve (plan and SGLang say --swa-full-tokens-ratio)
    "--pace": "--rate",  # run (load and make run say --rate)
    "--eviction": "--eviction-granularity",  # replay (run and serve say --eviction-granularity)
    "--policy": "--eviction-policy",  # replay
    "--duration": "--duration-s",  # load (attach says --duration-s)
    "--timeout": "--timeout-s",  # load
}


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line, `kvscope <verb>: error: <line>`, exit 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_old_spelling(parser: argparse.ArgumentParser, new: argparse.Action) -> None:
    """The older spelling of `new` (OLD_SPELLINGS): the same value into the same attribute,
    hidden from --help; the default is `new`'s."""
    (old,) = [old for old, name in OLD_SPELLINGS.items() if name in new.option_strings]
    alias = parser.add_argument(old, dest=new.dest, choices=new.choices, metavar=new.metavar,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    alias.type = new.type


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" only where the help states no default of its own and there is
    one to state (not None, a flag's False, or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False or action.default == []:
            return text
        return super()._get_help_string(action)


DEFAULTS = HelpFormatter


def _run(args: argparse.Namespace) -> int:
    from kvscope.app.runner import run_verb

    return run_verb(args)


def _serve(args: argparse.Namespace) -> int:
    from kvscope.app.serve import serve_verb

    return serve_verb(args)


def _demo(args: argparse.Namespace) -> int:
    from kvscope.app.demo import demo_verb

    return demo_verb(args)


def add_demo_parser(verbs: SubParsers) -> None:
    demo = verbs.add_parser(
        "demo",
        help="print a live, slot-by-slot demo of the memory pools",
        description="Run requests through the request-to-token pool, the paged allocator, the "
        "KV buffers and the SWA allocator, printing the page map after every step.",
        formatter_class=DEFAULTS,
    )
    demo.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    demo.add_argument("--page-size", type=int, default=4, help="tokens per page (>= 2)")
    demo.add_argument("--delay", type=finite_float(0, low_open=False), default=0.3, help="seconds between steps")
    demo.set_defaults(func=_demo)


def add_runs_parser(verbs: SubParsers) -> None:
    runs = verbs.add_parser(
        "runs",
        help="list the runs recorded in a capture",
        description="List every run in a capture with its status (running, finished, interrupted, crashed, "
        "incomplete, or 'ended without closing' when the recording process died), level, start time, length "
        "and error line.",
        formatter_class=DEFAULTS,
    )
    runs.add_argument("capture", help="a capture file (SQLite) or a SQLAlchemy URL")
    runs.add_argument("--run", type=int, help="only this run id (default: every run)")
    runs.add_argument("--json", action="store_true", help="print the runs as JSON (shape: docs/cli.md)")
    runs.set_defaults(func=runs_verb)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's options, the same for `run` and `serve` (runner.engine_from_args reads them)."""
    parser.add_argument("--model", default="tiny",
                        help="tiny, tiny-swa, or a shape like 'layers=4,hidden=64,window=32'")
    parser.add_argument("--cache", default=AUTO, choices=[AUTO, *CACHE_KINDS], help=cache_help())
    parser.add_argument("--eviction-policy", default="lru", help=POLICY_HELP)
    parser.add_argument("--eviction-granularity", default="leaf", choices=["leaf", "page"],
                        help="leaf: SGLang's whole-leaf eviction; page: only the pages needed")
    parser.add_argument("--page-size", type=int, default=1, help="tokens per KV page (a power of two)")
    parser.add_argument("--kv-tokens", type=token_count, default=4096, metavar="TOKENS",
                        help="KV capacity of the full pool, in tokens (4096, 64k, 1.5M, 128Ki)")
    add_old_spelling(parser, parser.add_argument("--swa-full-tokens-ratio", dest="swa_ratio", type=finite_float(0, 1),
                                                 default=0.8, metavar="RATIO",
                                                 help="SWA pool size as a fraction of the full pool"))
    parser.add_argument("--chunked-prefill-size", type=token_count, default=256, metavar="TOKENS",
                        help="tokens per prefill chunk; 0 disables")
    parser.add_argument("--max-running-requests", type=positive_count, default=32, metavar="N",
                        help="request rows in req_to_token")
    parser.add_argument("--max-context-len", type=positive_count, default=2048, metavar="TOKENS",
                        help="longest prompt + output, in tokens (2048, 8k, 128Ki)")
    parser.add_argument("--schedule-policy", default="fcfs", choices=SCHEDULE_POLICIES,
                        help="waiting-queue order: fcfs (arrival) or lpm (longest cached prefix the request's "
                        "principal can see first; arrival order above 128 waiting)")
    parser.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    parser.add_argument("--strict", action="store_true", help="pools and caches check every call for misuse")
    parser.add_argument("--torch-threads", type=thread_count, default="auto", metavar="N|auto",
                        help="torch's intra-op threads in the engine's process. auto: as torch chooses (one per "
                        "core) for run; for serve on the CPU one fewer than the usable cores, leaving a core "
                        "to the HTTP front")
    add_scoped_options(parser, "monotonic time")
    add_host_options(parser)


def add_host_options(parser: argparse.ArgumentParser) -> None:
    """The hiradix cache's options; None where not given, so that a reader can refuse them
    without --cache hiradix (runner.host_cache_options)."""
    group = parser.add_argument_group("host tier (--cache hiradix only)")
    group.add_argument("--write-policy", choices=WRITE_POLICIES,
                       help="when a node is copied to the host: write_through at its first insert, "
                       "write_through_selective at its second, write_back on device eviction (default: write_through)")
    group.add_argument("--host-ratio", type=finite_float(0), metavar="RATIO",
                       help="host pool size as a multiple of the device pool (default: 2.0)")
    group.add_argument("--host-tokens", type=positive_count, metavar="TOKENS",
                       help="host pool size in tokens (overrides --host-ratio)")


def add_scoped_options(parser: argparse.ArgumentParser, clock: str) -> None:
    """The scoped-radix cache's options (run, serve, replay); None where not given, so that a
    reader can refuse them without --cache scoped-radix (runner.scoped_options)."""
    group = parser.add_argument_group("tenant isolation (--cache scoped-radix only)")
    group.add_argument("--promote-k", type=promote_threshold, metavar="K|inf",
                       help="a private node turns public once K distinct principals computed it within the "
                       "window (two epochs); inf never promotes: per-principal isolation (default: 3)")
    group.add_argument("--epoch-s", type=finite_float(0), metavar="SECONDS",
                       help=f"length of one epoch of the promotion window, in {clock} (default: 60)")
    group.add_argument("--pinned", type=pinned_file, metavar="FILE",
                       help='operator-declared public prefixes (system prompts), JSONL: per line a list of token '
                       'ids, {"prompt": [ids]} or {"text": "..."} (byte tokenizer)')
    group.add_argument("--dedup", type=on_off, metavar="on|off",
                       help="on: a principal's recomputed copy of a node it cannot see shares that node's KV "
                       "(saves memory, may leak through capacity); off: it keeps a private copy (default: off)")
    group.add_argument("--merge-chains", action="store_true", default=None,
                       help="merge private unary chains into one node (an optimization)")


def add_run_parser(verbs: SubParsers) -> None:
    run = verbs.add_parser(
        "run",
        help="run a workload or a trace through the engine and record a capture",
        description="Run requests through the instrumented engine (a tiny seeded transformer on real KV pools) "
        "and record every memory event into a capture. Exit code 1 when an idle leak check failed.",
        formatter_class=DEFAULTS,
    )
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload")
    source.add_argument("--trace", metavar="FILE", help="a JSONL trace: one {id, user, prompt, output} per line")
    run.add_argument("--num-requests", type=positive_count, default=64, help="requests to generate (with --workload)")
    run.add_argument("--seed", type=int, default=0, help="workload seed")
    add_engine_options(run)
    run.add_argument("--level", default="full", choices=["off", "summary", "full"],
                     help="summary: usage, requests, leak checks, tree snapshots; full: plus every memory event")
    run.add_argument("--capture", metavar="PATH", help="capture file (default runs/<time>-<workload>.db)")
    add_old_spelling(run, run.add_argument("--rate", dest="pace", type=finite_float(0), metavar="R",
                                           help="requests per second, arriving in real time; without it all "
                                           "requests arrive at once"))
    run.add_argument("--leak-check", default="record", choices=["record", "raise"],
                     help="on a failed idle leak check: record it and go on, or stop the run")
    run.add_argument("--debug", action="store_true",
                     help="keep the slot ledger live, poison freed KV with NaN and check every read "
                     "(a use-after-free is caught at the read)")
    run.add_argument("--inject", action="append", default=[], metavar="KIND[:RATE]",
                     help="inject a fault into each request with probability RATE (default 1): leak-tail, lock-leak, "
                     "double-free, use-after-free, swa-window-leak; host-leak (--cache hiradix) into each host "
                     "copy leaving the tree; repeatable")
    run.add_argument("--inject-seed", type=int, default=0, help="seed of the fault injection")
    run.add_argument("--no-report", action="store_true",
                     help="at level full, skip building the leak report when the run closes (it replays every "
                     "event, ~7 µs each; the dashboard then replays on demand)")
    run.set_defaults(func=_run)


def add_serve_parser(verbs: SubParsers) -> None:
    serve = verbs.add_parser(
        "serve",
        help="serve the engine over HTTP: OpenAI's completions and chat, /metrics, KV events",
        description="An OpenAI-compatible server on the engine (docs/serve.md): the HTTP front tokenizes and "
        "streams, a scheduler process runs the engine and records the capture. Prints 'ready on URL' when it "
        "serves; SIGINT or SIGTERM finish the requests in flight, close the capture and exit 0.",
        formatter_class=DEFAULTS,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port_number, default=30000, help="port to listen on (0: any free port)")
    add_engine_options(serve)
    serve.add_argument("--capture", metavar="PATH", help="capture file (default runs/<time>-serve.db)")
    serve.add_argument("--level", default="full", choices=["off", "summary", "full"],
                       help="off: no capture; summary: usage, requests, leak checks, tree snapshots; full: plus "
                       "every memory event")
    serve.add_argument("--api-keys", metavar="FILE",
                       help='JSON {key: {"tenant": T, "user": U}}: requests need "Authorization: Bearer KEY"')
    serve.add_argument("--kv-events-config", metavar="JSON",
                       help='SGLang\'s KV-event publisher config, e.g. \'{"publisher": "zmq", "endpoint": '
                       '"tcp://*:5557"}\'')
    serve.set_defaults(func=_serve)


def add_debugger_parsers(verbs: SubParsers) -> None:
    report = verbs.add_parser("report", help="explain a capture or a server log (report leaks CAPTURE, report "
                              "engine-log FILE)", formatter_class=DEFAULTS,
                              description="Reports over a capture, or over an SGLang server's log.")
    topics = report.add_subparsers(dest="topic", required=True, metavar="TOPIC")
    leaks = topics.add_parser(
        "leaks", formatter_class=DEFAULTS, help="name the culprits of every leak",
        description="For each leak: the pool, the slots, the request that last owned them and its principal, the "
        "step and event that allocated them, the free that never came, the first failing leak check and the onset "
        "step; then the verdict `kvscope check` gives. A capture recorded below level full has no slot indices: the "
        "report says what it can and cannot show, and works from the leak checks and the requests table.")
    leaks.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    leaks.add_argument("--run", type=int, help="run id (default: the latest run)")
    leaks.add_argument("--json", action="store_true", help="print the report and its verdict as JSON")
    leaks.set_defaults(func=report_verb)
    engine_log = topics.add_parser(
        "engine-log", formatter_class=DEFAULTS, help="explain the leak messages in an SGLang server log",
        description="Find SGLang's leak-check messages (every release's text: 0.1 to 0.5.23, idle and busy "
        "checks, SWA and mamba pools, the request pool, use-after-free) in a server log, and explain each in the "
        "words of `report leaks`: per pool, the invariant's terms and how many tokens are missing or counted "
        "twice, the line and time, the release family, and what the message cannot tell (no culprit) with the "
        "kvscope command that would. Exit 0 once the log is read, leak messages or not (the JSON's verdict says "
        "which), 2 when the file cannot be read as a text log. See docs/cli.md.")
    engine_log.add_argument("log", metavar="FILE", help="the server's log (any size; read line by line)")
    engine_log.add_argument("--json", action="store_true", help="print the messages as JSON (the exit code is "
                            "the same)")
    engine_log.set_defaults(func=engine_log_verb)
    check = verbs.add_parser(
        "check", formatter_class=DEFAULTS,
        help="CI gate: exit 0 clean, 1 leak, 2 unreadable, 3 inconclusive",
        description="Print one line and exit with the verdict: 0 clean (the run finished and passed at least one "
        "idle leak check, with nothing failing); 1 a leak or a broken invariant; 2 the capture cannot be read (or "
        "bad input); 3 inconclusive: the run was interrupted, crashed, is incomplete (recording stopped), is still "
        "running or ended without closing, or never reached an idle leak check. See docs/cli.md.")
    check.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    check.add_argument("--run", type=int, help="run id (default: the latest run)")
    check.add_argument("--json", action="store_true", help="print the verdict as JSON (the exit code is the same)")
    check.set_defaults(func=check_verb)
    diff = verbs.add_parser("diff", formatter_class=DEFAULTS, help="two runs side by side",
                            description="The verdicts, usage peaks, hit rates, evictions, retractions, the last "
                            "leak-check terms (held and missing included), event counts per kind and the settings "
                            "that differ between the two runs' configs. A and B may be the same capture, with --run "
                            "given twice.")
    diff.add_argument("a", help="first capture")
    diff.add_argument("b", help="second capture")
    diff.add_argument("--run", type=int, action="append", metavar="ID",
                      help="run id of both captures; given twice, of A then B (default: each capture's latest run)")
    diff.add_argument("--json", action="store_true", help="print both sides, the deltas and the verdicts as JSON")
    diff.set_defaults(func=diff_verb)
    upgrade = verbs.add_parser(
        "upgrade", formatter_class=DEFAULTS, help="pack an older capture's events (schema 6)",
        description="Pack the event rows of every run recorded before schema version 6 into chunks of columns, in "
        "place, one transaction per run (a kill leaves each run whole, as rows or as chunks). Readers read both "
        "layouts, so this is never needed to open a file: it makes an older capture as fast to read as a new one. "
        "A run still being recorded is refused. Exit 0 done, 2 the capture cannot be upgraded. See docs/captures.md.")
    upgrade.add_argument("capture", help="a capture file or a SQLAlchemy URL")
    upgrade.add_argument("--json", action="store_true", help="print what was packed as JSON")
    upgrade.set_defaults(func=upgrade_verb)


def add_plan_parser(verbs: SubParsers) -> None:
    plan = verbs.add_parser(
        "plan",
        help="KV bytes per token and how many tokens / requests fit, for a model on a GPU",
        description="KV-cache capacity of a model on a GPU: bytes per token, SGLang's max_total_num_tokens and "
        "pages, vLLM's GPU blocks, and how many requests of a context length fit at once. GPU memory comes "
        "from NVML for the visible GPUs (the smallest of the first --tp ones), or from --gpu-mem.",
        formatter_class=DEFAULTS,
    )
    plan.add_argument("--model", required=True, metavar="NAME|CONFIG",
                      help=f"a preset ({', '.join(PRESETS)}), its Hugging Face id (meta-llama/Llama-3.1-8B-Instruct), "
                      "or a Hugging Face config.json file")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, metavar="DTYPE",
                      help=f"KV cache dtype ({', '.join(KV_DTYPES)}); auto = the model's dtype")
    plan.add_argument("--gpu-mem", type=byte_size, metavar="SIZE",
                      help="memory per GPU (SGLang: free at start; vLLM: total): 80 (GiB), 80G, 80GiB, 81920MiB, "
                      "or 85.9GB for decimal bytes; default: NVML")
    plan.add_argument("--weights-gib", type=byte_size, metavar="SIZE",
                      help="the whole model's weights (all TP ranks), a size like --gpu-mem's (16, 16GiB, "
                      "16GB); default: the preset's")
    plan.add_argument("--page-size", type=int, default=1, help="SGLang tokens per page")
    plan.add_argument("--mem-fraction-static", type=float, default=DEFAULT_MEM_FRACTION_STATIC,
                      help="SGLang: share of the memory free at start for weights + KV")
    plan.add_argument("--swa-full-tokens-ratio", type=float, default=0.8,
                      help="SGLang hybrid SWA: SWA pool tokens per full pool token")
    plan.add_argument("--context-len", type=positive_count, default=8192, metavar="TOKENS",
                      help="tokens per request (prompt + output): 8192, 8k, 128Ki")
    plan.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                      help="vLLM: share of the GPU's total memory for the instance")
    plan.add_argument("--block-size", type=int, default=16, help="vLLM tokens per block")
    plan.add_argument("--vllm-activation-gib", type=byte_size, default=0, metavar="SIZE",
                      help="vLLM: activation peak of its profile run, subtracted from its KV memory (2, 2GiB, "
                      "512MiB)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=plan_verb)


def add_replay_parser(verbs: SubParsers) -> None:
    replay = verbs.add_parser(
        "replay",
        help="hit rate vs cache capacity for a trace or a capture: replays and the one-pass curve",
        description="Replay a request stream through the radix cache alone (no model) at each capacity, in "
        "parallel processes, and print the hit rate, evicted tokens and peak usage per capacity beside the "
        f"one-pass stack-distance curve ({EXACTNESS}). A capture is replayed by regenerating its run's "
        "request stream from the run's recorded workload config.",
        formatter_class=DEFAULTS,
    )
    replay.add_argument("source", help="a JSONL trace, or a capture (SQLite file or SQLAlchemy URL)")
    replay.add_argument("--capacities", type=token_counts, metavar="LIST",
                        help="comma-separated capacities in tokens (200000, 200k, 1.5M, 128Ki), floored to pages; "
                        "default: 12 log-spaced from 1%% to 100%% of the working set, none below the longest "
                        "request under the slots convention")
    replay.add_argument("--page-size", type=int,
                        help="tokens per KV page (a power of two); default: a capture's own, else 1")
    add_old_spelling(replay, replay.add_argument(
        "--eviction-granularity", dest="eviction", default="page", choices=["page", "leaf"],
        help="page: only the pages needed, the curve's model; leaf: SGLang's whole leaves"))
    replay.add_argument("--convention", default="slots", choices=["slots", "tree"],
                        help="slots: the pool holds CAPACITY slots shared with the request in flight "
                        "(bench_radix); tree: the tree holds CAPACITY tokens between requests (the curve's)")
    add_old_spelling(replay, replay.add_argument("--eviction-policy", dest="policy", default="lru",
                                                 help=f"{POLICY_HELP} (the one-pass curve is lru's)"))
    replay.add_argument("--cache", default="radix", choices=["radix", "scoped-radix"],
                        help="radix: global sharing; scoped-radix: each request's user is its principal, replayed "
                        "beside global sharing, with the isolated one-pass curve (keys per principal) beside "
                        "the global one")
    add_scoped_options(replay, "trace time (a request's arrival_s; a trace without arrival times: its index x 1 s)")
    replay.add_argument("--workers", type=int, help="worker processes (default: one per capacity, at most the CPUs)")
    replay.add_argument("--run", type=int, help="the run of a capture to replay (default: the latest)")
    replay.add_argument("--run-id", type=int, dest="run", help=argparse.SUPPRESS)  # NOTE: the old name
    replay.add_argument("--curve-only", action="store_true", help="only the one-pass curve, no replays")
    replay.add_argument("--json", action="store_true", help="print the results as JSON")
    replay.set_defaults(func=replay_verb)


def _load(args: argparse.Namespace) -> int:
    from kvscope.app.load import load_verb

    return load_verb(args)


def add_load_parser(verbs: SubParsers) -> None:
    load = verbs.add_parser(
        "load",
        help="drive an OpenAI-compatible server (kvscope serve) with a workload or trace",
        description="Replay a workload or trace against a server's streamed /v1/completions with the official "
        "openai client: prompts as token ids, each request's user in `user`, a session's next turn sent after "
        "the previous one finished. Prints throughput and TTFT, inter-token and end-to-end latency percentiles. "
        "Exit 1 when any request failed, 2 when no server answers.",
        formatter_class=DEFAULTS,
    )
    load.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000 (or its /v1 base URL)")
    source = load.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload")
    source.add_argument("--trace", metavar="FILE", help="a JSONL trace: one {id, user, prompt, output} per line")
    load.add_argument("--num-requests", type=positive_count, metavar="N",
                      help="requests to send (default: 100 of a workload, all of a trace; with --duration-s, per "
                      "round of the repeated workload)")
    load.add_argument("--seed", type=int, default=0, help="workload seed (round r of --duration-s uses seed + r)")
    load.add_argument("--vocab-size", type=positive_count, default=512, help="token ids of a workload lie below this")
    load.add_argument("--rate", type=finite_float(0), metavar="R",
                      help="requests per second (default: as fast as --concurrency allows)")
    load.add_argument("--arrivals", default="poisson", choices=["poisson", "even"], help="arrival process with --rate")
    add_old_spelling(load, load.add_argument("--duration-s", dest="duration", type=finite_float(0), metavar="S",
                                             help="stop sending after S seconds; the workload repeats until then"))
    load.add_argument("--concurrency", type=positive_count, default=8, metavar="C", help="requests in flight at most")
    load.add_argument("--api-keys", metavar="FILE",
                      help="the server's key file; user groups (the id up to its first '-': t1-u2 -> t1) take the keys "
                      "round-robin in order of first appearance; `user` stays the workload's user")
    load.add_argument("--max-tokens", type=positive_count, metavar="N",
                      help="output tokens per request (default: each request's output length)")
    add_old_spelling(load, load.add_argument("--timeout-s", dest="timeout", type=finite_float(0), default=600.0,
                                             metavar="S", help="HTTP timeout of each request"))
    load.add_argument("--quiet", action="store_true", help="no progress on stderr")
    load.add_argument("--json", action="store_true", help="print the summary as JSON (shape: kvscope/app/load.py)")
    load.set_defaults(func=_load)


def _attach(args: argparse.Namespace) -> int:
    from kvscope.app.attach import attach_verb

    return attach_verb(args)


def add_attach_parser(verbs: SubParsers) -> None:
    attach = verbs.add_parser(
        "attach",
        help="watch a running SGLang, vLLM or kvscope server and record its KV cache into a capture",
        description="Discover the server at --url (SGLang, vLLM or kvscope serve), subscribe to its KV-event "
        "stream (--kv-events, or the endpoint SGLang and kvscope advertise) and scrape its /metrics every "
        "--scrape-s: the cached pages per tier, evictions and usage go into a capture the dashboard opens "
        "(docs/attach.md). Ends at --duration-s or on SIGINT/SIGTERM/SIGHUP (exit 0, capture closed 'finished'); "
        "exit 1 when the server stopped answering or attach itself failed (capture 'crashed'), 2 on bad input "
        "(an unreachable URL, a bad endpoint, a capture older than schema 5).",
        formatter_class=DEFAULTS,
    )
    attach.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    attach.add_argument("--kv-events", metavar="ENDPOINT",
                        help="the KV-event PUB endpoint, e.g. tcp://127.0.0.1:5557 or ipc:///tmp/kv.sock "
                        "(default: what the server advertises; vLLM advertises none: metrics only)")
    attach.add_argument("--replay", metavar="ENDPOINT",
                        help="the replay endpoint: the history before attaching and gaps are asked of it")
    attach.add_argument("--topic", help="the stream's topic (default: the advertised one, else all)")
    attach.add_argument("--bind", action="store_true",
                        help="bind the SUB socket at --kv-events (for publishers that connect)")
    attach.add_argument("--engine", default="auto", choices=["auto", "sglang", "vllm", "kvscope"],
                        help="what runs behind --url; auto asks it")
    attach.add_argument("--capture", metavar="PATH",
                        help="capture file, new or made by kvscope schema 5 or newer "
                        "(default runs/<time>-attach-<engine>.db)")
    attach.add_argument("--scrape-s", type=finite_float(0), default=2.0, metavar="S",
                        help="seconds between scrapes of /metrics (one step of the capture)")
    attach.add_argument("--duration-s", type=finite_float(0), metavar="S", help="stop after S seconds "
                        "(default: until SIGINT or SIGTERM)")
    attach.add_argument("--timeout-s", type=finite_float(0), default=5.0, metavar="S",
                        help="HTTP timeout of discovery and each scrape")
    attach.add_argument("--json", action="store_true", help="print the summary at the end as JSON")
    attach.set_defaults(func=_attach)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvscope",
        description="Observability dashboard and memory debugger for SGLang-style KV-cache memory.",
        formatter_class=DEFAULTS,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    add_demo_parser(verbs)
    add_runs_parser(verbs)
    add_run_parser(verbs)
    add_serve_parser(verbs)
    add_debugger_parsers(verbs)
    add_plan_parser(verbs)
    add_replay_parser(verbs)
    add_load_parser(verbs)
    add_attach_parser(verbs)
    add_instrument_parser(verbs, DEFAULTS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError, CaptureError) as err:
        print(f"kvscope {args.verb}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C; SIGTERM and SIGHUP too, through kvscope.__main__
        print(f"kvscope {args.verb}: interrupted", file=sys.stderr)
        return 128 + getattr(stop, "signum", signal.SIGINT)
    return code
