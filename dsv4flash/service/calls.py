"""A running call's stop conditions (cancel, deadline) and its scheduler turn, visible to the work it runs.

Every call a client queues (`OrderedExecutor.submit`) gets a `StopToken`. Long work checks it between steps
(`check()`: each decode step of a sample, each layer of a forward), so a cancelled call, or one running past its
deadline, stops there with `CallCancelled` / `CallTimedOut` instead of running to the end; the checks sit where
nothing of the client's state has changed yet (gradients, optimizer and recorded sequences are written only after
the last check), so a stopped call changed nothing. Work that can pause between steps (sampling) also asks
`owed()` whether its scheduler turn is owed to another tenant and, if so, unbinds the base and `hand_over()`s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable


class CallStopped(Exception):
    """A call stopped before it finished; it changed nothing."""


class CallCancelled(CallStopped):
    """Stopped by `cancel_future` (or `APIFuture.cancel()`)."""


class CallTimedOut(CallStopped):
    """Stopped at the server's per-call deadline (retryable: nothing was changed)."""


class StopToken:
    """Cancel flag and deadline of one call; `check()` raises once either is reached."""

    def __init__(self) -> None:
        self.cancelled = False
        self.deadline_s: float | None = None  # seconds of running (from its first turn on the base)
        self.started: float | None = None
        self._on_cancel: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def cancel(self) -> bool:
        """Ask the call to stop at its next check -> True (a finished call ignores it)."""
        with self._lock:
            self.cancelled = True
            wake = list(self._on_cancel)
        for fn in wake:  # e.g. the scheduler, so a call waiting for its turn leaves the queue at once
            fn()
        return True

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn` when the token is cancelled -> a function that unregisters it."""
        with self._lock:
            self._on_cancel.append(fn)

        def remove() -> None:
            with self._lock:
                if fn in self._on_cancel:
                    self._on_cancel.remove(fn)

        return remove

    def start(self) -> None:
        """The call got the base: its deadline counts from now."""
        if self.started is None:
            self.started = time.monotonic()

    def check(self) -> None:
        """Raise `CallCancelled` / `CallTimedOut` when the call must stop."""
        if self.cancelled:
            raise CallCancelled("the request was cancelled (cancel_future) and stopped before it finished; it "
                                "changed nothing")
        if self.deadline_s is not None and self.started is not None \
                and time.monotonic() - self.started > self.deadline_s:
            raise CallTimedOut(f"the request ran past the server's per-call deadline of {self.deadline_s:g} s "
                               f"(--call-timeout-s) and was stopped; it changed nothing: retry it, or split it into "
                               f"smaller requests")


_local = threading.local()


@contextlib.contextmanager
def running(token: StopToken):
    """Make `token` the current thread's call while the block runs."""
    prev = getattr(_local, "token", None), getattr(_local, "turn", None)
    _local.token, _local.turn = token, None
    try:
        yield token
    finally:
        _local.token, _local.turn = prev


def current() -> StopToken | None:
    """The current thread's call token (None outside a queued call)."""
    return getattr(_local, "token", None)


def set_turn(turn) -> None:
    """Record the scheduler turn the current call holds (an object with `owed()` and `hand_over()`), or None."""
    _local.turn = turn


def check() -> None:
    """Stop here if the current call is cancelled or past its deadline (no-op outside a queued call)."""
    token = current()
    if token is not None:
        token.check()


def owed() -> bool:
    """Whether the current call's turn on the base is owed to another tenant (it should `hand_over()`)."""
    turn = getattr(_local, "turn", None)
    return turn is not None and turn.owed()


def hand_over() -> None:
    """Give the base to the tenants owed it and wait for the turn back (the caller has unbound the base)."""
    turn = getattr(_local, "turn", None)
    if turn is not None:
        turn.hand_over()
    check()
