"""The channel between a recorder and its writer process: one Unix stream socket pair carrying
framed messages both ways. A message is a small header (a marshal tuple) and an optional body
(bytes); a large body travels in an anonymous in-memory file whose descriptor rides with the
frame (SCM_RIGHTS), so neither side copies it through the socket and the sender never waits
for the reader to drain it.

NOTE: a frame
    8 bytes     header length, body length (unsigned 32-bit, little-endian; body length
                BODY_IN_FILE: the body is in the file passed with the frame)
    header      marshal of a tuple of plain values
    body        inline when shorter than INLINE_MAX_BYTES
A descriptor passed with a frame arrives with the frame's first bytes: the reader asks for
ancillary data only when it reads a frame's length prefix. The file is unlinked from birth
(memfd, or an unlinked temporary file), so it is freed when both ends close it, whoever dies.

Stdlib only: the writer process imports this before anything else.
"""

from __future__ import annotations

import marshal
import mmap
import os
import select
import socket
import struct
import tempfile
import time
from typing import Any

INLINE_MAX_BYTES = 64 << 10
BODY_IN_FILE = 0xFFFFFFFF
_PREFIX = struct.Struct("<II")
_RECV_BYTES = 256 << 10
_MAX_FDS = 8


class ChannelClosed(Exception):
    """The other end closed the channel (its process ended)."""


class Message:
    """A received frame: `header` (a tuple) and `body` (bytes or a read-only mmap, or None)."""

    __slots__ = ("body", "header")

    def __init__(self, header: tuple[Any, ...], body: Any) -> None:
        self.header = header
        self.body = body

    @property
    def kind(self) -> str:
        return str(self.header[0])

    def release(self) -> None:
        if isinstance(self.body, mmap.mmap):
            self.body.close()
        self.body = None


class Channel:
    """One end of the channel. `send` blocks only while the socket buffer is full (headers
    are small and large bodies go by file, so rarely), for at most `send_timeout_s` (None:
    for as long as it takes): an end that takes nothing that long is treated as gone;
    `receive` waits for one message, `poll` returns the messages already there."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._fds: list[int] = []
        self._want: tuple[int, int] | None = None  # (header length, body length) of the frame being read
        self._fd: int | None = None  # the body file of the frame being read
        self._closed = False
        self.send_timeout_s: float | None = None

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """A channel for this process and the socket to hand to the child (inheritable)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        return cls(ours), theirs

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=fd))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            self.sock.close()

    # -- sending -------------------------------------------------------------------------------

    def send(self, header: tuple[Any, ...], body: bytes | None = None) -> None:
        """Raises ChannelClosed when the other end is gone, or took nothing for `send_timeout_s`
        (the frame may then be cut: the channel is of no further use)."""
        head = marshal.dumps(header)
        if self.send_timeout_s is not None:
            self.sock.settimeout(self.send_timeout_s)
        try:
            if body is None or len(body) < INLINE_MAX_BYTES:
                inline = b"" if body is None else body
                self.sock.sendall(_PREFIX.pack(len(head), len(inline)) + head + inline)
                return
            fd = _body_file(body)
            try:
                prefix = _PREFIX.pack(len(head), BODY_IN_FILE)
                sent = socket.send_fds(self.sock, [prefix + head], [fd])
                if sent < len(prefix) + len(head):
                    self.sock.sendall((prefix + head)[sent:])
            finally:
                os.close(fd)
        except (BrokenPipeError, ConnectionResetError) as err:
            raise ChannelClosed(str(err)) from err
        except TimeoutError as err:
            raise ChannelClosed(f"the other end took nothing for {self.send_timeout_s:g} s") from err
        finally:
            if self.send_timeout_s is not None:
                self.sock.settimeout(None)

    # -- receiving -----------------------------------------------------------------------------

    def receive(self, timeout_s: float | None = None) -> Message | None:
        """The next message; None when `timeout_s` passes first. Raises ChannelClosed at the end."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            message = self._next_message()
            if message is not None:
                return message
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], wait_s)
            if not ready:
                return None
            self._read_some()

    def poll(self) -> list[Message]:
        """The messages that have arrived, without waiting. Raises ChannelClosed at the end
        (after the messages that came before it were returned by earlier calls)."""
        found = []
        while True:
            message = self._next_message()
            if message is not None:
                found.append(message)
                continue
            ready, _, _ = select.select([self.sock], [], [], 0)
            if not ready:
                return found
            if found:
                try:
                    self._read_some()
                except ChannelClosed:
                    return found  # NOTE: the end is reported by the next call
            else:
                self._read_some()

    def _read_some(self) -> None:
        # NOTE: always with room for descriptors: a plain recv that runs into a frame sent with
        # one closes it (Linux hands descriptors only to a read with ancillary space; it stops
        # a read after the segment that carried some, so they arrive in frame order)
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, _RECV_BYTES, _MAX_FDS)
        except ConnectionResetError as err:  # NOTE: the other end died with our data unread
            raise ChannelClosed(str(err)) from err
        self._fds.extend(fds)
        if not data:
            raise ChannelClosed("the other end closed the channel")
        self._buffer += data

    def _next_message(self) -> Message | None:
        buffer = self._buffer
        if self._want is None:
            if len(buffer) < _PREFIX.size:
                return None
            self._want = _PREFIX.unpack_from(buffer)
            del buffer[: _PREFIX.size]
            if self._want[1] == BODY_IN_FILE:
                self._fd = self._fds.pop(0) if self._fds else None
        head_len, body_len = self._want
        inline_len = 0 if body_len == BODY_IN_FILE else body_len
        if len(buffer) < head_len + inline_len:
            return None
        header = marshal.loads(bytes(buffer[:head_len]))
        body: Any = None
        if body_len == BODY_IN_FILE:
            fd, self._fd = self._fd, None
            if fd is None:
                raise ChannelClosed("a frame's body file did not arrive")
            body = _read_body_file(fd)
        elif body_len:
            body = bytes(buffer[head_len : head_len + body_len])
        del buffer[: head_len + inline_len]
        self._want = None
        return Message(header, body)


def _body_file(body: bytes) -> int:
    """An unlinked in-memory file holding `body`, at offset 0."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvscope-batch", os.MFD_CLOEXEC)
    else:  # NOTE: not Linux: an unlinked temporary file
        with tempfile.TemporaryFile() as handle:
            fd = os.dup(handle.fileno())
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_body_file(fd: int) -> Any:
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
    finally:
        os.close(fd)
