"""The socket `kvscope serve` listens on: connections accepted from it stream without Nagle's
delay (a streamed event written after the headers used to wait ~40 ms for the client's
delayed ACK on every reused keep-alive connection)."""

from __future__ import annotations

import asyncio
import socket

from kvscope.app.serve import bind_listener


def test_connections_accepted_from_the_listener_have_nagle_off() -> None:
    async def accept_one() -> int:
        listener = bind_listener("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connection(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=listener)
        async with server:
            _reader, writer = await asyncio.open_connection(*listener.getsockname())
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accept_one()) != 0
