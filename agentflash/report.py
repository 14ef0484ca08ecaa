"""HTML report of a run log: one self-contained page to read a run at a glance.

Reads the JSONL log of agentflash/telemetry.py ("step" records carrying a `Usage`, "tool"
records per tool call; other record types are ignored) and draws header totals, the latency
split and tokens of every step, speculative acceptance, cumulative cost and savings, and tables
per agent and per tool. The page has inline CSS and SVG drawn here, no scripts and nothing
fetched: tooltips are SVG <title>s. Every string from the log is HTML-escaped. A number a remote
server did not report (None in the usage) shows as "not reported", never as zero.

    write_report("run.jsonl", "run.html")
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from agentflash.usage import Usage

Fmt = Callable[[float], str]

WIDE, HALF, PLOT_H = 1160, 560, 240       # chart widths and plot height, px
LEFT, RIGHT, TOP = 72, 16, 12             # plot margins, px
MIN_PITCH, LABEL_GAP = 6.0, 15.0          # px per bar at least; px between x labels at least
MAX_LABEL = 22                            # characters of an x label before it is cut
MAX_BAR = 56.0                            # px, the widest bar (few steps)


@dataclass(frozen=True)
class StepRecord:
    agent_id: str
    agent_name: str
    turn: int
    step: int
    ts: float
    model: str
    finish_reason: str
    usage: Usage

    @property
    def label(self) -> str:
        return f"{self.agent_name} t{self.turn} s{self.step}"


@dataclass(frozen=True)
class ToolRecord:
    agent_id: str
    name: str
    error: str | None
    elapsed_s: float


@dataclass(frozen=True)
class Series:
    name: str
    colour: str
    values: Sequence[float]


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL log; a line that is not a JSON object raises ValueError."""
    records = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n} is not JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {n} is not a JSON object")
            records.append(record)
    return records


def write_report(log_path: str | Path, out_path: str | Path) -> Path:
    """Render the log at `log_path` to the HTML file `out_path` (returned)."""
    out = Path(out_path)
    out.write_text(render_report(load_records(log_path), title=f"agentflash run: "
                                 f"{Path(log_path).name}"), encoding="utf-8")
    return out


def render_report(records: list[dict[str, Any]], title: str = "agentflash run report") -> str:
    """A complete HTML page for the step and tool records of a run log."""
    steps = sorted((StepRecord(
        agent_id=str(r["agent_id"]), agent_name=str(r.get("agent_name") or r["agent_id"]),
        turn=int(r["turn"]), step=int(r["step"]), ts=float(r["ts"]), model=str(r["model"]),
        finish_reason=str(r["finish_reason"]), usage=Usage.model_validate(r["usage"]))
        for r in records if r.get("type") == "step"), key=lambda s: s.ts)
    tools = [ToolRecord(agent_id=str(r["agent_id"]), name=str(r["name"]),
                        error=None if r.get("error") is None else str(r["error"]),
                        elapsed_s=float(r["elapsed_s"]))
             for r in records if r.get("type") == "tool"]
    stamps = [float(r["ts"]) for r in records if r.get("type") in ("step", "tool")]
    if steps:
        total = Usage.sum([s.usage for s in steps])
        body = "".join([_header(steps, tools, total, max(stamps) - min(stamps)),
                        _latency(steps), _tokens(steps), _speculation(total), _cost(steps, total),
                        _agents(steps, tools), _tools(tools)])
    else:
        body = '<p class="note">No model steps in this log.</p>'
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_e(title)}</title><style>{CSS}</style></head>'
            f'<body><main><h1>{_e(title)}</h1>{body}</main></body></html>\n')


# ---- sections -----------------------------------------------------------------------------

