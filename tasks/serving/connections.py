"""A deadline for each request head: slow-loris clients cannot hold the server's sockets.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but only once a response is done, and any
byte that arrives resets it: a client that opens connections and sends a request head one byte at a time (or never
finishes it) keeps every one open for as long as it likes. `HeadDeadline` is uvicorn's h11 protocol with one
timer more: from the moment a connection opens (or its previous response is done) the client has `HEAD_TIMEOUT`
seconds to complete the next request's head (request line and headers); past it the connection is closed (a 408
would go to a client that is not reading). A body is not under it: the body reader (tasks/serving/bodies.py) caps
its size, and nginx's client_header_timeout / Apache's RequestReadTimeout header=... are the same rule.

    uvicorn.Config(app, http=head_deadline_protocol(10.0), ...)
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("msllm.serve")

HEAD_TIMEOUT = 10.0
"""Seconds a client has to send a complete request head (msllm serve --head-timeout)."""


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete `head_timeout` seconds after
    it opened or after its previous response."""

    head_timeout = HEAD_TIMEOUT

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._cycle_at_arm = self.cycle  # a new request head replaces it (handle_events)
        self._head_deadline = self.loop.call_later(self.head_timeout, self._head_expired)

    def _disarm(self) -> None:
        deadline = getattr(self, "_head_deadline", None)
        if deadline is not None:
            deadline.cancel()
            self._head_deadline = None

    def _head_expired(self) -> None:
        self._head_deadline = None
        if self.cycle is self._cycle_at_arm and not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.warning("closed a connection from %s: no complete request head in %.0f s", client, self.head_timeout)
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not getattr(self, "_cycle_at_arm", self.cycle):  # a request head arrived: its deadline met
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head, on this keep-alive connection

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def head_deadline_protocol(timeout: float) -> type[HeadDeadline]:
    """The protocol class for uvicorn.Config(http=...) with this deadline (seconds, > 0)."""
    if not timeout > 0:
        raise ValueError(f"--head-timeout must be a positive number of seconds, got {timeout}")
    return type("HeadDeadline", (HeadDeadline,), {"head_timeout": float(timeout)})
