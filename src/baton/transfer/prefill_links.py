"""Decode's control channels to its prefill workers: ``PrefillLinks``.

Owns one ``ControlClient`` per prefill endpoint and the pairing on it: a blocking bootstrap
(``DecodeEngine`` construction) or a pairing on the way (Hello queued ahead of the first
request on the same ordered channel, answered later), the check of the HelloAck, and
liveness -- a ping every ``Deadlines.ping_interval_s`` to each prefill that owes decode
state, and the verdict on links that never answered the handshake, whose prefill is gone
(its process exited, same host; it closed the connection, any host: seen at once) or that
went silent (``peer_silence_s``: a prefill alive but not answering). What a
failed link means for its requests is ``DecodeRooms``' business; this module only reports
the link and why, and keeps the link's fence state (``PrefillLink.epoch``, ``fenced``) and
whether the prefill's process is known to be gone (``is_gone``: only where both share a
host and pid namespace).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from baton.config import Deadlines
from baton.transfer.channel import MAX_MESSAGES_PER_TURN
from baton.transfer.channel_client import ControlClient, wait_any
from baton.transfer.handshake import PairingError, check_pairing
from baton.transfer.protocol import Hello, HelloAck, Message, Ping, Pong

logger = logging.getLogger("baton.transfer")

PAIRING_RETRY_S = 2.0
"""After a pairing on the way failed (nothing listening, no HelloAck, refused), requests
naming that endpoint fail at once for this long instead of each waiting again."""
MAX_PAIRINGS_IN_FLIGHT = 8
"""New prefills being paired at once; a request naming a ninth fails at once (its router
retries elsewhere), so endpoints that never answer cannot hold decode's units."""


class PrefillUnavailable(Exception):
    """A request's prefill cannot be tried now (``PrefillLinks.open``): the message says why;
    ``refused``: its last pairing was refused (the prefill answered: it is up)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass
class PrefillLink:
    """The control channel to one prefill worker."""

    endpoint: str
    client: ControlClient
    hello_deadline: float
    """Until HelloAck: when the pairing is given up."""
    peer: HelloAck | None = None
    """Prefill's accepted HelloAck; None while the pairing is in flight."""
    last_heard: float = 0.0
    last_ping: float = 0.0
    ping_seq: int = 0
    epoch: int = 0
    """Fence epoch: new reservations carry it; ``DecodeRooms.fence`` bumps it."""
    fenced: str | None = None
    """Why decode failed this prefill (None: healthy). A fenced link takes no reservation;
    it stays open only to hear the confirmations that free its quarantined units."""
    last_fence_sent: float = 0.0
    peer_start: str | None = None
    """The prefill process's start time (/proc), where decode can watch that process."""
    on_the_way: bool = False
    """Opened for a request (not at construction): a refused connection fails it at once."""

    def is_gone(self) -> bool:
        """Whether the prefill's process is known to have exited (so nothing of it writes)."""
        return (
            self.peer is not None
            and self.peer_start is not None
            and (_process_start(self.peer.pid) != self.peer_start)
        )