def _header(steps: list[StepRecord], tools: list[ToolRecord], total: Usage, span_s: float) -> str:
    spec, cost = total.speculative, total.cost
    turns = len({(s.agent_id, s.turn) for s in steps})
    cut = sum(s.finish_reason == "length" for s in steps)
    errors = sum(t.error is not None for t in tools)
    tiles = [
        ("Model", ", ".join(sorted({s.model for s in steps})), ""),
        ("Agents", _int(len({s.agent_id for s in steps})), ""),
        ("Steps", _int(len(steps)),
         _count(turns, "turn") + (f" · {cut} cut at length" if cut else "")),
        ("Tool calls", _int(len(tools)), _count(errors, "error")),
        ("Wall span", _dur(span_s), f"step time {_dur(total.timing.total_s)}"),
        ("Prompt tokens", _int(total.prompt_tokens), f"cached {_cached(total)}"),
        ("Completion tokens", _int(total.completion_tokens),
         f"{_int(spec.accepted_tokens + spec.lookup_accepted)} from drafts"
         if spec and (spec.drafts or spec.lookups) else ""),
        ("Mean acceptance τ", UNREPORTED if spec is None else
         f"{spec.mean_acceptance_length:.2f}" if spec.drafts else "speculation off",
         _count(spec.drafts, "verify step") if spec and spec.drafts else ""),
        ("Cost", UNREPORTED if cost is None else
         _usd(cost.usd) if cost.usd > 0 else "no pricing set",
         f"saved: cache {_usd(cost.saved_by_cache_usd)} · speculation "
         f"{_usd(cost.saved_by_speculation_usd)}" if cost and cost.usd > 0 else ""),
    ]
    return '<div class="tiles">' + "".join(
        f'<div class="tile"><div class="k">{_e(k)}</div><div class="v">{_e(v)}</div>'
        f'<div class="s">{_e(s)}</div></div>' for k, v, s in tiles) + "</div>"


def _latency(steps: list[StepRecord]) -> str:
    t = [s.usage.timing for s in steps]
    # a remote step's queue and prefill are not reported: its time to first token is "prefill"
    queue = [x.queue_s or 0.0 for x in t]
    prefill = [x.prefill_s if x.prefill_s is not None else x.ttft_s for x in t]
    series = [Series("queue", "#9aa5b1", queue),
              Series("prefill", "#4e79a7", prefill),
              Series("decode", "#59a14f", [x.decode_s for x in t]),
              Series("tools", "#f28e2b", [x.tool_s for x in t]),
              Series("other", "#c9ced6", [max(0.0, x.total_s - q - p - x.decode_s - x.tool_s)
                                          for x, q, p in zip(t, queue, prefill)])]
    return _section("Latency per step", "Where each step's time went; other = total − the rest "
                    "(on a remote server, prefill is the time to first token seen by the client).",
                    _legend(series) + _bar_chart([s.label for s in steps], series, "seconds",
                                                 _secs, "step (agent, turn, step)"))


def _tokens(steps: list[StepRecord]) -> str:
    labels = [s.label for s in steps]
    u = [s.usage for s in steps]
    cached = [x.prompt_tokens_details.cached_tokens for x in u]
    prompt = [Series("cached (KV reused)", "#76b7b2", [c or 0 for c in cached]),
              Series("computed", "#4e79a7", [max(0, x.prompt_tokens - c) if c is not None else 0
                                             for x, c in zip(u, cached)])]
    if None in cached:
        prompt.append(Series("cache not reported", "#c9ced6",
                             [x.prompt_tokens if c is None else 0 for x, c in zip(u, cached)]))
    completion = [Series("completion", "#b07aa1", [x.completion_tokens for x in u])]
    return _section("Tokens per step", "Prompt tokens served from kept KV vs computed, and "
                    "tokens generated.",
                    "<h3>Prompt tokens</h3>" + _legend(prompt)
                    + _bar_chart(labels, prompt, "tokens", _int, "step (agent, turn, step)")
                    + "<h3>Completion tokens</h3>" + _legend(completion)
                    + _bar_chart(labels, completion, "tokens", _int, "step (agent, turn, step)"))


def _speculation(total: Usage) -> str:
    spec = total.speculative
    if spec is None:
        return _section("Speculative decoding", "",
                        '<p class="note">Not reported by the server.</p>')
    if not spec.drafts:
        return _section("Speculative decoding", "",
                        '<p class="note">Speculation off: no draft blocks were verified.</p>')
    taus = range(min(spec.acceptance_histogram, default=1),
                 max(spec.acceptance_histogram, default=1) + 1)
    hist = [Series("verify steps", "#4e79a7", [spec.acceptance_histogram.get(t, 0)
                                                for t in taus])]
    rate = [Series("accepted", "#59a14f", [a / spec.drafts for a in spec.accepted_per_position])]
    positions = (_bar_chart([str(k) for k in range(1, len(rate[0].values) + 1)], rate,
                            "share of verify steps", _pct, "draft position", HALF)
                 if spec.accepted_per_position else '<p class="note">Not recorded.</p>')
    return _section(
        "Speculative decoding",
        f"τ = tokens committed per verify step; mean {spec.mean_acceptance_length:.2f} over "
        f"{_count(spec.drafts, 'verify step')}.",
        '<div class="row"><div><h3>Acceptance length τ</h3>'
        + _bar_chart([str(t) for t in taus], hist, "verify steps", _int, "τ (tokens committed)",
                     HALF)
        + "</div><div><h3>Acceptance rate by draft position</h3>" + positions
        + "</div></div>")


