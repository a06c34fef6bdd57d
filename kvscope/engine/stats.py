"""What the scheduler counts and reports: request lifecycle events and records, usage
samples per step, leak checks, and the totals the run summary prints.

NOTE: hit rates
    token-weighted    Σ cached tokens at first admission / Σ prompt tokens
    request-weighted  requests with any cached token / requests admitted
A retracted request's re-prefill does not count again (as SGLang's cache_hit_rate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvscope.engine.memory import HostTierTotals, MemorySystem
from kvscope.engine.request import Req
from kvscope.telemetry import EventKind, LeakCheck, Recorder, RequestRecord, RequestStatus, Routing, UsageSample


class LeakDetected(RuntimeError):
    """The idle leak check failed and the engine was told to stop on it."""


class EngineStalled(RuntimeError):
    """Requests wait, none can be admitted and none runs: the run can never finish (a batch run
    stops with this instead of looping forever)."""


@dataclass
class EngineStats:
    recorder: Recorder
    num_requests: int = 0
    num_admitted: int = 0
    num_hit_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_retractions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_hit_tokens: int = 0  # of cached_tokens, loaded back from the host tier at admission
    generated_tokens: int = 0
    evicted_tokens: int = 0
    leak_checks_passed: int = 0
    leak_checks_failed: int = 0
    first_failed_check: list[LeakCheck] = field(default_factory=list)
    host_tier: HostTierTotals | None = None  # hiradix: set when the run ends
    records: dict[str, RequestRecord] = field(default_factory=dict)

    def _event(self, kind: EventKind, req: Req, num_tokens: int = 0, aux: int = 0) -> None:
        if self.recorder.enabled:
            self.recorder.record(kind, rid=req.rid, num_tokens=num_tokens, aux=aux)

    def _mark(self, req: Req, moment: str, step: int) -> None:
        self.records[req.rid].mark(moment, step, time.monotonic())

    def arrived(self, req: Req, step: int) -> None:
        self.num_requests += 1
        self.records[req.rid] = RequestRecord(req.rid, req.user, req.prompt_len)
        self._mark(req, "arrive", step)
        self._event(EventKind.REQUEST_ARRIVE, req, req.prompt_len)

    def routed(self, req: Req, routing: Routing) -> None:
        """How a fleet's router chose this replica for an arrived request (its requests row keeps it)."""
        self.records[req.rid].routing = routing

    def admitted(self, req: Req, step: int, prefix_len: int, host_hit_tokens: int = 0) -> None:
        """`host_hit_tokens`: of prefix_len, the tokens loaded back from the host tier."""
        record = self.records[req.rid]
        if "admit" not in record.times:
            self.num_admitted += 1
            self.prompt_tokens += req.prompt_len
            self.cached_tokens += prefix_len
            self.host_hit_tokens += host_hit_tokens
            self.num_hit_requests += prefix_len > 0
            record.cached_tokens = prefix_len
        self._mark(req, "admit", step)
        self._event(EventKind.REQUEST_ADMIT, req, req.all_len - prefix_len, aux=prefix_len)

    def first_token(self, req: Req, step: int) -> None:
        self._mark(req, "first_token", step)

    def finished(self, req: Req, step: int) -> None:
        self.num_finished += 1
        self.generated_tokens += len(req.output_ids)
        self._close_record(req, RequestStatus.FINISHED, step, "finish")
        self._event(EventKind.REQUEST_FINISH, req, len(req.output_ids))

    def retracted(self, req: Req, step: int) -> None:
        self.num_retractions += 1
        self.records[req.rid].num_retractions += 1
        self._mark(req, "retract", step)
        self._event(EventKind.REQUEST_RETRACT, req, len(req.output_ids))

    def aborted(self, req: Req, step: int, reason: str) -> None:
        self.num_aborted += 1
        self._close_record(req, RequestStatus.ABORTED, step, "finish")
        self._event(EventKind.REQUEST_ABORT, req, len(req.output_ids))

    def _close_record(self, req: Req, status: str, step: int, moment: str) -> None:
        record = self.records[req.rid]
        record.status, record.output_len = status, len(req.output_ids)
        record.mark(moment, step, time.monotonic())
        if self.recorder.summary_enabled:
            self.recorder.request(record)

    def evicted(self, num_tokens: int) -> None:
        self.evicted_tokens += num_tokens

    def leak_checked(self, checks: list[LeakCheck]) -> bool:
        ok = all(c.ok for c in checks)
        if ok:
            self.leak_checks_passed += 1
        else:
            self.leak_checks_failed += 1
            self.first_failed_check = self.first_failed_check or checks
        for check in checks:
            if self.recorder.summary_enabled:
                self.recorder.leak_check(check)
            if self.recorder.enabled:
                self.recorder.record(EventKind.LEAK_CHECK, num_tokens=check.total, aux=int(check.ok))
        return ok

    def sample(self, step: int, memory: MemorySystem, num_running: int, num_waiting: int) -> None:
        if not self.recorder.summary_enabled:
            return
        rows = memory.req_to_token_pool
        written, loaded = memory.copied_tokens()
        self.recorder.usage(
            UsageSample(
                step,
                memory.full_terms(),
                memory.swa_terms(),
                rows.num_rows,
                rows.available_size(),
                num_running,
                num_waiting,
                self.prompt_tokens,
                self.cached_tokens,
                self.num_admitted,
                self.num_hit_requests,
                self.evicted_tokens,
                self.num_retractions,
                memory.host_terms(),
                self.host_hit_tokens,
                written,
                loaded,
            )
        )

    def close_unfinished(self) -> None:
        """At the end of a run, store the records of requests that never finished."""
        self._close_open_records(RequestStatus.UNFINISHED)

    def close_in_flight(self) -> None:
        """When a run is interrupted or crashes: store the records of requests still admitted or
        waiting, marked in_flight (the caller does this before it closes the recorder)."""
        self._close_open_records(RequestStatus.IN_FLIGHT)

    def _close_open_records(self, status: RequestStatus) -> None:
        if not self.recorder.summary_enabled:
            return
        for record in self.records.values():
            if record.status == RequestStatus.RUNNING:
                record.status = status
                self.recorder.request(record)

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.num_hit_requests / self.num_admitted if self.num_admitted else 0.0
