"""A self-contained HTML page drawing one sibling's timeline as a swimlane (inline SVG and CSS, nothing fetched).

Events run down the page in log order on a time axis: each row is labelled with its time since the
first event, and the space above a row grows with the wait before it (by the logarithm of the gap, up
to a bound), so a 30 s retire stands out from a 2 ms hand-off without a long run drawing metres of
empty page.  The picture is as tall as its events need: nothing is cut.

Zoomed (`px_per_s`, the console's zoom), the space grows with the wait itself: that many pixels a
second, rows never closer than one row apart, and no wait drawn taller than `MAX_LINEAR_GAP_PX` (a
longer one is written on the axis as every wait of half a second or more is).  `render_svg` is the
picture alone, `SWIMLANE_CSS` its style sheet (the console serves both).
"""

from __future__ import annotations

import datetime as dt
import math
from html import escape

from projections.timeline import LANES, Carry, Entry, Timeline

_AXIS_X = 90  # the time axis; the event's log position sits right of it
_LANE_X = {lane: 220 + i * 300 for i, lane in enumerate(LANES)}
_LANE_TITLE = {"trainer": "Trainer", "log": "Log", "agent": "Gym agent"}
_ROW = 34
_TOP = 70
_WIDTH = 2 * 220 + 2 * 300 + 60  # room right of the agent lane for the turns carried across tries
# A wait shorter than this adds no space; each tenfold longer one adds _GAP_PX more, up to _MAX_GAP_PX.
_GAP_FLOOR_S = 0.05
_GAP_PX = 22
_MAX_GAP_PX = 110
# A wait at least this long is written on the axis ("2.5 s later").
_GAP_LABEL_S = 0.5
# Zoomed: the most space one wait takes.
MAX_LINEAR_GAP_PX = 4000

