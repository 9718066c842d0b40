"""`--timeline FILE.html`: a picture of each batch, drawn with plotly (`threepass[timeline]`).

One page, plotly's JavaScript inlined (it opens with no network), one panel per batch:
a bar per call on a time axis (milliseconds from the batch's start), coloured by status
and patterned by how it was served, the passes shaded behind (pass 1, pass 2 with its
groups, pass 3), the number of calls running drawn as a step line against the
dispatcher's limit. Hovering a bar shows the call's name, arguments and the head of its
result. Calls that did not run (deduped, cached, refused or settled in pass 1) are drawn
in pass 1, where they were decided; cancelled calls span the pass 2 they were cut from.

The page also carries the data it draws as JSON (`<script id="threepass-timeline">`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from dispatcher import BatchEvent, Tool
from dispatcher._policy import resources_overlap

from ._runner import ResultRow
from ._view import _args, head

__all__ = ["timeline_data", "timeline_figure", "write_timeline"]

STATUS_COLOUR = {
    "ok": "#2e9e44",
    "failed": "#d62728",
    "rejected": "#b1172b",
    "invalid_arguments": "#e6a100",
    "schema_required": "#1f9bcf",
    "denied": "#9b3fb5",
    "timed_out": "#ff7f0e",
    "expired": "#bcbd22",
    "cancelled": "#8c8c8c",
}
SERVED_PATTERN = {"ran": "", "deduped": "/", "cached": "x", "denied": "-", "decided": ".", "cancelled": "\\"}

Batch = tuple[int, BatchEvent, list[ResultRow]]


def _seam(fn: Any, args: Mapping[str, Any]) -> Any:
    try:
        return fn(args)
    except Exception:  # a seam that cannot answer: the kernel treats it as touching nothing
        return None


def pass2_groups(tools: Mapping[str, Tool], rows: Sequence[ResultRow]) -> list[list[int]]:
    """The groups pass 2 ran the batch's calls in, by the kernel's rule (dispatcher's
    `group_calls`) over the tools' own tags: consecutive concurrent calls together, any
    other call alone, a clash of what they read and write starting a new group. Only calls
    that were to run take part (ran, or cut off by a cancellation)."""
    groups: list[list[int]] = []
    current: list[int] = []
    reads_of: list[str] = []
    writes_of: list[str] = []
    for r in rows:
        if r.served not in ("ran", "cancelled"):
            continue
        tool = tools.get(r.name)
        concurrent = False if tool is None else tool.concurrent
        if callable(concurrent):
            concurrent = bool(_seam(concurrent, r.arguments))
        reads = set((_seam(tool.reads, r.arguments) or ()) if tool is not None and tool.reads else ())
        writes = set((_seam(tool.writes, r.arguments) or ()) if tool is not None and tool.writes else ())
        if not concurrent:
            if current:
                groups.append(current)
                current, reads_of, writes_of = [], [], []
            groups.append([r.index])
            continue
        clash = bool(writes_of) and resources_overlap(reads | writes, writes_of)
        clash = clash or (bool(writes) and resources_overlap(writes, reads_of))
        if clash and current:
            groups.append(current)
            current, reads_of, writes_of = [], [], []
        current.append(r.index)
        reads_of.extend(reads)
        writes_of.extend(writes)
    if current:
        groups.append(current)
    return groups


def timeline_data(
    batches: Sequence[Batch], limit: int | None = None, tools: Mapping[str, Tool] | None = None
) -> list[dict[str, Any]]:
    """What the page draws, per batch: the passes (ms from the batch's start), the limit,
    pass 2's groups (with `tools`, the registry by name) and one bar per call in call order."""
    out = []
    for number, event, rows in batches:
        p1, p2, p3 = event.pass1 * 1000, event.pass2 * 1000, event.pass3 * 1000
        bars: list[dict[str, Any]] = []
        for r in rows:
            res = r.result
            if r.served == "ran" and res is not None and res.started is not None:
                start = (res.started - event.started) * 1000  # both wall-clock
                width = res.duration * 1000
                phase = "pass 2"
            elif r.served == "cancelled":
                start, width, phase = p1, max(p2, 0.0), "pass 2"
            else:
                start, width, phase = 0.0, p1, "pass 1"
            bars.append(
                {
                    "index": r.index,
                    "id": r.call_id,
                    "name": r.name,
                    "status": r.status,
                    "served": r.served,
                    "phase": phase,
                    "start": start,
                    "width": width,
                    "arguments": _args(r.arguments, 300),
                    "result": "" if res is None else head(res.content, 300),
                }
            )
        out.append(
            {
                "batch": number,
                "outcome": event.outcome,
                "pass1": p1,
                "pass2": p2,
                "pass3": p3,
                "limit": limit,
                "groups": [
                    {
                        "calls": [bars[i]["id"] for i in group],
                        "start": min(bars[i]["start"] for i in group),
                        "end": max(bars[i]["start"] + bars[i]["width"] for i in group),
                    }
                    for group in pass2_groups(tools or {}, rows)
                ],
                "bars": bars,
            }
        )
    return out


def _running(bars: Sequence[dict[str, Any]]) -> tuple[list[float], list[int]]:
    """The number of calls running over time, as the points of a step line."""
    edges = sorted(
        [(b["start"], 1) for b in bars if b["served"] == "ran"]
        + [(b["start"] + b["width"], -1) for b in bars if b["served"] == "ran"]
    )
    xs, ys, now = [0.0], [0], 0
    for x, step in edges:
        now += step
        xs.append(x)
        ys.append(now)
    return xs, ys


def timeline_figure(data: Sequence[dict[str, Any]], title: str) -> Any:
    """The plotly figure of `timeline_data`."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    n = max(1, len(data))
    titles = [
        f"batch {b['batch']} · {len(b['bars'])} calls · pass 1 {b['pass1']:.1f} ms · "
        f"pass 2 {b['pass2']:.1f} ms · pass 3 {b['pass3']:.1f} ms"
        + ("" if b["outcome"] == "ok" else f" · {b['outcome']}")
        for b in data
    ]
    fig = make_subplots(
        rows=n,
        cols=1,
        subplot_titles=titles or ["no batches"],
        vertical_spacing=min(0.06, 0.5 / n),
        row_heights=[2 + len(b["bars"]) for b in data] or None,
        specs=[[{"secondary_y": True}] for _ in range(n)],
    )
    legend_seen: set[str] = set()
    for row, batch in enumerate(data, 1):
        bars = batch["bars"]
        total = max(
            [batch["pass1"] + batch["pass2"] + batch["pass3"]] + [b["start"] + b["width"] for b in bars]
        )
        total = total or 1.0
        for name, lo, hi, colour in (
            ("pass 1", 0.0, batch["pass1"], "rgba(31,119,180,0.13)"),
            ("pass 2", batch["pass1"], batch["pass1"] + batch["pass2"], "rgba(44,160,44,0.10)"),
            ("pass 3", batch["pass1"] + batch["pass2"], total, "rgba(148,103,189,0.13)"),
        ):
            if hi > lo:
                fig.add_vrect(
                    x0=lo, x1=hi, fillcolor=colour, line_width=0, layer="below", row=row, col=1,
                    exclude_empty_subplots=False,
                    annotation_text=name, annotation_position="top left", annotation_font_size=10,
                )  # fmt: skip
        for k, group in enumerate(batch["groups"], 1):
            fig.add_vrect(
                x0=group["start"], x1=max(group["end"], group["start"] + total * 0.004),
                line={"color": "#2ca02c", "dash": "dot", "width": 1}, fillcolor="rgba(0,0,0,0)",
                row=row, col=1, exclude_empty_subplots=False,
                annotation_text=f"group {k}", annotation_position="bottom left", annotation_font_size=9,
            )  # fmt: skip
        for bar in bars:
            label = f"{bar['id']} {bar['name']}"
            legend = bar["status"] not in legend_seen
            legend_seen.add(bar["status"])
            fig.add_trace(
                go.Bar(
                    orientation="h",
                    y=[label],
                    x=[max(bar["width"], total * 0.004)],
                    base=[bar["start"]],
                    name=bar["status"],
                    legendgroup=bar["status"],
                    showlegend=legend,
                    marker={
                        "color": STATUS_COLOUR.get(bar["status"], "#7f7f7f"),
                        "pattern": {"shape": SERVED_PATTERN.get(bar["served"], "")},
                        "line": {"width": 0},
                    },
                    customdata=[[bar["name"], bar["arguments"], bar["result"], bar["served"], bar["phase"]]],
                    hovertemplate=(
                        "<b>%{customdata[0]}</b> (%{customdata[3]}, %{customdata[4]})<br>"
                        "%{base:.2f} ms + %{x:.2f} ms<br>args: %{customdata[1]}<br>"
                        "result: %{customdata[2]}<extra></extra>"
                    ),
                ),
                row=row,
                col=1,
            )
        xs, ys = _running(bars)
        fig.add_trace(
            go.Scatter(
                x=xs, y=ys, mode="lines", line={"shape": "hv", "color": "#444", "width": 1},
                name="calls running", legendgroup="running", showlegend=row == 1, hoverinfo="skip",
            ),
            row=row, col=1, secondary_y=True,
        )  # fmt: skip
        if batch["limit"]:
            fig.add_trace(
                go.Scatter(
                    x=[0, total], y=[batch["limit"]] * 2, mode="lines",
                    line={"dash": "dash", "color": "#d62728", "width": 1},
                    name=f"limit ({batch['limit']})", legendgroup="limit", showlegend=row == 1,
                    hoverinfo="skip",
                ),
                row=row, col=1, secondary_y=True,
            )  # fmt: skip
        top = max([batch["limit"] or 0, *ys]) + 1
        fig.update_yaxes(autorange="reversed", row=row, col=1, secondary_y=False)
        fig.update_yaxes(
            range=[0, top],
            tickmode="linear",
            tick0=0,
            dtick=1,
            showgrid=False,
            title_text="running",
            row=row,
            col=1,
            secondary_y=True,
        )
        fig.update_xaxes(title_text="ms from the batch's start", row=row, col=1)
    for served, shape in SERVED_PATTERN.items():
        if shape:
            fig.add_trace(
                go.Bar(
                    x=[None], y=[None], name=f"served: {served}", legendgroup=f"served-{served}",
                    marker={"color": "#bbbbbb", "pattern": {"shape": shape}},
                )
            )  # fmt: skip
    fig.update_layout(
        title=title,
        barmode="overlay",
        height=max(360, sum(150 + 30 * len(b["bars"]) for b in data)),
        template="plotly_white",
        hoverlabel={"align": "left"},
        margin={"l": 200},
    )
    return fig


def write_timeline(
    path: str,
    batches: Sequence[Batch],
    *,
    title: str,
    limit: int | None = None,
    tools: Mapping[str, Tool] | None = None,
) -> None:
    """Write the page; plotly missing is an ImportError."""
    data = timeline_data(batches, limit, tools)
    fig = timeline_figure(data, title)
    page: str = fig.to_html(include_plotlyjs=True, full_html=True)
    embedded = json.dumps(data, default=str).replace("</", "<\\/")
    page = page.replace(
        "</body>", f'<script type="application/json" id="threepass-timeline">{embedded}</script>\n</body>'
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
