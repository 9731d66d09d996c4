"""A self-contained HTML page drawing one sibling's timeline as a swimlane (inline SVG and CSS, nothing fetched)."""

from __future__ import annotations

import datetime as dt
from html import escape

from projections.timeline import LANES, Entry, Timeline

_LANE_X = {lane: 140 + i * 300 for i, lane in enumerate(LANES)}
_LANE_TITLE = {"trainer": "Trainer", "log": "Log", "agent": "Gym agent"}
_ROW = 34
_TOP = 70
_WIDTH = 2 * 140 + 2 * 300

_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2433; background: #fbfbfd; }
h1 { font-size: 18px; margin: 0 0 4px; }
p.sub { margin: 0 0 16px; color: #5a6478; }
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
.dot { stroke: none; }
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


def _event_svg(entry: Entry, row: int) -> str:
    y = _TOP + row * _ROW
    x1, x2 = _LANE_X[entry.source], _LANE_X[entry.target]
    tries = "group" if entry.attempt is None else f"try #{entry.attempt}"
    hover = (
        f"position {entry.position} · {_time(entry.recorded_at)}\n"
        f"{entry.stream_id} v{entry.stream_version} · {tries}\n{entry.type}: {entry.summary}"
    )
    if x1 == x2:  # an event about the log itself (a worker's result): a dot on the lane
        shape = f'<circle class="dot" cx="{x1}" cy="{y}" r="5" fill="#7a8194"/>'
        label_x = x1 + 12
    else:
        end = x2 - 8 if x2 > x1 else x2 + 8
        shape = (
            f'<line class="{_klass(entry)}" x1="{x1}" y1="{y}" x2="{end}" y2="{y}" marker-end="url(#head)"/>'
        )
        label_x = min(x1, x2) + 10
    return (
        f'<g class="ev"><title>{escape(hover)}</title>'
        f'<text class="pos" x="{_LANE_X["trainer"] - 16}" y="{y + 4}">{entry.position}</text>'
        f"{shape}"
        f'<text class="label" x="{label_x}" y="{y - 6}">{escape(entry.type)} · {escape(tries)}</text></g>'
    )


def render_html(tl: Timeline) -> str:
    height = _TOP + max(len(tl.entries), 1) * _ROW + 20
    lanes = "".join(
        f'<line class="lane" x1="{x}" y1="40" x2="{x}" y2="{height - 10}"/>'
        f'<text class="lane-title" x="{x}" y="28">{_LANE_TITLE[lane]}</text>'
        for lane, x in _LANE_X.items()
    )
    events = "".join(_event_svg(e, i) for i, e in enumerate(tl.entries))
    tries = ", ".join(f"#{a}" for a in tl.attempts()) or "none"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{escape(tl.rollout_id)} — rollout history</title>
<style>{_CSS}</style></head>
<body>
<h1>Rollout {escape(tl.rollout_id)}</h1>
<p class="sub">group {escape(tl.group_id)} · tries {escape(tries)} · {len(tl.entries)} events ·
hover an arrow for its position and time</p>
<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{height}" viewBox="0 0 {_WIDTH} {height}">
<defs><marker id="head" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" markerHeight="7"
orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#59607a"/></marker></defs>
{lanes}{events}
</svg>
</body></html>
"""