def _cost(steps: list[StepRecord], total: Usage) -> str:
    if total.cost is None:
        return _section("Cost", "", '<p class="note">Not known: a step\'s cost was not '
                        'reported (remote compute, or cached tokens not reported).</p>')
    if total.cost.usd <= 0:
        return _section("Cost", "", '<p class="note">No pricing set: every step cost $0.</p>')
    c = [s.usage.cost for s in steps if s.usage.cost is not None]
    series = [Series("cost", "#e15759", _cumsum([x.usd for x in c]))]
    unknown = []
    for name, color, saved in (
            ("saved by cache", "#76b7b2", [x.saved_by_cache_usd for x in c]),
            ("saved by speculation", "#59a14f", [x.saved_by_speculation_usd for x in c])):
        if None in saved:
            unknown.append(name)
        else:
            series.append(Series(name, color, _cumsum(saved)))
    note = (f'<p class="note">Not known for every step, so not drawn: {", ".join(unknown)} '
            "(no step costs were measured for the counterfactual).</p>" if unknown else "")
    return _section("Cost over the run", "Cumulative USD after each step, in time order.",
                    _legend(series) + _line_chart(series, "USD (cumulative)", _usd, "step")
                    + note)


def _agents(steps: list[StepRecord], tools: list[ToolRecord]) -> str:
    by_agent: dict[str, list[StepRecord]] = defaultdict(list)
    for s in steps:
        by_agent[s.agent_id].append(s)
    calls = Counter(t.agent_id for t in tools)
    errors = Counter(t.agent_id for t in tools if t.error is not None)
    rows = []
    for agent_id, mine in by_agent.items():
        u = Usage.sum([s.usage for s in mine])
        rows.append([f'<span title="{_e(agent_id)}">{_e(mine[0].agent_name)}</span>',
                     _int(len(mine)), _int(calls[agent_id]), _errors(errors[agent_id]),
                     _int(u.prompt_tokens), _cached(u), _int(u.completion_tokens),
                     f"{u.speculative.mean_acceptance_length:.2f}"
                     if u.speculative and u.speculative.drafts else "–",
                     _dur(u.timing.total_s), _usd(u.cost.usd) if u.cost else UNREPORTED])
    return _section("Agents", "", _table(["Agent", "Steps", "Tool calls", "Errors",
                                          "Prompt tokens", "Cached", "Completion tokens", "τ",
                                          "Step time", "Cost"], rows))


def _tools(tools: list[ToolRecord]) -> str:
    if not tools:
        return _section("Tools", "", '<p class="note">No tool calls.</p>')
    by_name: dict[str, list[ToolRecord]] = defaultdict(list)
    for t in tools:
        by_name[t.name].append(t)
    rows = []
    for name, mine in sorted(by_name.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        elapsed = [t.elapsed_s for t in mine]
        kinds = Counter(t.error for t in mine if t.error is not None)
        rows.append([_e(name), _int(len(mine)), _errors(sum(kinds.values())),
                     _dur(sum(elapsed) / len(elapsed)), _dur(max(elapsed)),
                     _e(", ".join(f"{k} ×{n}" for k, n in kinds.most_common()))])
    return _section("Tools", "", _table(["Tool", "Calls", "Errors", "Mean time", "Max time",
                                         "Error kinds"], rows, text_cols=(0, 5)))


# ---- charts -------------------------------------------------------------------------------

class Frame(NamedTuple):
    """A plot area (px) and its y range; `y` maps a value to px."""

    left: float
    top: float
    width: float
    height: float
    lo: float
    hi: float

    def y(self, v: float) -> float:
        return self.top + self.height * (self.hi - v) / (self.hi - self.lo)


def _ticks(lo: float, hi: float) -> list[float]:
    """About five round ticks (1, 2, 2.5, 5 x 10^k) covering [lo, hi]."""
    raw = (hi - lo) / 5 or 1.0
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step), math.ceil(hi / step)
    return [round(i * step, 12) for i in range(first, max(last, first + 1) + 1)]