_PAGE_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2433; background: #fbfbfd; }
h1 { font-size: 18px; margin: 0 0 4px; }
p.sub { margin: 0 0 16px; color: #5a6478; }
ul.turns { margin: 12px 0 0; padding-left: 20px; color: #39414f; }
"""
# The picture's own rules (what the console's pages load beside their own style sheet).
SWIMLANE_CSS = """
svg { background: #fff; border: 1px solid #dde1ea; border-radius: 6px; }
.lane { stroke: #c5cbd8; stroke-width: 2; stroke-dasharray: 4 4; }
.lane-title { font-weight: 600; text-anchor: middle; fill: #1d2433; }
.arrow { stroke-width: 1.6; fill: none; }
.arrow.t0 { stroke: #3b6fd6; } .arrow.t1 { stroke: #d9822b; } .arrow.t2 { stroke: #2f9e6e; }
.arrow.t3 { stroke: #a052c8; } .arrow.group { stroke: #7a8194; }
.arrow.fail { stroke-dasharray: 5 3; }
.ev:hover .label { fill: #000; font-weight: 600; }
.ev:hover .arrow { stroke-width: 3; }
.label { font-size: 12px; fill: #39414f; }
.pos { font-size: 11px; fill: #8a91a1; text-anchor: end; }
.axis { stroke: #8a91a1; stroke-width: 1; }
.tick { font-size: 11px; fill: #39414f; text-anchor: end; font-variant-numeric: tabular-nums; }
.gap { font-size: 11px; fill: #b0563a; text-anchor: end; font-style: italic; }
.gapline { stroke: #e4b3a3; stroke-width: 6; }
.dot { stroke: none; }
.carry { stroke: #2f9e6e; stroke-width: 2; fill: none; stroke-dasharray: 6 3; }
.carry-label { font-size: 11px; fill: #2f7a58; font-weight: 600; }
"""


def _time(ts: float) -> str:
    if not ts:
        return "-"
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _klass(entry: Entry) -> str:
    base = "group" if entry.attempt is None else f"t{entry.attempt % 4}"
    fail = (
        " fail" if entry.type in ("RunFailed", "AckRejected", "GroupAbandoned", "GroupDeadLettered") else ""
    )
    return f"arrow {base}{fail}"


def _gap_px(gap_s: float, px_per_s: float | None = None) -> float:
    """The space a wait of `gap_s` seconds adds above a row (zoomed: beyond the row itself)."""
    if px_per_s is not None:
        return min(MAX_LINEAR_GAP_PX, max(0.0, gap_s * px_per_s - _ROW))
    if gap_s <= _GAP_FLOOR_S:
        return 0.0
    return min(_MAX_GAP_PX, _GAP_PX * math.log10(gap_s / _GAP_FLOOR_S))


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s < 60 else f"{int(s // 60)} min {s % 60:04.1f} s"


def row_offsets(entries: list[Entry], px_per_s: float | None = None) -> list[float]:
    """Each row's y: one row apart, plus the space its wait since the previous event earns."""
    ys: list[float] = []
    y = float(_TOP)
    for i, entry in enumerate(entries):
        if i:
            y += _ROW + _gap_px(max(0.0, entry.recorded_at - entries[i - 1].recorded_at), px_per_s)
        ys.append(y)
    return ys


def _axis_svg(entries: list[Entry], ys: list[float]) -> str:
    if not entries:
        return ""
    start = entries[0].recorded_at
    parts = [f'<line class="axis" x1="{_AXIS_X}" y1="40" x2="{_AXIS_X}" y2="{ys[-1] + 10:.0f}"/>']
    for i, (entry, y) in enumerate(zip(entries, ys, strict=True)):
        parts.append(
            f'<text class="tick" x="{_AXIS_X - 8}" y="{y + 4:.0f}">+{_seconds(entry.recorded_at - start)}</text>'
        )
        gap = entry.recorded_at - entries[i - 1].recorded_at if i else 0.0
        if gap >= _GAP_LABEL_S:
            top = ys[i - 1] + 10
            parts.append(
                f'<line class="gapline" x1="{_AXIS_X}" y1="{top:.0f}" x2="{_AXIS_X}" y2="{y - 12:.0f}"/>'
            )
            parts.append(
                f'<text class="gap" x="{_AXIS_X - 8}" y="{(top + y) / 2:.0f}">{_seconds(gap)} later</text>'
            )
    return "".join(parts)


def _event_svg(entry: Entry, y: float) -> str:
    x1, x2 = _LANE_X[entry.source], _LANE_X[entry.target]
    tries = "group" if entry.attempt is None else f"try #{entry.attempt}"
    hover = (
        f"position {entry.position} · {_time(entry.recorded_at)}\n"
        f"{entry.stream_id} v{entry.stream_version} · {tries}\n{entry.type}: {entry.summary}"
    )
    if x1 == x2:  # an event about the log itself (a worker's result): a dot on the lane
        shape = f'<circle class="dot" cx="{x1}" cy="{y:.0f}" r="5" fill="#7a8194"/>'
        label_x = x1 + 12
    else:
        end = x2 - 8 if x2 > x1 else x2 + 8
        shape = (
            f'<line class="{_klass(entry)}" x1="{x1}" y1="{y:.0f}" x2="{end}" y2="{y:.0f}" '
            'marker-end="url(#head)"/>'
        )
        label_x = min(x1, x2) + 10
    return (
        f'<g class="ev"><title>{escape(hover)}</title>'
        f'<text class="pos" x="{_LANE_X["trainer"] - 16}" y="{y + 4:.0f}">{entry.position}</text>'
        f"{shape}"
        f'<text class="label" x="{label_x}" y="{y - 6:.0f}">{escape(entry.type)} · {escape(tries)}</text></g>'
    )


def _carry_svg(carry: Carry, y_of: dict[int, float]) -> str:
    """The turns a try carried on from an earlier one: a bracket right of the agent lane, from the row
    that recorded the boundary (the source try's retire with its offer) to the row of the resume."""
    end = y_of.get(carry.position)
    if end is None:
        return ""
    start = y_of.get(carry.offered_at) if carry.offered_at is not None else None
    x = _LANE_X["agent"] + 14
    label = f"turns 1..{carry.turn} from #{carry.source_attempt}"
    if start is None:  # the boundary's offer is not in this timeline: a mark at the resume alone
        return f'<text class="carry-label" x="{x}" y="{end + 14:.0f}">{escape(label)}</text>'
    bulge = x + 40
    return (
        f'<g class="ev"><title>{escape(carry.text())}</title>'
        f'<path class="carry" d="M{x},{start:.0f} C{bulge},{start:.0f} {bulge},{end:.0f} {x},{end:.0f}"/>'
        f'<text class="carry-label" x="{bulge - 8}" y="{(start + end) / 2 + 4:.0f}">{escape(label)}</text></g>'
    )


def _turns_html(tl: Timeline) -> str:
    lines = [c.text() for c in tl.carried]
    lines += [
        f"try #{a} offered its boundary after turn {turn} when it was retired"
        for a, (turn, _) in sorted(tl.offered.items())
    ]
    lines += [
        f"try #{a} declined to resume ({reason}): it played from its prompt"
        for a, (reason, _) in sorted(tl.declined.items())
    ]
    if not lines:
        return ""
    items = "".join(f"<li>{escape(line)}</li>" for line in lines)
    return f'<h2 style="font-size:15px;margin:16px 0 0">Turns across tries</h2><ul class="turns">{items}</ul>'


def render_svg(tl: Timeline, px_per_s: float | None = None) -> str:
    """The swimlane picture alone (styled by SWIMLANE_CSS); `px_per_s`: zoomed, see the module doc."""
    ys = row_offsets(tl.entries, px_per_s)
    y_of = {e.position: y for e, y in zip(tl.entries, ys, strict=True)}
    carries = "".join(_carry_svg(c, y_of) for c in tl.carried)
    height = int((ys[-1] if ys else _TOP) + 30)
    lanes = "".join(
        f'<line class="lane" x1="{x}" y1="40" x2="{x}" y2="{height - 10}"/>'
        f'<text class="lane-title" x="{x}" y="28">{_LANE_TITLE[lane]}</text>'
        for lane, x in _LANE_X.items()
    )
    axis = _axis_svg(tl.entries, ys) + f'<text class="lane-title" x="{_AXIS_X - 30}" y="28">time</text>'
    events = "".join(_event_svg(e, y) for e, y in zip(tl.entries, ys, strict=True))
    return f"""<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" viewBox="0 0 {_WIDTH} {height}">
<defs><marker id="head" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" markerHeight="7"
orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#59607a"/></marker></defs>
{axis}{lanes}{events}{carries}
</svg>"""


def render_html(tl: Timeline) -> str:
    tries = ", ".join(f"#{a}" for a in tl.attempts()) or "none"
    first = _time(tl.entries[0].recorded_at) if tl.entries else "-"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{escape(tl.rollout_id)} — rollout history</title>
<style>{_PAGE_CSS}{SWIMLANE_CSS}</style></head>
<body>
<h1>Rollout {escape(tl.rollout_id)}</h1>
<p class="sub">group {escape(tl.group_id)} · tries {escape(tries)} · {len(tl.entries)} events from {first} ·
time since the first event on the left, longer waits drawn taller · hover an arrow for its position and time</p>
{render_svg(tl)}
{_turns_html(tl)}
</body></html>
"""
