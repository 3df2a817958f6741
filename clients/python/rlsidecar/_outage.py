"""The outage log: a sidecar that gives no answer is logged, not silently failed open."""

import logging
import threading
import time

#: The least time, in seconds, between two lines of the outage log while the sidecar
#: keeps failing.
OUTAGE_LOG_INTERVAL = 10.0

#: The logger of the outage log (and of nothing else).
logger = logging.getLogger("rlsidecar")


def _checks(n):
    return "%d check%s" % (n, "" if n == 1 else "s")


class OutageLog:
    """Writes the warnings of a client whose sidecar gives no answer: the first check
    decided by ``on_unavailable`` at once, then at most one line per OUTAGE_LOG_INTERVAL
    while checks keep being so decided (each with how many were since the line before),
    and one line when the sidecar answers again. A failure within the interval after the
    last failure line is counted in the next line, so a sidecar that fails and answers by
    turns writes at most two lines per interval. A check the sidecar answers costs the
    test of ``failing``."""

    __slots__ = ("failing", "now", "_lock", "_logged", "_last", "_decided", "_socket", "_policy")

    def __init__(self, socket_path, on_unavailable):
        self.failing = False  # a check was decided by the policy since the sidecar last answered
        self.now = time.monotonic  # tests set a clock
        self._lock = threading.Lock()
        self._logged = False  # a failure line was written since the last recovery line
        self._last = None  # when the last failure line was written
        self._decided = 0  # checks decided by the policy since the last line
        self._socket = socket_path
        self._policy = on_unavailable

    def unreachable(self, cause, n=1):
        """Record n checks decided by the policy because the sidecar gave no answer
        (cause), and write a line when one is due."""
        with self._lock:
            self.failing = True
            self._decided += n
            now = self.now()
            if self._last is not None and now - self._last < OUTAGE_LOG_INTERVAL:
                return
            still = self._logged
            decided = self._decided
            self._logged, self._last, self._decided = True, now, 0
        if still:
            what = "still unreachable; requests are decided by on_unavailable=%r" % self._policy
        elif self._policy == "open":
            what = "unreachable; requests pass without rate limiting (on_unavailable='open') until it answers"
        else:
            what = "unreachable; requests are refused (on_unavailable='closed', 503) until it answers"
        logger.warning("rlsidecar: sidecar at %s %s: %s (%s decided by the policy since the last line)",
                       self._socket, what, cause, _checks(decided))

    def answered(self):
        """The sidecar answered while failing: write the recovery line when a failure line
        is outstanding."""
        with self._lock:
            if not self.failing:
                return
            self.failing = False
            if not self._logged:
                return  # failures within the interval of the last line: the next line counts them
            decided = self._decided
            self._logged, self._decided = False, 0
        logger.warning("rlsidecar: sidecar at %s answers again; requests are rate limited "
                       "(%s decided by on_unavailable=%r since the last line)", self._socket, _checks(decided),
                       self._policy)
