"""A build longer than a few seconds says where it is while it runs (hoad.progress)."""

from __future__ import annotations

import io
import logging
import re
import threading

import pytest
import torch
from helpers import rand

import hoad
from hoad import progress


def energy(x):
    return (x.sin() * x.cos().sum()).exp().sum()


def _build(order: int = 3):
    hoad.compile(energy, order=order, backend="eager")(rand(4, seed=1))


def test_a_long_build_reports_its_stages_in_the_log(monkeypatch, caplog):
    monkeypatch.setenv("HOAD_PROGRESS", "0.01")  # (every build is longer than that)
    with caplog.at_level(logging.WARNING, logger="hoad"):
        _build()
    said = [r.getMessage() for r in caplog.records if r.name == "hoad.progress"]
    assert said and said[0].startswith("hoad: building energy's order-3 program: "), said
    assert "s so far)" in said[0]
    last = said[-1]
    assert last.startswith("hoad: built energy's order-3 program in ") and "differentiate" in last, said
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "hoad.progress"), \
        "at the default log level"


@pytest.mark.parametrize("setting", ["60", "0", "off"])
def test_a_short_build_or_reports_off_say_nothing(monkeypatch, caplog, setting):
    monkeypatch.setenv("HOAD_PROGRESS", setting)
    with caplog.at_level(logging.DEBUG, logger="hoad"):
        _build()
    assert not [r for r in caplog.records if r.name == "hoad.progress"]


def test_on_a_terminal_one_status_line_is_redrawn(monkeypatch):
    """Where stderr is a terminal (and no handler takes hoad's log), the report is one line
    redrawn in place, cleared before any log record, and ended by the stage times."""
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    monkeypatch.setenv("HOAD_PROGRESS", "0.01")
    monkeypatch.setattr(progress, "_terminal", lambda: True)
    monkeypatch.setattr(progress, "REDRAW_S", 0.01)
    monkeypatch.setattr("sys.stderr", screen)
    with progress.Progress("f's order-2 program") as p:
        p.stage("capture")
        threading.Event().wait(0.2)
        p.stage("differentiate")
        threading.Event().wait(0.1)
        logging.lastResort.handle(logging.LogRecord("hoad.api", logging.WARNING, __file__, 0,
                                                    "hoad: a record in between", None, None))
    text = screen.getvalue()
    assert "\r\033[Khoad" in text and "building f's order-2 program: capture (" in text, text
    assert text.endswith("\n") and "\r\033[Khoad: built f's order-2 program in " in text, text
    assert re.search(r"\(capture 0\.[234] s, differentiate 0\.[1234] s\)\n$", text), text
    assert ")\r\033[Khoad: a record in between\n" in text, "the line cleared before the record"
    assert progress.Progress._clear not in logging.lastResort.filters, "the filter goes with the line"


def test_builds_inside_a_build_or_in_the_background_say_nothing(monkeypatch, caplog):
    monkeypatch.setenv("HOAD_PROGRESS", "0.01")
    with caplog.at_level(logging.WARNING, logger="hoad"):
        with progress.Progress("outer") as outer:
            outer.stage("capture")
            with progress.Progress("inner") as inner:
                inner.stage("capture")
                threading.Event().wait(0.1)
        thread = threading.Thread(target=_build, name=progress.COMPILE_THREAD)
        thread.start()
        thread.join()
    said = [r.getMessage() for r in caplog.records if r.name == "hoad.progress"]
    assert said and all("outer" in m for m in said), said


def test_a_failed_build_says_it_stopped(monkeypatch, caplog):
    monkeypatch.setenv("HOAD_PROGRESS", "0.01")
    with caplog.at_level(logging.WARNING, logger="hoad"), pytest.raises(RuntimeError):
        with progress.Progress("f's order-2 program") as p:
            p.stage("capture")
            threading.Event().wait(0.1)
            raise RuntimeError("boom")
    assert "hoad: stopped building f's order-2 program in " in caplog.text


def test_training_through_a_compiled_program_reports_its_compile(monkeypatch, caplog):
    """The AOTAutograd compile (gradients on) is a build of its own: reported the same way. (Reports
    start after 1 ms: from a warm Inductor cache the compile can end within 10 ms, and under load
    it did, once in six clean-clone runs, before a 10 ms report.)"""
    monkeypatch.setenv("HOAD_PROGRESS", "0.001")
    w = torch.nn.Parameter(rand(4, seed=2))
    cf = hoad.compile(lambda x: (x * w).sin().sum(), order=1, backend="inductor")
    with caplog.at_level(logging.WARNING, logger="hoad"):
        cf(rand(4, seed=3))[0].sum().backward()
    assert "for autograd in " in caplog.text and w.grad is not None
