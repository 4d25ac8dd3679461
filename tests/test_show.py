"""The CLI's progress display (coldsnap.cli.show): lines where nothing redraws, bars on a terminal, nothing for
--json."""

import io
import re

from coldsnap.cli.show import Shown

BLOB = "sha256:" + "ab" * 32
ANSI = re.compile(r"\x1b\[")


def _run(shown: Shown) -> None:
    shown("starting the engine")
    for done in range(0, 64 << 20, 8 << 20):
        shown.transfer(BLOB, done, 64 << 20)
    shown.transfer(BLOB, 64 << 20, 64 << 20)
    shown.transfer(BLOB, 64 << 20, 64 << 20)  # a repeated final report
    shown("restored")
    shown.close()


def test_without_a_terminal_one_line_per_step_and_per_blob_moved():
    out = io.StringIO()
    _run(Shown(stream=out, terminal=False))
    lines = out.getvalue().splitlines()
    assert lines[0] == "coldsnap: starting the engine" and lines[-1] == "coldsnap: restored"
    assert len(lines) == 3 and re.match(r"coldsnap: moved sha256:abababababab…: 64\.0 MiB in [\d.]+ s \(\d+ MB/s\)",
                                        lines[1]), lines
    assert not ANSI.search(out.getvalue())


def test_on_a_terminal_bars_redraw_and_finished_steps_stay_as_lines():
    out = io.StringIO()
    _run(Shown(stream=out, terminal=True))
    text = out.getvalue()
    assert ANSI.search(text)  # drawn, not appended
    plain = ANSI.sub("", text)
    for line in ("coldsnap: starting the engine", "coldsnap: moved sha256:abababababab…: 64.0 MiB",
                 "coldsnap: restored"):
        assert line in plain
    assert plain.count("coldsnap: moved") == 1


def test_json_shows_nothing():
    out = io.StringIO()
    _run(Shown(quiet=True, stream=out, terminal=True))
    assert out.getvalue() == ""
