"""One way to wait: call a check until it answers, or give up at a deadline.

Every bounded wait of the runners and engines goes through :func:`poll` (a worker's health, a
PID to be freed, a pid file to appear, a port to leave TIME_WAIT), so each has a deadline, a
pause between attempts, and a timeout that says what it waited for and what the last attempt
saw. The caller turns :class:`PollTimeout` into its own typed error (``PidBusy``,
``RestoreFailed``, ...), which decides whether a retry can help.

A check returns its answer when done, and ``None`` or ``False`` while not yet; it raises
:class:`NotYet` to say why not yet (that reason ends up in the timeout). Any other exception
ends the wait at once, unless its type is listed in ``retry_on``.

Example:
    >>> from ckptflow.poll import NotYet, poll
    >>> answers = iter([None, False, 42])
    >>> poll(lambda: next(answers), timeout_s=1, interval_s=0, what="the answer")
    42
    >>> def never():
    ...     raise NotYet("HTTP 503")
    >>> poll(never, timeout_s=0.05, interval_s=0.01, what="/health to answer 200")
    Traceback (most recent call last):
    ...
    ckptflow.poll.PollTimeout: timed out after 0.05 s waiting for /health to answer 200 (last: HTTP 503)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal, TypeVar

T = TypeVar("T")


class NotYet(Exception):
    """Raised by a check: not done yet, and why (kept as the timeout's ``last``)."""


class PollTimeout(TimeoutError):
    """The check did not answer within ``timeout_s``; ``last`` is what its last attempt said."""

    def __init__(self, what: str, timeout_s: float, last: str = ""):
        self.what, self.timeout_s, self.last = what, timeout_s, last
        super().__init__(f"timed out after {timeout_s:g} s waiting for {what}" + (f" (last: {last})" if last else ""))


def poll(check: Callable[[], T | None | Literal[False]], timeout_s: float, interval_s: float = 0.05, *,
         what: str, retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``check`` every ``interval_s`` until it returns something other than None or False;
    return that. It is called at least once, even with ``timeout_s`` 0, and never after the
    deadline (the last pause is cut short to it).

    Args:
        check: the condition; raises NotYet (or a ``retry_on`` type) to say why not yet.
        timeout_s: how long to keep asking.
        interval_s: pause between attempts.
        what: what is awaited, for the timeout's message ("PID 4242 to be free").
        retry_on: exception types that mean "not yet" too (their text becomes ``last``).

    Raises:
        PollTimeout: no answer within ``timeout_s``.
        Exception: whatever ``check`` raised that is neither NotYet nor in ``retry_on``.
    """
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            got = check()
        except (NotYet, *retry_on) as e:
            last = str(e) or type(e).__name__
        else:
            if got is not None and got is not False:
                return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise PollTimeout(what, timeout_s, last)
        time.sleep(min(interval_s, left))
