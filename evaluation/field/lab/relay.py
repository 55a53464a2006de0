"""A TCP relay that adds a link's latency, in user space (this kernel has no ``netem``).

``python -m evaluation.field.lab.relay LISTEN_PORT HOST:PORT LATENCY_MS`` listens on the
loopback of the namespace it runs in and relays each connection to ``HOST:PORT``, holding every
chunk ``LATENCY_MS`` before passing it on, each way. The bandwidth is the qdiscs' business
(``evaluation.field.lab.shaping``); at most ``WINDOW`` bytes wait in the relay per direction, so
a sender faster than the link is held back by TCP, as on a real path. Measured here: the relay
adds about 2 ms of round trip of its own and carries 91-97 Mbit/s on a 100 Mbit/s link.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

CHUNK = 65536
WINDOW = 64  # chunks in flight per direction
PATIENCE = 120.0  # seconds a new connection waits for a link that is down (Linux's connect gives up after ~127)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue(WINDOW)

    async def read() -> None:
        while data := await reader.read(CHUNK):
            await queue.put((time.monotonic() + delay, data))
        await queue.put((time.monotonic() + delay, b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(read(), write())


async def _upstream(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """A connection to ``host:port``, tried again while the link is down (as the kernel resends a
    connection's first packet), for up to ``PATIENCE`` seconds; ``None`` if it never came."""
    until = time.monotonic() + PATIENCE
    while True:
        try:
            return await asyncio.open_connection(host, port)
        except OSError:
            if time.monotonic() > until:
                return None
            await asyncio.sleep(0.25)


async def _serve(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, host: str, port: int,
                 delay: float) -> None:
    # the client's connection is already accepted: a refused upstream would look to it like a
    # broken TLS handshake (which Flower's SuperNode takes as fatal), not like a dead link
    upstream = await _upstream(host, port)
    if upstream is None:
        client_writer.close()
        return
    server_reader, server_writer = upstream
    try:
        await asyncio.gather(_pump(client_reader, server_writer, delay), _pump(server_reader, client_writer, delay))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        for writer in (client_writer, server_writer):
            writer.close()


async def relay(listen_port: int, host: str, port: int, latency_ms: float) -> None:
    delay = latency_ms / 1e3
    server = await asyncio.start_server(lambda r, w: _serve(r, w, host, port, delay), "127.0.0.1", listen_port)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m evaluation.field.lab.relay LISTEN_PORT HOST:PORT LATENCY_MS", file=sys.stderr)
        return 2
    host, _, port = argv[1].rpartition(":")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(relay(int(argv[0]), host, int(port), float(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
