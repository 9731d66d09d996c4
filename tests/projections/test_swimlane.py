"""The swimlane page: events on a time axis (a long wait is drawn taller and written down), as tall as
its events need."""

from __future__ import annotations

import re

from projections.swimlane import render_html, row_offsets
from projections.timeline import Entry, Timeline


def _entry(position: int, at: float) -> Entry:
    return Entry(position=position, recorded_at=at, stream_id="group-p1", stream_version=position,
                 type="RunDispatched", attempt=0, source="trainer", target="agent", summary="")  # fmt: skip


def test_a_long_wait_is_drawn_taller_and_written_on_the_time_axis() -> None:
    t0 = 1_700_000_000.0
    entries = [_entry(1, t0), _entry(2, t0 + 0.002), _entry(3, t0 + 30.002), _entry(4, t0 + 30.004)]
    ys = row_offsets(entries)
    quick, slow, quick_again = ys[1] - ys[0], ys[2] - ys[1], ys[3] - ys[2]
    assert quick == quick_again and slow > quick + 40
    html = render_html(Timeline("p1_g0", "p1", entries))
    assert "+0.000 s" in html and "+30.002 s" in html  # each row's time since the first event
    assert "30.000 s later" in html and html.count(" later</text>") == 1  # the one long wait


def test_the_page_is_as_tall_as_its_events_need() -> None:
    t0 = 1_700_000_000.0
    entries = [_entry(i, t0 + i * 0.01) for i in range(1, 81)]
    html = render_html(Timeline("p1_g0", "p1", entries))
    [height] = re.findall(r'<svg [^>]*height="(\d+)"', html)
    assert int(height) > row_offsets(entries)[-1] > 80 * 30
    assert html.count('<g class="ev">') == 80
