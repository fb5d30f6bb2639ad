"""`asyncgrpo report RUN --prometheus URL`: the dashboard's main panels as pictures, no Grafana.

Reads the panels' own queries from the chart's dashboard (charts/asyncgrpo/files/
dashboard.json, shipped in the package's source tree) with `$namespace` and `$run` filled in,
asks Prometheus's `query_range` for each, and draws one SVG per panel plus an index.md
that shows them. SVG because it needs no plotting library (matplotlib is not among the
project's dependencies) and GitHub, browsers and most Markdown viewers show it as is.

    asyncgrpo report math --namespace team-a --prometheus http://prometheus:9090 --out report/
"""

from __future__ import annotations

import argparse
import html
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1].parent / "charts/asyncgrpo/files/dashboard.json"

#: the panels a report draws, by title prefix, in this order
MAIN_PANELS = (
    "Training throughput",
    "Reward mean and spread",
    "Policy lag",
    "Tree compression",
    "Step time",
    "Sandboxes by state",
    "vLLM generation tokens/s",
    "vLLM KV-cache usage",
    "Gateway lease wait",
    "Gateway execs/s",
)
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]


@dataclass
class Panel:
    title: str
    unit: str
    series: list[Series] = field(default_factory=list)


def dashboard_panels(path: Path = DASHBOARD) -> list[dict[str, Any]]:
    panels = [p for p in json.loads(path.read_text())["panels"] if p.get("targets")]
    out = []
    for prefix in MAIN_PANELS:
        out += [p for p in panels if p["title"].startswith(prefix)]
    return out


def _legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() \
        or ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"


def _literal(text: str) -> str:
    """`text` matched literally inside a PromQL regex string (its backslashes doubled)."""
    return re.escape(text).replace("\\", "\\\\")


def query_range(url: str, promql: str, start: float, end: float, step: float
                ) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{q}",
                                    timeout=60) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:   # Prometheus says why in the body
        doc = json.loads(e.read() or b"{}")
    if doc.get("status") != "success":
        raise RuntimeError(f"{promql}: {doc.get('error')}")
    return doc["data"]["result"]


def collect(url: str, run: str, namespace: str, start: float, end: float, step: float,
            dashboard: Path = DASHBOARD) -> list[Panel]:
    out = []
    for p in dashboard_panels(dashboard):
        panel = Panel(p["title"], p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))
        for t in p["targets"]:
            expr = t["expr"].replace("$namespace", _literal(namespace)).replace(
                "$run", _literal(run))
            for r in query_range(url, expr, start, end, step):
                pts = [(float(ts), float(v)) for ts, v in r["values"]
                       if v not in ("NaN", "+Inf", "-Inf")]
                if pts:
                    panel.series.append(Series(_legend(t.get("legendFormat", ""), r["metric"]),
                                               pts))
        out.append(panel)
    return out


def _fmt(v: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{v * 100:.0f}%"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e3:
        return f"{v / 1e3:.3g}k"
    return f"{v:.3g}" + ("s" if unit == "s" else "")


def svg(panel: Panel, width: int = 720, height: int = 300) -> str:
    """A line chart: one polyline per series, y from zero (or the minimum) to the maximum,
    x in minutes since the first point, a legend under the plot."""
    left, right, top = 64, 16, 28
    legend_h = 16 * max(1, len(panel.series))
    bottom = 28 + legend_h
    pw, ph = width - left - right, height - top - bottom
    e = html.escape
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
              'font-family="sans-serif" font-size="11">'),
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="18" font-size="13" font-weight="bold">{e(panel.title)}</text>']
    pts = [p for s in panel.series for p in s.points]
    if not pts:
        parts.append(f'<text x="{left}" y="{top + ph / 2}">no data</text></svg>')
        return "\n".join(parts)
    t0, t1 = min(p[0] for p in pts), max(p[0] for p in pts)
    lo, hi = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts)
    hi = hi if hi > lo else lo + 1.0
    t1 = t1 if t1 > t0 else t0 + 1.0

    def xy(t: float, v: float) -> tuple[float, float]:
        return left + (t - t0) / (t1 - t0) * pw, top + ph - (v - lo) / (hi - lo) * ph

    for i in range(5):   # y grid and labels
        v = lo + (hi - lo) * i / 4
        _, y = xy(t0, v)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" '
                     'stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{e(_fmt(v, panel.unit))}</text>')
    for i in range(5):   # x labels: minutes since the first point
        t = t0 + (t1 - t0) * i / 4
        x, _ = xy(t, lo)
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle">'
                     f'{(t - t0) / 60:.1f} min</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
                 'stroke="#888"/>')
    for i, s in enumerate(panel.series):
        color = _COLORS[i % len(_COLORS)]
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(t, v) for t, v in s.points))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{line}"/>')
        ly = top + ph + 30 + 16 * i
        parts.append(f'<rect x="{left}" y="{ly - 9}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{left + 16}" y="{ly}">{e(s.name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:60]


def write_report(panels: list[Panel], out: Path, run: str, namespace: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files, lines = [], [f"# {namespace}/{run}", ""]
    for p in panels:
        f = out / f"{slug(p.title)}.svg"
        f.write_text(svg(p))
        files.append(f)
        lines += [f"## {p.title}", "", f"![{p.title}]({f.name})", ""]
    (out / "index.md").write_text("\n".join(lines))
    return files


def _duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration such as 30m or 6h, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="draw the dashboard's main panels of a run "
                              "from Prometheus (SVG + index.md), no Grafana needed")
    p.add_argument("run", help="the run's name (metadata.name)")
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--namespace", default="default", help="the run's namespace")
    p.add_argument("--since", type=_duration, default=_duration("1h"),
                   help="how far back (30m, 6h, 2d)")
    p.add_argument("--step", type=_duration, default=None,
                   help="resolution (default: about 300 points)")
    p.add_argument("--out", type=Path, default=Path("report"), help="output directory")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD,
                   help="the dashboard JSON whose panels to draw (default: the chart's)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    end = time.time()
    start = end - args.since
    step = args.step or max(1.0, args.since / 300)
    panels = collect(args.prometheus, args.run, args.namespace, start, end, step,
                     args.dashboard)
    files = write_report(panels, args.out, args.run, args.namespace)
    empty = [p.title for p in panels if not p.series]
    print(f"{len(files)} panels in {args.out}/index.md"
          + (f"; no data for: {', '.join(empty)}" if empty else ""))
    return 0
