"""Runs SGLang 0.5.23's own scheduler loop (Scheduler.run_event_loop -> dispatch_event_loop ->
event_loop_normal, ingest_requests, handle_shutdown; 0.5.19's, its unpacked wheel first on the path:
recv_requests, then its own process_input_requests; with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY its
SchedulerInvariantChecker.self_check_during_busy) on a stand-in scheduler over the real pools and tree of
sglang_probe_driver.Engine, a loop that is never idle: each iteration's batch is a prefill of a new request
while fewer than two run, else a decode step of those running; a request finishes after OUTPUT_LEN tokens
(released in process_batch_result). SGLang's SchedulerInvariantChecker counts the requests owning rows
from the stand-in's last and running batches, as a server's does (get_next_batch_to_run merges a prefill
batch into the running batch, whose released requests drop out). Run with the SGLang venv's python, the
repository on PYTHONPATH:

    python sglang_loop_driver.py SCENARIO

SCENARIO: busy (the first request to finish at or after iteration FAULT_AT keeps its tail page: leaked),
busy-many (at FAULT_AT a running request's call takes MANY_PAGES pages it never gives back), crash (busy's
fault under SGLang's strict busy check, which raises from the loop), interrupted (a ShutdownReq arrives and
the same iteration's batch fails: what a signal to the process group does to a step in flight). The loop
stops by SGLang's ShutdownReq handler at iteration STOP_AT (busy, busy-many). What SGLang's
run_scheduler_process does with a raise is done here: caught, one line, a normal exit.
Prints one JSON line: the injected fault (its pages and the probe's step then) and how the loop ended.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import tests.engines.sglang_probe_driver as driver  # NOTE: it installs SGLang's stand-ins first
from kvscope.probe import sglang_hooks, sglang_probe

Scheduler, probe = driver.Scheduler, driver.probe

OUTPUT_LEN = 3  # tokens each request decodes before it finishes
FAULT_AT = 12  # the loop iteration the fault is injected at (or after: busy's waits for a request to finish)
STOP_AT = 40  # the iteration the ShutdownReq arrives at
MANY_PAGES = 10
SYSTEM = list(range(100, 112))  # a 12-token prefix every request shares (three pages in the tree)


class Loop:
    """What the stand-in scheduler's loop does on the engine: one batch per iteration, never none."""

    def __init__(self, engine: driver.Engine, scenario: str) -> None:
        self.engine, self.scenario = engine, scenario
        self.iteration = 0
        self.made = 0
        self.injected: dict[str, Any] | None = None

    def next_batch(self, running_batch: Any, last_batch: Any) -> Any:
        """get_next_batch_to_run as SGLang plans it: the last prefill batch merges into the running batch,
        whose released requests drop out; a new prefill batch while fewer than two run (its request joins
        it in run_batch), else the running batch itself decodes. Returns (running batch, batch to run)."""
        reqs = [
            *running_batch.reqs,
            *(last_batch.reqs if last_batch is not None and last_batch.kind == "prefill" else []),
        ]
        running = batch_of("decode", [r for r in reqs if r.rid in self.engine.live])
        if len(running.reqs) < 2:
            self.made += 1
            tail = [200 + self.made * 7 + i for i in range(3)]  # NOTE: 15 tokens: a part-filled tail page
            batch = batch_of("prefill", [])
            batch.rid, batch.tokens = f"req-{self.made:03d}", [*SYSTEM, *tail]
            return running, batch
        return running, running

    def run(self, batch: Any) -> None:
        if self.scenario == "interrupted" and self.iteration == FAULT_AT:
            raise RuntimeError("cancelled")  # NOTE: the step in flight when a signal reached the process group
        if batch.kind == "prefill":
            batch.reqs.append(self.engine.admit(batch.rid, batch.tokens))
            return
        for req in batch.reqs:
            self.engine.decode(req, 1)
        if self.scenario == "busy-many" and self.iteration == FAULT_AT:
            req = batch.reqs[0]
            out = sglang_hooks._in_context(req.rid, "alloc", lambda: self.engine.alloc.alloc(MANY_PAGES * driver.PS))
            pages = sorted({int(s) // driver.PS for s in out.tolist()})
            self.injected = {"kind": "leak", "rid": req.rid, "pages": pages, "step": probe.PROBE.step}

    def finish(self, batch: Any) -> None:
        """process_batch_result: the first request with OUTPUT_LEN tokens or more is released, one per
        iteration, so one always runs across an iteration's end (busy, crash: the first one released at or
        after FAULT_AT keeps its tail page)."""
        if batch.kind != "decode":
            return
        for req in [r for r in batch.reqs if len(r.output_ids) >= OUTPUT_LEN][:1]:
            if self.scenario in ("busy", "crash") and self.iteration >= FAULT_AT and self.injected is None:
                self.leak_tail(req)
            self.engine.release(req)

    def leak_tail(self, req: Any) -> None:
        kv = driver.KV_OF(req)
        aligned = kv.kv_allocated_len // driver.PS * driver.PS
        assert aligned < kv.kv_allocated_len, (req.rid, kv.kv_allocated_len)
        tail = int(self.engine.rows.req_to_token[kv.req_pool_idx, aligned]) // driver.PS
        driver.set_kv_len(req, aligned)
        self.injected = {"kind": "leak-tail", "rid": req.rid, "pages": [tail], "step": probe.PROBE.step}


def batch_of(kind: str, reqs: list[Any]) -> SimpleNamespace:
    """A stand-in ScheduleBatch: its kind, its requests, and what SGLang's checker reads of it."""
    return SimpleNamespace(kind=kind, reqs=reqs, chunked_req=None, is_empty=lambda: not reqs)


def stand_in(engine: driver.Engine, loop: Loop) -> SimpleNamespace:
    """A scheduler with what Scheduler.run_event_loop, event_loop_normal and ingest_requests read; the
    probe's hooked methods are SGLang's own, called on it."""
    nothing = SimpleNamespace(
        start_scheduler_time_accounting=lambda: None,
        record_scheduler_active=lambda *t: None,  # NOTE: 0.5.20, 0.5.21 pass no time
        record_scheduler_idle=lambda: None,
    )
    s = SimpleNamespace(
        device="cpu",
        device_module=driver.torch.cpu,
        schedule_stream=SimpleNamespace(),
        forward_stream=SimpleNamespace(),
        enable_overlap=False,
        enable_pdmux=False,
        enable_overlap_mlx=False,
        enable_unified_memory=False,
        server_args=SimpleNamespace(enable_pd_role_switch=False),
        disaggregation_mode=driver.DisaggregationMode.NULL,
        metrics_reporter=nothing,
        gracefully_exit=False,
        _engine_paused=False,
        _deferred_input_requests=[],
        running_batch=batch_of("decode", []),
        last_batch=None,
        cur_batch_for_debug=None,
        invariant_checker=None,
        ps=SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0),  # NOTE: 0.5.20, 0.5.21's ranks (one)
        tree_cache=engine.tree,
        req_to_token_pool=engine.rows,
    )

    from sglang.srt.managers.io_struct import ShutdownReq

    def receive(local_reqs: list[Any] | None = None) -> list[Any]:
        loop.iteration += 1
        return (
            [ShutdownReq()]
            if loop.iteration == STOP_AT or (loop.scenario == "interrupted" and loop.iteration == FAULT_AT)
            else []
        )

    def process_input_requests(reqs: list[Any]) -> None:
        for req in reqs:
            Scheduler.handle_shutdown(s, req)

    # NOTE: SGLang's checker counts the requests owning rows from the scheduler's last and running batches
    s.invariant_checker = engine.checker = dataclasses.replace(
        engine.checker, get_last_batch=lambda: s.last_batch, get_running_batch=lambda: s.running_batch
    )
    s.request_receiver = SimpleNamespace(recv_requests=receive)
    s.process_input_requests = process_input_requests
    s._poll_timeout_aborts = lambda: []
    ingest = getattr(Scheduler, "ingest_requests", None)  # NOTE: 0.5.20 on
    if ingest is not None and "stop_at_pause" in inspect.signature(ingest).parameters:  # NOTE: 0.5.22 added it
        s.ingest_requests = lambda stop_at_pause=False: Scheduler.ingest_requests(s, stop_at_pause)
    elif ingest is not None:
        s.ingest_requests = lambda: Scheduler.ingest_requests(s)
    if not hasattr(Scheduler, "ingest_requests"):  # NOTE: 0.5.19's loop: recv_requests, then SGLang's own
        s.session_controller = SimpleNamespace(maybe_reap=lambda now: None)  # process_input_requests
        s._request_dispatcher = lambda req: Scheduler.handle_shutdown(s, req)
        s.flush_wrapper = SimpleNamespace(check_pending=lambda: None)
        s.external_corpus_manager = s.rust_server = None
        s.process_input_requests = lambda reqs: Scheduler.process_input_requests(s, reqs)
    s.event_loop_normal = lambda: Scheduler.event_loop_normal(s)
    s.on_idle = lambda: Scheduler.on_idle(s)  # NOTE: never reached: every iteration has a batch
    s.get_next_batch_to_run = lambda running_batch, last_batch: SimpleNamespace(
        **dict(zip(("running_batch", "batch_to_run"), loop.next_batch(running_batch, last_batch), strict=True))
    )
    s.run_batch = lambda batch: loop.run(batch)
    s.process_batch_result = lambda batch, result: loop.finish(batch)
    return s


def main(scenario: str) -> None:
    if scenario == "crash":
        driver.os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] = "1"
    sglang_probe.CENSUS_BUDGET_X = 0  # NOTE: these steps take microseconds: every due census runs (SglangProbe's)
    driver.load_plugins()
    driver.PAGES = 40 if scenario == "busy-many" else 20
    driver.publish_config()
    from sglang.srt.runtime_context import get_parallel

    if hasattr(Scheduler, "ingest_requests"):  # NOTE: one rank (ingest_requests reads them; 0.5.19's loop does not)
        get_parallel().override_permanently(pp_rank=0, pp_size=1, attn_tp_rank=0, attn_cp_rank=0)
    engine = driver.Engine("unified")
    loop = Loop(engine, scenario)
    scheduler = stand_in(engine, loop)
    raised = None
    try:
        Scheduler.run_event_loop(scheduler)
    except Exception as err:  # NOTE: what run_scheduler_process does: log it, return
        raised = f"{type(err).__name__}: {err}".splitlines()[0]
        print(f"Scheduler hit an exception: {raised}", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "said": probe.PROBE.state.reason or ("registered" if probe.PROBE.state.active else "closed"),
                "probe_file": probe.__file__,
                "iterations": loop.iteration,
                "steps": probe.PROBE.step,
                "injected": loop.injected,
                "raised": raised,
                "running": sorted(engine.live),
                "tally": probe.PROBE.tally.snapshot(False, None),  # NOTE: what /metrics exports (sglang_metrics.py)
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "--cases":  # NOTE: --cases OUT_DIR SCENARIO ...: one child per scenario (driver.run_cases)
        driver.run_cases(sys.argv[3:], Path(sys.argv[2]), main)
    else:
        main(sys.argv[1])
