"""A lean HTTP/1.1 and WebSocket ASGI server on Trio: ``serve --loop trio``'s server.

Why it exists: per streamed chunk, the Trio server it replaced took a send
lock, passed its own event layers and checkpointed in ``send_all``
(docs/performance.md measures it); here a chunk is framed by hand and
written straight to the non-blocking socket, with no checkpoint when the
kernel takes the bytes (a wait for room only when it does not:
back-pressure).  h11 still parses requests, wsproto
speaks WebSocket.  :mod:`.protocol` is the sans-I/O core, :mod:`.transport`
the socket, :mod:`.connection` one connection's request cycles,
:mod:`.websocket` the sessions, :mod:`.server` the accept loop and drain.
"""

from trio_orch.serve.trio_http.config import ServerState
from trio_orch.serve.trio_http.server import serve

__all__ = ["ServerState", "serve"]
