"""Progress while planning (autopar/planning/progress.py), and the planning time print(plan) shows.

A plan that takes under AFTER seconds prints nothing; on a terminal one that takes longer shows its stages;
progress=True shows them anywhere, progress=False nowhere; a user's logging set-up is left as it was.
The threshold is forced (AFTER patched, or a fake clock) so no test depends on how fast the machine is."""
import io
import logging
import warnings

import torch

import autopar
from autopar.planning import progress as progress_module
from autopar.planning.progress import Progress, shown
from autopar.testing import GPT, GPTConfig


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8)), torch.randint(0, 32, (4, 8))


def _plan(**kw):
    model, tokens = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        return autopar.plan(model, (tokens,), {"a": 2}, hardware="cpu", strategy="ddp", **kw)


def _stderr(monkeypatch, out):
    """`out` standing in for sys.stderr; set in the test's body (pytest's own capture sets sys.stderr again
    after the fixtures' set-up)."""
    monkeypatch.setattr("sys.stderr", out)
    return out


def test_a_plan_faster_than_the_threshold_prints_nothing(monkeypatch):
    stderr = _stderr(monkeypatch, Terminal())
    monkeypatch.setattr(progress_module, "AFTER", 600.0)
    _plan()
    assert stderr.getvalue() == ""


def test_a_plan_past_the_threshold_on_a_terminal_shows_its_stages(monkeypatch):
    stderr = _stderr(monkeypatch, Terminal())
    monkeypatch.setattr(progress_module, "AFTER", 0.0)
    _plan()
    lines = stderr.getvalue().splitlines()
    assert all(line.startswith("[") and " s] " in line for line in lines), lines
    for stage in ("capturing GPT", "captured", "sharding rules", "searching (ILP", "ILP (roles", "costs built in",
                  "solve ", "searched in"):
        assert any(stage in line for line in lines), (stage, lines)


def test_progress_true_shows_it_anywhere_and_false_nowhere(monkeypatch):
    log = _stderr(monkeypatch, io.StringIO())   # not a terminal
    _plan()
    assert log.getvalue() == ""   # the default: not a terminal, so quiet
    _plan(progress=True)
    assert "capturing GPT" in log.getvalue() and "searched in" in log.getvalue()
    terminal = _stderr(monkeypatch, Terminal())
    monkeypatch.setattr(progress_module, "AFTER", 0.0)
    _plan(progress=False)
    assert terminal.getvalue() == ""


def test_compare_shows_each_strategy(monkeypatch):
    stderr = _stderr(monkeypatch, io.StringIO())
    model, tokens = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autopar.UnsupportedOpWarning)
        plans = autopar.compare(model, (tokens,), {"a": 2}, hardware="cpu", strategies=["ddp", "fsdp"], progress=True)
    assert "strategy ddp (1 of 2)" in stderr.getvalue() and "strategy fsdp (2 of 2)" in stderr.getvalue()
    assert all(p.stats["planning_seconds"] >= p.stats["capture_seconds"] for p in plans.values())


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_before_the_threshold_are_held_and_shown_when_it_passes():
    clock, out, log = Clock(), Terminal(), logging.getLogger("autopar")
    with shown(None, stream=out, after=2.0, clock=clock):
        log.info("capturing")
        clock.now += 1.5
        log.info("searching")
        assert out.getvalue() == ""
        clock.now += 1.0
        log.info("predicting")
    assert out.getvalue().splitlines() == ["[   0.0 s] capturing", "[   1.5 s] searching", "[   2.5 s] predicting"]


def test_the_timer_shows_held_lines_with_no_new_record():
    """A stage can run for minutes without a record (torch.export, HiGHS): the timer writes what is held."""
    clock, out = Clock(), Terminal()
    handler = Progress(out, start=clock.now, after=2.0, clock=clock)
    handler.handle(logging.makeLogRecord({"name": "autopar", "levelno": logging.INFO, "msg": "capturing"}))
    handler.due()
    assert out.getvalue() == ""
    clock.now += 3.0
    handler.due()
    assert out.getvalue() == "[   0.0 s] capturing\n"


def test_logging_is_left_as_the_user_set_it_up():
    """The handler is there for the call only, and a handler the user has sees no record it would not have
    seen: the "autopar" logger's level is lowered meanwhile, for the Progress handler's DEBUG stage records."""
    root, log = logging.getLogger(), logging.getLogger("autopar")
    seen = io.StringIO()
    theirs = logging.StreamHandler(seen)
    root.addHandler(theirs)
    level, handlers = log.level, list(log.handlers)
    try:
        with shown(True, stream=io.StringIO()) as handler:
            assert isinstance(handler, Progress)
            with shown(True, stream=io.StringIO()) as inner:   # nested: the outer one shows it
                assert inner is None
            log.info("an info record")
            log.warning("a warning")
        assert seen.getvalue() == "a warning\n"   # root's level (WARNING) let only this through before
        assert log.level == level and log.handlers == handlers and not theirs.filters
    finally:
        root.removeHandler(theirs)


def test_print_plan_says_how_long_each_stage_took():
    plan = _plan()
    line = next(line for line in str(plan).splitlines() if line.startswith("planning took"))
    for stage in ("capture", "sharding rules", "costs (ILP build)", "solve", "predict"):
        assert f"{stage} " in line, line
    back = autopar.Plan.from_json(plan.to_json())
    assert str(back) == str(plan)
    old = plan.to_json().replace('"planning_seconds"', '"unknown_seconds"')   # a plan saved before it was kept
    assert "planning stages: capture" in str(autopar.Plan.from_json(old))
