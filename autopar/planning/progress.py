"""Progress lines on stderr while a plan is made: what autopar is doing, with the seconds since it began.

autopar.plan, compare and parallelize take `progress=`: None (the default) shows the lines only on a
terminal and only once planning has taken more than AFTER seconds, so a fast plan, a log file and a test
print nothing; True shows every line from the start, terminal or not (the `autopar` command does);
False never. The lines are the library's own log records (logger "autopar"): its INFO messages (capturing,
each strategy, each search) and the figures of each ILP and pipeline cut it logs at DEBUG (`record.stage`).

Nothing stays behind: the handler is on the "autopar" logger only for the call, and the logging set-up a
user has (levels, handlers) sees the same records as without it.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

# how long planning runs before it shows what it is doing: beyond a blink, well before one wonders
# whether it hangs (the 2 s users of long-running command-line tools are used to)
AFTER = 2.0


def line(message: str, seconds: float) -> str:
    return f"[{seconds:6.1f} s] {message}"


def say(message: str, start: float, stream=None) -> None:
    """One progress line now, stamped with the seconds since `start` (time.perf_counter)."""
    print(line(message, time.perf_counter() - start), file=stream or sys.stderr, flush=True)


def describe(record: logging.LogRecord) -> str:
    """A record as one line: a stage's figures (search/ilp.py, planner.py) in words, else its message."""
    stage = getattr(record, "stage", None)
    if isinstance(stage, dict) and stage.get("stage") == "ilp":   # (search/ilp.py's _log: every figure there)
        status = stage["status"]   # a number is HiGHS's; words say why it was not solved
        return (f"ILP (roles {stage['roles']}, checkpointing {stage['checkpointing']}): {stage['variables']} "
                f"variables, {stage['rows']} rows; costs built in {stage['build_seconds']:.2f} s, solve "
                f"{stage['solve_seconds']:.2f} s" + (f" ({status})" if isinstance(status, str) else ""))
    return record.getMessage()


class Progress(logging.Handler):
    """Writes autopar's progress records as timed lines; those that come before `after` seconds have
    passed are held, and written when they have (at the next record or by the timer), so a plan that
    takes less writes nothing."""

    def __init__(self, stream, start: float, after: float, clock=time.perf_counter, lone: bool = False):
        super().__init__(logging.DEBUG)
        self.stream, self.start, self.after, self.clock = stream, start, after, clock
        self.held: list[str] = []
        self.shown = after <= 0
        self.lone = lone   # no other handler takes autopar's records: warnings go where they would (lastResort)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            if self.lone and logging.lastResort is not None and record.levelno >= logging.lastResort.level:
                logging.lastResort.handle(record)
            return
        if record.levelno < logging.INFO and not isinstance(getattr(record, "stage", None), dict):
            return   # other DEBUG records (cache hits, ...) are for whoever asked for DEBUG
        self.held.append(line(describe(record), self.clock() - self.start))
        self._show_if_due()

    def due(self) -> None:
        """Write what is held if `after` seconds have passed (the timer calls this)."""
        self.acquire()
        try:
            self._show_if_due()
        finally:
            self.release()

    def _show_if_due(self) -> None:
        if not self.shown and self.clock() - self.start < self.after:
            return
        self.shown = True
        if self.held:
            self.stream.write("".join(f"{text}\n" for text in self.held))
            self.stream.flush()
            self.held.clear()


class _Unasked(logging.Filter):
    """Drops, at a handler the user set up, the autopar records that only reach it because the "autopar"
    logger's level was lowered for the Progress handler: below the level the user had, from a logger whose
    level is inherited from "autopar"."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level or not (record.name == "autopar" or record.name.startswith("autopar.")):
            return True
        logger = logging.getLogger(record.name)
        while logger.name != "autopar":
            if logger.level != logging.NOTSET:
                return True   # its own level let it through, not ours
            logger = logger.parent
        return False


def _reached(logger: logging.Logger) -> list:
    """Every handler a record of `logger` reaches, as Logger.callHandlers walks them."""
    out = []
    while logger is not None:
        out += logger.handlers
        logger = logger.parent if logger.propagate else None
    return out


def _terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def shown(progress: bool | None = None, *, start: float | None = None, after: float | None = None, stream=None,
          clock=time.perf_counter):
    """Show autopar's progress on `stream` (sys.stderr) for the duration of the block.

    `progress`: None shows it on a terminal once `after` seconds (AFTER) have passed since `start` (now);
    True at once, anywhere; False never. Inside another `shown` block that shows progress it does nothing: the
    outer one already does (the `autopar` command around autopar.plan)."""
    stream = sys.stderr if stream is None else stream
    logger = logging.getLogger("autopar")
    if progress is False or (progress is None and not _terminal(stream)) or \
            any(isinstance(h, Progress) for h in logger.handlers):
        yield None
        return
    start = clock() if start is None else start
    after = AFTER if after is None else after
    others = _reached(logger)
    handler = Progress(stream, start, 0.0 if progress else after, clock, lone=not others)
    wanted, level = logger.getEffectiveLevel(), logger.level
    unasked = _Unasked(wanted)
    for h in others:
        h.addFilter(unasked)
    logger.addHandler(handler)
    logger.setLevel(min(wanted, logging.DEBUG))   # the stage figures are DEBUG records
    # a plan can sit in one stage (torch.export, HiGHS) for minutes: the timer writes the held lines when
    # `after` passes, not only at the next record
    timer = threading.Timer(max(0.0, after - (clock() - start)), handler.due) if not handler.shown else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield handler
    finally:
        if timer is not None:
            timer.cancel()
        logger.removeHandler(handler)
        logger.setLevel(level)
        for h in others:
            h.removeFilter(unasked)