def _axes(f: Frame, ticks: list[float], fmt: Fmt, y_label: str) -> list[str]:
    out = [f'<text x="14" y="{f.top + f.height / 2:.1f}" text-anchor="middle" '
           f'transform="rotate(-90 14 {f.top + f.height / 2:.1f})">{_e(y_label)}</text>']
    for t in ticks:
        y = f.y(t)
        out.append(f'<line class="{"axis" if t == 0 else "grid"}" x1="{f.left}" '
                   f'x2="{f.left + f.width:.1f}" y1="{y:.1f}" y2="{y:.1f}"/>'
                   f'<text x="{f.left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(fmt(t))}</text>')
    return out


def _bar_chart(labels: list[str], series: list[Series], y_label: str, fmt: Fmt, x_label: str,
               width: int = WIDE) -> str:
    """Stacked bars, one per label; wider than `width` (in a scroll box) when bars would be
    thinner than MIN_PITCH. Hovering a bar shows every series' value."""
    n = len(labels)
    pitch = max(MIN_PITCH, (width - LEFT - RIGHT) / n)
    rotate = max(len(x) for x in labels) > 3
    bottom = 30 + (5.0 * min(MAX_LABEL, max(len(x) for x in labels)) if rotate else 14)
    ticks = _ticks(0, max(sum(s.values[i] for s in series) for i in range(n)))
    f = Frame(LEFT, TOP, pitch * n, PLOT_H, ticks[0], ticks[-1])
    w, h = LEFT + f.width + RIGHT, TOP + PLOT_H + bottom
    out = _axes(f, ticks, fmt, y_label)
    every = math.ceil(LABEL_GAP / pitch) if rotate else 1
    bar = min(MAX_BAR, max(1.0, pitch * (0.72 if pitch > 8 else 0.85)))
    for i, label in enumerate(labels):
        x = f.left + i * pitch + (pitch - bar) / 2
        tip = "\n".join([label] + [f"{s.name}: {fmt(s.values[i])}" for s in series])
        out.append(f"<g><title>{_e(tip)}</title>")
        base = 0.0
        for s in series:
            if s.values[i] > 0:
                out.append(f'<rect x="{x:.1f}" y="{f.y(base + s.values[i]):.1f}" '
                           f'width="{bar:.1f}" height="{f.y(base) - f.y(base + s.values[i]):.1f}" '
                           f'fill="{s.colour}"/>')
                base += s.values[i]
        out.append("</g>")
        if i % every == 0:
            cx, ty = f.left + (i + 0.5) * pitch, f.top + PLOT_H + 14
            text = label if len(label) <= MAX_LABEL else label[:MAX_LABEL - 1] + "…"
            out.append(f'<text text-anchor="end" transform="translate({cx + 3:.1f} {ty:.1f}) '
                       f'rotate(-45)">{_e(text)}</text>' if rotate else
                       f'<text x="{cx:.1f}" y="{ty:.1f}" text-anchor="middle">{_e(text)}</text>')
    out.append(f'<text x="{f.left + f.width / 2:.1f}" y="{h - 6:.1f}" text-anchor="middle">'
               f'{_e(x_label)}</text>')
    return f'<div class="scroll">{_svg(w, h, y_label, out)}</div>'


def _line_chart(series: list[Series], y_label: str, fmt: Fmt, x_label: str,
                width: int = WIDE) -> str:
    """Lines over the step index 1..n, with a marker per point while they fit."""
    n = len(series[0].values)
    values = [v for s in series for v in s.values]
    ticks = _ticks(min(0.0, *values), max(0.0, *values))
    f = Frame(LEFT, TOP, width - LEFT - RIGHT, PLOT_H, ticks[0], ticks[-1])
    h = TOP + PLOT_H + 44
    out = _axes(f, ticks, fmt, y_label)

    def x(i: int) -> float:
        return f.left + (f.width * i / (n - 1) if n > 1 else f.width / 2)

    step = next(m * 10 ** e for e in range(12) for m in (1, 2, 5) if n / (m * 10 ** e) <= 12)
    for i in range(0, n, step):
        out.append(f'<text x="{x(i):.1f}" y="{f.top + PLOT_H + 16:.1f}" '
                   f'text-anchor="middle">{i + 1}</text>')
    for s in series:
        points = " ".join(f"{x(i):.1f},{f.y(v):.1f}" for i, v in enumerate(s.values))
        out.append(f'<polyline points="{points}" fill="none" stroke="{s.colour}" '
                   f'stroke-width="2"/>')
        if n <= 60:
            out += [f'<circle cx="{x(i):.1f}" cy="{f.y(v):.1f}" r="3" fill="{s.colour}">'
                    f'<title>{_e(f"step {i + 1}, {s.name}: {fmt(v)}")}</title></circle>'
                    for i, v in enumerate(s.values)]
    out.append(f'<text x="{f.left + f.width / 2:.1f}" y="{h - 6:.1f}" text-anchor="middle">'
               f'{_e(x_label)}</text>')
    return _svg(width, h, y_label, out)