def _process_start(pid: int) -> str | None:
    """Start time of a live process ``pid`` (None: no such process, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class PrefillLinks:
    """Endpoint -> ``PrefillLink``; iterating gives the endpoints."""

    def __init__(self, hello: Hello, token: str | bytes, deadlines: Deadlines) -> None:
        self.hello = hello
        self.token = token
        self.deadlines = deadlines
        self._links: dict[str, PrefillLink] = {}
        self._retry_after: dict[str, tuple[float, str | None]] = {}
        """Endpoint -> when a request may try it again (its pairing on the way failed), and
        the prefill's refusal if it refused."""

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._links

    def __iter__(self) -> Iterator[str]:
        return iter(self._links)

    def get(self, endpoint: str) -> PrefillLink | None:
        return self._links.get(endpoint)

    def open(self, endpoint: str, wait_s: float | None = None) -> PrefillLink:
        """A channel to ``endpoint`` with our Hello queued on it; the pairing is given up
        after ``wait_s`` (default and at most ``bootstrap_s``). With ``wait_s`` (a pairing on
        the way) the pairing also fails as soon as the connection is refused, and
        ``PrefillUnavailable`` is raised, nothing opened, while the endpoint's last pairing
        failed under ``PAIRING_RETRY_S`` ago or ``MAX_PAIRINGS_IN_FLIGHT`` are under way.
        Raises ``zmq.ZMQError`` for a malformed endpoint."""
        now = time.monotonic()
        if wait_s is not None:
            self._check_may_pair(endpoint, now)
        client = ControlClient(endpoint, self.token)
        on_the_way = wait_s is not None
        wait_s = min(wait_s or self.deadlines.bootstrap_s, self.deadlines.bootstrap_s)
        link = PrefillLink(endpoint, client, now + wait_s, last_heard=now, on_the_way=on_the_way)
        self._links[endpoint] = link
        client.send(self.hello)
        return link

    def _check_may_pair(self, endpoint: str, now: float) -> None:
        self._retry_after = {e: t for e, t in self._retry_after.items() if t[0] > now}
        if endpoint in self._retry_after:
            refusal = self._retry_after[endpoint][1]
            verb = f"refused to pair ({refusal})" if refusal else "failed to pair"
            raise PrefillUnavailable(
                f"the prefill at {endpoint} {verb} less than {PAIRING_RETRY_S:g} s ago",
                refused=refusal is not None,
            )
        pairing = sum(1 for link in self._links.values() if link.peer is None)
        if pairing >= MAX_PAIRINGS_IN_FLIGHT:
            raise PrefillUnavailable(
                f"{pairing} pairings with new prefills are under way (at most "
                f"{MAX_PAIRINGS_IN_FLIGHT}): the prefill at {endpoint} is not tried now"
            )

    def bootstrap(self, link: PrefillLink) -> None:
        """Wait for ``link``'s HelloAck and accept it (construction only). Raises
        ``TimeoutError`` past the deadline, ``PairingError`` if either side refuses."""
        while (remaining := link.hello_deadline - time.monotonic()) > 0:
            msg = link.client.recv(math.ceil(remaining * 1000))
            if isinstance(msg, HelloAck):
                break
            if msg is not None:
                logger.warning("decode: %s before HelloAck ignored", type(msg).__name__)
        else:
            raise TimeoutError(
                f"decode: no HelloAck from the prefill at {link.endpoint} within the "
                f"{self.deadlines.bootstrap_s} s bootstrap deadline (is it running? same token? "
                "a prefill logs the frames it refuses, once a minute per peer)"
            )
        self.accept(link, msg)

    def accept(self, link: PrefillLink, msg: HelloAck) -> None:
        """Accept ``link``'s pairing or raise ``PairingError``."""
        if not msg.accepted:
            error = msg.error or "no reason given"
            raise PairingError(
                f"prefill {msg.worker_id!r} at {link.endpoint} refused to pair: {error}", [error]
            )
        check_pairing(self.hello, msg)
        link.peer = msg
        if msg.pid and msg.host_id and msg.host_id == self.hello.host_id:
            link.peer_start = _process_start(msg.pid)
        logger.info("decode: paired with prefill %r at %s", msg.worker_id, link.endpoint)

    def poll(self, timeout_ms: int) -> Iterator[tuple[PrefillLink, Message]]:
        """Messages from every link (waiting up to ``timeout_ms`` for the first); Pongs are
        consumed here. A link closed by the caller in between is skipped."""
        links = list(self._links.values())
        ready = wait_any([link.client for link in links], timeout_ms)
        for link in links:
            if link.client not in ready:
                continue
            for _ in range(MAX_MESSAGES_PER_TURN):
                if link.endpoint not in self._links:
                    break
                msg = link.client.recv(0)
                if msg is None:
                    break
                link.last_heard = time.monotonic()
                if not isinstance(msg, Pong):
                    yield link, msg

    def failing(self, owing: set[str]) -> list[tuple[PrefillLink, str]]:
        """Links to give up, with why: no HelloAck in time, or silence past
        ``peer_silence_s`` while they owe us state (``owing``: endpoints). Pings the rest
        that owe us state."""
        now, failed = time.monotonic(), []
        for link in self._links.values():
            if link.fenced is not None:
                continue  # failed already; DecodeRooms resends its Fence instead of pings
            if link.peer is None and now > link.hello_deadline:
                failed.append((link, f"no HelloAck from the prefill at {link.endpoint} in time"))
            elif link.peer is None and link.on_the_way and link.client.never_connected():
                failed.append(
                    (
                        link,
                        f"nothing accepts connections at {link.endpoint} (is the prefill running?)",
                    )
                )
            elif link.peer is not None and (gone := self._gone(link)) is not None:
                # Seen at once, owing state or not: a restarted prefill at the same endpoint
                # is a new peer, paired afresh (the link closes once nothing is quarantined).
                failed.append((link, f"the prefill at {link.endpoint} {gone}"))
            elif link.endpoint in owing and now - link.last_heard > self.deadlines.peer_silence_s:
                silence = self.deadlines.peer_silence_s
                failed.append(
                    (link, f"the prefill at {link.endpoint} answered nothing for {silence} s")
                )
            elif (
                link.peer is not None
                and link.endpoint in owing
                and now - link.last_ping >= self.deadlines.ping_interval_s
            ):
                link.ping_seq += 1
                link.last_ping = now
                link.client.send(Ping(seq=link.ping_seq))
        return failed

    @staticmethod
    def _gone(link: PrefillLink) -> str | None:
        """How a paired prefill is known to be gone: its process exited (same host), or it
        closed the connection (any host); None while neither is seen."""
        if link.is_gone():
            return "exited (its process is gone)"
        if link.client.connection_closed():
            return "closed the control connection (its process ended or restarted)"
        return None

    def failed(self, link: PrefillLink, refusal: str | None = None) -> None:
        """``link`` is given up (``refusal``: the prefill's, if it refused to pair): if it
        never paired (a pairing on the way), requests naming its endpoint fail at once for
        ``PAIRING_RETRY_S``."""
        if link.peer is None and link.on_the_way:
            self._retry_after[link.endpoint] = (time.monotonic() + PAIRING_RETRY_S, refusal)

    def close(self, link: PrefillLink) -> None:
        """Forget ``link`` (queued messages are dropped); a later request pairs afresh."""
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        link.client.close()

    def close_all(self) -> None:
        for link in list(self._links.values()):
            self.close(link)
