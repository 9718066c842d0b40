"""`Turns`: one batch at a time per session, first come first served.

A session's batches take turns: a dispatch that finds the session free takes its turn
with two attribute reads and a write (a loop's `Lock` asks the loop for the current task
to take it and again to give it back, which costs more than the rest of the check); one
that finds it taken waits on an event of its own, in the order it came, and is handed
the turn by the batch before it. Nothing here imports a loop: the events are made by the
caller's `Primitives.event`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

__all__ = ["Turns"]


class Turns:
    """Take a turn with `if turns.free(): ...` or `await turns.wait(event)`; end it with
    `turns.done()`. A waiter cancelled before its turn comes leaves the queue; one
    cancelled as its turn came hands it on, so no turn is ever lost."""

    __slots__ = ("_queue", "taken")

    def __init__(self) -> None:
        self.taken = False
        self._queue: collections.deque[Any] = collections.deque()

    def free(self) -> bool:
        """Take the turn if nobody has it or waits for it (True: taken)."""
        if self.taken or self._queue:
            return False
        self.taken = True
        return True

    async def wait(self, event: Callable[[], Any]) -> None:
        """Wait for the turn, behind whoever came first. `event`: makes the loop's Event."""
        handed = event()
        self._queue.append(handed)
        try:
            await handed.wait()
        except BaseException:
            if handed.is_set():
                self.done()  # the turn came as this wait was cut short: the next one's
            else:
                self._queue.remove(handed)
            raise

    @property
    def waiting(self) -> int:
        """How many wait for their turn."""
        return len(self._queue)

    def done(self) -> None:
        """End the turn: hand it to the first waiter, or leave the session free."""
        if self._queue:
            self._queue.popleft().set()  # `taken` stays: the turn goes straight on
        else:
            self.taken = False
