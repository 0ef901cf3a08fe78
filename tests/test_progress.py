"""How long single calls announce their steps (:func:`moetool.progress.step_printer`)."""

from __future__ import annotations

import io
import re
import time

from rich.console import Console

from moetool.progress import silent, step_printer


def test_each_step_is_one_line_with_the_seconds_since_the_start():
    log = io.StringIO()
    step = step_printer(Console(file=log, width=200), time.perf_counter() - 12.34)
    step("lowering 13,666 graph nodes to XNNPACK")
    step("serializing the program")
    lines = log.getvalue().splitlines()
    assert len(lines) == 2
    first = re.fullmatch(r"\s*(\d+\.\d) s  lowering 13,666 graph nodes to XNNPACK", lines[0])
    assert first is not None and 12.3 <= float(first.group(1)) < 20, lines[0]
    assert lines[1].endswith(" s  serializing the program")


def test_no_console_or_a_quiet_one_prints_nothing(capsys):
    step_printer(None, time.perf_counter())("loading")
    quiet = silent()
    step_printer(quiet, time.perf_counter())("loading")
    assert capsys.readouterr() == ("", "")
