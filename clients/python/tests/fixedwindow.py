"""Counts under a fixed window, taken in one window.

A fixed window is aligned to a multiple of its length on the wall clock (the daemon's,
which is this one, to a millisecond): counts taken across a boundary start again, and a
test asserting them would fail there (a minute boundary between the checks of a 60 s
window, an hour boundary during a burst under a 1 h one). in_one_window runs such a
sequence once more, with the next attempt number (for fresh keys), when the wall clock
crossed a boundary during it; assert on what it returns, after it."""

import time


def _window(window_ms, slack_ms):
    return int((time.time() * 1000 + slack_ms) // window_ms)


def in_one_window(window_ms, run, attempts=3):
    """run(attempt) until it ran within one window (at most attempts times); returns what
    its last run returned."""
    for attempt in range(attempts):
        w = _window(window_ms, -2)
        got = run(attempt)
        if _window(window_ms, 2) == w:
            break
    return got


async def in_one_window_async(window_ms, run, attempts=3):
    """As in_one_window, for a coroutine function run."""
    for attempt in range(attempts):
        w = _window(window_ms, -2)
        got = await run(attempt)
        if _window(window_ms, 2) == w:
            break
    return got