def _svg(w: float, h: float, label: str, parts: list[str]) -> str:
    return (f'<svg width="{w:.0f}" height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}" role="img" '
            f'aria-label="{_e(label)}">' + "".join(parts) + "</svg>")


def _legend(series: list[Series]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{s.colour}"></i>{_e(s.name)}</span>' for s in series
    ) + "</div>"


# ---- html helpers and formats -------------------------------------------------------------

def _section(title: str, note: str, content: str) -> str:
    lead = f'<p class="lead">{_e(note)}</p>' if note else ""
    return f"<section><h2>{_e(title)}</h2>{lead}{content}</section>"


def _table(head: list[str], rows: list[list[str]], text_cols: tuple[int, ...] = (0,)) -> str:
    """A table whose cells are HTML already; columns but `text_cols` are numeric (right)."""
    align = ["" if i in text_cols else " class=n" for i in range(len(head))]
    th = "".join(f"<th{a}>{_e(h)}</th>" for a, h in zip(align, head))
    body = "".join("<tr>" + "".join(f"<td{a}>{c}</td>" for a, c in zip(align, r)) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _errors(n: int) -> str:
    return f'<span class="err">{n}</span>' if n else "0"


def _cumsum(xs: list[float]) -> list[float]:
    out, acc = [], 0.0
    for v in xs:
        acc += v
        out.append(acc)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


UNREPORTED = "not reported"


def _cached(u: Usage) -> str:
    cached = u.prompt_tokens_details.cached_tokens
    return UNREPORTED if cached is None else _pct(_ratio(cached, u.prompt_tokens))


def _e(s: str) -> str:
    return html.escape(s, quote=True)


def _int(v: float) -> str:
    return f"{round(v):,}"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def _secs(v: float) -> str:
    return f"{v:.3g} s"


def _dur(s: float) -> str:
    if s < 1:
        return f"{1000 * s:.0f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{int(s // 60)} min {s % 60:.0f} s"


def _usd(v: float | None) -> str:
    """Dollars with two significant decimals below $1 ($0.0012), cents above."""
    if v is None:
        return UNREPORTED
    if v == 0:
        return "$0"
    digits = min(8, max(2, 1 - math.floor(math.log10(abs(v)))))
    return f"{'-' if v < 0 else ''}${abs(v):,.{digits}f}"


CSS = """
body{margin:0;background:#f5f6f8;color:#1f2328;
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Liberation Sans",Arial,sans-serif}
main{max-width:1240px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 16px}
h2{font-size:16px;margin:0 0 4px}
h3{font-size:13px;margin:12px 0 4px;color:#424a53}
.tiles{display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));gap:12px}
.tile,section{background:#fff;border:1px solid #d8dee4;border-radius:8px}
.tile{padding:12px 14px}
.tile .k{font-size:11px;color:#57606a;text-transform:uppercase;letter-spacing:.05em}
.tile .v{font-size:21px;font-weight:600;overflow-wrap:anywhere}
.tile .s{font-size:12px;color:#57606a}
section{padding:16px 20px;margin-top:16px}
.lead,.note{color:#57606a;margin:0 0 8px}
.note{font-style:italic}
.legend{display:flex;flex-wrap:wrap;gap:16px;font-size:12px;color:#424a53;margin:4px 0}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:6px;
vertical-align:-2px}
.scroll{overflow-x:auto}
.row{display:flex;flex-wrap:wrap;gap:24px}
svg{display:block}
svg text{font-size:11px;fill:#57606a}
svg .grid{stroke:#eaeef2}
svg .axis{stroke:#8c959f}
svg rect:hover,svg circle:hover{opacity:.75}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{padding:6px 10px;border-bottom:1px solid #eaeef2;text-align:left}
th{font-size:12px;color:#57606a;font-weight:600}
.n{text-align:right}
.err{color:#cf222e;font-weight:600}
"""
