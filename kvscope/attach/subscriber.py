"""A live subscriber on an engine's KV-event stream: frames in seq order, gaps filled from replay.

    subscriber = EventSubscriber("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    subscriber.catch_up()                  # the history the publisher still buffers, from seq 0
    while watching:
        for frame in subscriber.poll(100):  # seq order, each seq once
            forest.apply(frame.batch)
    subscriber.close()

NOTE: how each arriving seq `s` is handled (`next_seq`: the next one to deliver, None before the first):
    next_seq is None            s is delivered: the stream starts here (call catch_up first for the history)
    s == next_seq               delivered
    s > next_seq                a gap: [next_seq, s) is asked of the replay socket and delivered from it
                                (the replay's later batches too); what it no longer holds, or all of
                                the gap without a replay endpoint, is lost (`lost_batches`, `gaps`)
    s < next_seq                a restart when the live stream went back: s == 0 or s below the last
                                live seq (one publisher's live seqs only grow); else a duplicate (a batch
                                the replay already delivered) and dropped
A restart (`restarts` += 1) resets the state to a fresh publisher's: next_seq = 0, so the batches
it sent before this one are asked of the replay. SGLang's and kvscope's streams begin with
AllBlocksCleared, which then resets a forest; vLLM's do not, so a caller watching vLLM clears its
forest when `restarts` grows. A restart whose first seen seq is already past the old publisher's
last one looks like a gap: no seq rule can tell them apart.
A malformed message (a WireError) is counted in `bad_messages`, `last_error` keeps its text, and the
loop goes on; its seq, if it was one, shows up as a gap later. So is a batch whose seq jumps further
ahead than a publisher can send in the time since the last batch heard (MAX_BATCHES_PER_S, with one
second's slack): a forged or corrupted seq (2**63, say) is not counted as that many lost batches.
A replay socket that does not answer within `replay_timeout_ms` is dropped and made anew (late
answers to the old one are discarded); what it did not deliver is lost.
Reconnects are ZMQ's: both sockets retry every RECONNECT_IVL_MS, backing off to RECONNECT_IVL_MAX_MS,
so a publisher that stops and binds its endpoint again is picked up. `bind=True` binds the SUB
socket, for publishers that connect (SGLang <= 0.5.21 with a concrete tcp host); `endpoint` then
names the bound address (a wildcard port resolved). One subscriber per publisher (DP ranks publish
on endpoints of their own), used from one thread.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from kvscope.attach.wire import Frame, WireError, decode_frames, decode_replay

RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2000
RCVHWM = 100_000  # NOTE: the publishers' default send high-water mark
MAX_DRAIN = 10_000  # messages taken per poll, so one poll returns in bounded time
# NOTE: far above any engine's rate (SGLang and vLLM publish at most one batch per scheduler step)
MAX_BATCHES_PER_S = 100_000


class EventSubscriber:
    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
        context: zmq.Context[Any] | None = None,
        replay_timeout_ms: int = 2000,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_ms = replay_timeout_ms
        self._own_context = context is None
        self.context: zmq.Context[Any] = context if context is not None else zmq.Context()
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self.sub.bind(endpoint)
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)  # NOTE: a wildcard port resolved
        else:
            self.sub.connect(endpoint)
        self._dealer: zmq.Socket[Any] | None = None
        self.next_seq: int | None = None
        self.last_live_seq: int | None = None
        self.first_seq: int | None = None  # the first seq delivered: 0 means the whole history was seen
        # NOTE: counters since the start
        self.delivered = 0
        self.replayed = 0  # delivered from the replay socket (catch-up and gap fills)
        self.lost_batches = 0
        self.gaps: list[tuple[int, int]] = []  # (from_seq, to_seq) lost, both inclusive
        self.duplicates = 0
        self.restarts = 0
        self.bad_messages = 0
        self.last_error: str | None = None  # the last WireError's text
        self.replay_timeouts = 0
        self._ready: list[Frame] = []
        self._heard_s = time.monotonic()  # NOTE: when the last batch was delivered (or the subscriber made)

    # -- the public calls --------------------------------------------------------------------------

    def catch_up(self) -> int:
        """Ask the replay socket for every batch from seq 0 (a late joiner's history, as much as the
        publisher still buffers); the next poll returns them first. How many batches it got
        (0 without a replay endpoint)."""
        if self.replay_endpoint is None:
            return 0
        got = self._replay(0 if self.next_seq is None else self.next_seq)
        before = self.replayed
        for frame in got:
            if self.next_seq is None:
                self.next_seq = frame.seq
            if frame.seq >= self.next_seq and not self._implausible(frame.seq):
                self._fill_to(frame.seq)  # NOTE: a hole inside the replay itself is lost
                self._deliver(frame, replayed=True)
        return self.replayed - before

    def poll(self, timeout_ms: int) -> list[Frame]:
        """The frames ready in seq order: waits up to `timeout_ms` for the first message when none
        is ready, then takes what has arrived without waiting."""
        if not self._ready and not self.sub.poll(timeout_ms):
            return []
        for _ in range(MAX_DRAIN):
            try:
                message = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_message(message)
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> None:
        self.sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        if self._own_context:
            self.context.term()

    # -- sequence handling -------------------------------------------------------------------------

    def _on_message(self, message: list[bytes]) -> None:
        try:
            frame = decode_frames(message)
        except WireError as err:
            self._bad(err)
            return
        seq = frame.seq
        if self.next_seq is not None and seq < self.next_seq:
            if not self._went_back(seq):
                self.duplicates += 1
                return
            self.restarts += 1
            self.next_seq, self.last_live_seq = 0, None
        if self._implausible(seq):
            return
        self.last_live_seq = seq
        if self.next_seq is not None and seq > self.next_seq:
            self._fill_gap(seq)
            if seq < self.next_seq:  # the replay delivered it
                return
        self._deliver(frame, replayed=False)

    def _implausible(self, seq: int) -> bool:
        """A seq further ahead of next_seq than a publisher can have sent since the last batch is
        counted as a bad message (True: skip it)."""
        if self.next_seq is None or seq <= self.next_seq:
            return False
        jump = seq - self.next_seq
        if jump <= MAX_BATCHES_PER_S * (time.monotonic() - self._heard_s + 1.0):
            return False
        self._bad(
            WireError(
                f"seq {seq} is {jump:,} batches past the next one due ({self.next_seq}), more than a "
                "publisher sends in the time since the last batch: skipped"
            )
        )
        return True

    def _went_back(self, seq: int) -> bool:
        last = self.last_live_seq
        return last is not None and (seq == 0 or seq < last)

    def _fill_gap(self, upto: int) -> None:
        """Deliver [next_seq, upto) (and any later batches) from the replay; the rest is lost."""
        assert self.next_seq is not None
        if self.replay_endpoint is not None:
            for frame in self._replay(self.next_seq):
                if frame.seq >= self.next_seq and not self._implausible(frame.seq):
                    self._fill_to(frame.seq)
                    self._deliver(frame, replayed=True)
        self._fill_to(upto)

    def _fill_to(self, seq: int) -> None:
        """Count [next_seq, seq) lost when the stream has not reached `seq`."""
        assert self.next_seq is not None
        if seq > self.next_seq:
            self.lost_batches += seq - self.next_seq
            self.gaps.append((self.next_seq, seq - 1))
            self.next_seq = seq

    def _deliver(self, frame: Frame, replayed: bool) -> None:
        if self.first_seq is None:
            self.first_seq = frame.seq
        self._ready.append(frame)
        self._heard_s = time.monotonic()
        self.next_seq = frame.seq + 1
        self.delivered += 1
        self.replayed += replayed

    def _bad(self, err: WireError) -> None:
        self.bad_messages += 1
        self.last_error = str(err)

    # -- the replay socket -------------------------------------------------------------------------

    def _replay(self, start_seq: int) -> list[Frame]:
        """Every batch the replay socket holds from `start_seq`, sorted by seq (as many as arrived
        before a timeout)."""
        dealer = self._replay_socket()
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        frames: list[Frame] = []
        while True:
            if not dealer.poll(self.replay_timeout_ms):
                self.replay_timeouts += 1
                dealer.close(linger=0)
                self._dealer = None
                break
            answer = dealer.recv_multipart()
            try:
                frame = decode_replay(answer[1:] if answer and answer[0] == b"" else answer)
            except WireError as err:
                self._bad(err)
                continue
            if frame is None:
                break
            frames.append(frame)
        return sorted(frames, key=lambda f: f.seq)

    def _replay_socket(self) -> zmq.Socket[Any]:
        if self._dealer is None:
            assert self.replay_endpoint is not None
            self._dealer = self._socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)
        return self._dealer

    def _socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        return sock
