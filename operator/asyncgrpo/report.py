"""`asyncgrpo report`: the dashboard's main panels as pictures, no Grafana.

A cluster run (`asyncgrpo report RUN --prometheus URL`): reads the panels' own queries from
the chart's dashboard (charts/asyncgrpo/files/dashboard.json, shipped in the package's
source tree) with `$namespace` and `$run` filled in, and asks Prometheus's `query_range` for
each. A local run (`asyncgrpo report --local WORKDIR`): there is no Prometheus, so the same
panels are computed from the per-step records the local backend keeps of the trainer's,
vLLM's and the gateway's metrics endpoints and the trainer's status file
(`<workdir>/progress.jsonl`, asyncgrpo.local.progress). Either way it draws one SVG per
panel plus an index.md that shows them. SVG because it needs no plotting library
(matplotlib is not among the project's dependencies) and GitHub, browsers and most
Markdown viewers show it as is. What it cannot read it says in one line (exit 1).

    asyncgrpo report math --namespace team-a --prometheus prometheus.monitoring:9090 --out report/
    asyncgrpo report --local .cache/local/local-tiny --out report/
"""

from __future__ import annotations

import argparse
import html
import itertools
import json
import math
import re
import sys
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
    "vLLM prefix-cache hit rate per replica",
    "Rollout requests routed per replica",
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
    base = prometheus_url(url)
    try:
        with urllib.request.urlopen(f"{base}/api/v1/query_range?{q}", timeout=60) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:   # Prometheus says why in the body
        try:
            doc = json.loads(e.read() or b"{}")
        except ValueError:   # not Prometheus (a proxy's page, a wrong port)
            raise Unreachable(f"{base} answered HTTP {e.code}, not as Prometheus") from None
    except (OSError, ValueError) as e:   # refused, no such host, timeout, not JSON
        reason = getattr(e, "reason", None) or e
        raise Unreachable(f"cannot reach Prometheus at {base}: {reason}") from None
    if doc.get("status") != "success":
        raise Unreachable(f"Prometheus at {base} refused {promql!r}: {doc.get('error')}")
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


def nice_step(span: float, target: int = 5) -> float:
    """The 1-2-5 step (…, 0.1, 0.2, 0.5, 1, 2, 5, 10, …) giving about `target` intervals."""
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw * (1 - 1e-9))


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Ticks at multiples of a 1-2-5 step, the first at or below `lo`, the last at or above
    `hi` (so the axis ends on a round number)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    step = nice_step(hi - lo, target)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _decimals(step: float) -> int:
    return max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0


def _fmt(v: float, unit: str, step: float = 0.0) -> str:
    """A tick label: as many decimals as the tick step needs, k/M for large values, % for a
    ratio unit, s for seconds."""
    if unit == "percentunit":
        return f"{v * 100:.{_decimals(step * 100)}f}%"
    a, scale, suffix = abs(v), 1.0, ""
    if max(a, step) >= 1e6:
        scale, suffix = 1e6, "M"
    elif max(a, step) >= 1e3:
        scale, suffix = 1e3, "k"
    text = f"{v / scale:.{_decimals(step / scale) if step else 2}f}{suffix}"
    return text + (" s" if unit == "s" else "")


def _time_axis(span_s: float) -> tuple[float, str]:
    """Seconds per x unit and the unit's name: seconds under 2 min, hours over 3 h."""
    if span_s < 120:
        return 1.0, "seconds"
    if span_s > 3 * 3600:
        return 3600.0, "hours"
    return 60.0, "minutes"


def _text_width(text: str, size: float = 11) -> float:
    """A sans-serif text's width, estimated (no font metrics without a renderer)."""
    return 0.56 * size * len(text)


def svg(panel: Panel, width: int = 720, height: int = 300) -> str:
    """A line chart: one polyline per series (dots too when there are few points), y from
    zero (or the minimum) to a round maximum on 1-2-5 ticks, x in seconds, minutes or hours
    since the first point on round ticks, a legend that wraps under the plot."""
    left, right, top = 64, 24, 30
    e = html.escape
    # legend layout first: it decides how tall the plot can be
    rows: list[list[tuple[float, Series, int]]] = [[]]
    x = 0.0
    for i, s in enumerate(panel.series):
        w = 16 + _text_width(s.name) + 18
        if rows[-1] and x + w > width - left - right:
            rows.append([])
            x = 0.0
        rows[-1].append((x, s, i))
        x += w
    bottom = 50 + 16 * len(rows)
    pw, ph = width - left - right, height - top - bottom
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
              f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'),
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="19" font-size="13" font-weight="bold">{e(panel.title)}</text>']
    pts = [p for s in panel.series for p in s.points]
    if not pts:
        parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
                     'stroke="#888"/>')
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" '
                     'fill="#666">no data</text></svg>')
        return "\n".join(parts)
    t0, t1 = min(p[0] for p in pts), max(p[0] for p in pts)
    vmin, vmax = min(p[1] for p in pts), max(p[1] for p in pts)
    base = min(0.0, vmin)
    # a little headroom, so that a line at the maximum is not drawn on the frame
    yt = nice_ticks(base, vmax + 0.02 * (vmax - base) if vmax > base else base + 1.0)
    lo, hi = yt[0], yt[-1]
    ystep = yt[1] - yt[0]
    unit_s, unit_name = _time_axis(t1 - t0)
    # points at one instant get a one-unit axis: a tiny span would vanish next to an epoch
    # timestamp (t0 + 1e-9 == t0 at 1.8e9 s)
    span = (t1 - t0) / unit_s if t1 - t0 > 1e-3 else 1.0
    xstep = nice_step(span, 6)
    xt = [i * xstep for i in range(int(span / xstep + 1e-9) + 1)]
    t_end = t0 + span * unit_s

    def xy(t: float, v: float) -> tuple[float, float]:
        return left + (t - t0) / (t_end - t0) * pw, top + ph - (v - lo) / (hi - lo) * ph

    for v in yt:   # y grid and labels
        _, y = xy(t0, v)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" '
                     f'stroke="{"#bbb" if v == 0 else "#e4e4e4"}"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{e(_fmt(v, panel.unit, ystep))}</text>')
    for u in xt:   # x ticks: round numbers of the time unit since the first point
        x, _ = xy(t0 + u * unit_s, lo)
        label = f"{u:.{_decimals(xstep)}f}"
        half = _text_width(label) / 2
        anchor = "end" if x + half > width - 2 else "middle"
        parts.append(f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 4}" '
                     'stroke="#888"/>')
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="{anchor}">'
                     f'{label}</text>')
    parts.append(f'<text x="{left + pw}" y="{top + ph + 31}" text-anchor="end" fill="#555">'
                 f'{unit_name} since the first point</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" '
                 'stroke="#888"/>')
    for i, s in enumerate(panel.series):
        color = _COLORS[i % len(_COLORS)]
        xys = [xy(t, v) for t, v in s.points]
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xys)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" '
                     f'stroke-linejoin="round" points="{line}"/>')
        if len(xys) <= 80:
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{color}"/>'
                      for x, y in xys]
    for r, row in enumerate(rows):
        ly = top + ph + 50 + 16 * r
        for x, s, i in row:
            color = _COLORS[i % len(_COLORS)]
            parts.append(f'<rect x="{left + x:.1f}" y="{ly - 9}" width="10" height="10" '
                         f'fill="{color}"/>')
            parts.append(f'<text x="{left + x + 16:.1f}" y="{ly}">{e(s.name)}</text>')
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


def prometheus_url(text: str) -> str:
    """A base URL from what a person types: `host:port` gets `http://`."""
    text = text.strip().rstrip("/")
    return text if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text) else f"http://{text}"


class Unreachable(RuntimeError):
    """The source of a report could not be read; the message is one line for a person."""


# -- a local run: <workdir>/progress.jsonl, one record per step (asyncgrpo.local.progress) ---

def _gauge(records: list[dict], key: str) -> list[tuple[float, float]]:
    return [(r["time"], float(v)) for r in records
            if (v := (r.get("metrics") or {}).get(key)) is not None]


def _per_interval(records: list[dict], num: str, den: str | None = None
                  ) -> list[tuple[float, float]]:
    """Between consecutive records: d(num)/d(den) (a histogram's mean), or d(num)/d(time)
    (a counter's rate) without `den`; intervals where the denominator did not move are
    left out."""
    out = []
    for a, b in itertools.pairwise(records):
        ma, mb = a.get("metrics") or {}, b.get("metrics") or {}
        if num not in ma or num not in mb:
            continue
        d = (mb[num] - ma[num])
        dd = (mb.get(den, 0.0) - ma.get(den, 0.0)) if den else b["time"] - a["time"]
        if dd > 0 and d >= 0:
            out.append((b["time"], d / dd))
    return out


def _field(records: list[dict], key: str, sign: int = 0) -> list[tuple[float, float]]:
    out = []
    for r in records:
        v = r.get(key)
        if v is None:
            continue
        if sign:
            if r.get("reward_std") is None:
                continue
            v = v + sign * r["reward_std"]
        out.append((r["time"], float(v)))
    return out


def local_panels(records: list[dict], run: str = "local") -> list[Panel]:
    """The dashboard's main panels, computed from a local run's per-step records instead of
    PromQL: the same titles and series names (`{{run}} ...`), one point per step."""
    tr, gw = "asyncgrpo_trainer_", "asyncgrpo_gateway_"

    def panel(title, unit, *series):
        return Panel(title, unit, [Series(n, pts) for n, pts in series if pts])

    states = sorted({k.split('state="')[1].rstrip('"}') for r in records
                     for k in (r.get("metrics") or {}) if k.startswith(gw + "sandboxes{")})
    return [
        panel("Training throughput (tokens/s)", "",
              (f"{run} raw", _field(records, "raw_tokens_per_second")),
              (f"{run} forwarded", _field(records, "unique_tokens_per_second"))),
        panel("Reward mean and spread (mean ± within-group std)", "",
              (f"{run} mean", _field(records, "reward")),
              (f"{run} mean + std", _field(records, "reward", +1)),
              (f"{run} mean - std", _field(records, "reward", -1))),
        panel("Policy lag (policy versions between generating and training a sample)", "",
              (f"{run} mean", _gauge(records, tr + "sample_staleness_steps")),
              (f"{run} max", _gauge(records, tr + "sample_staleness_max_steps"))),
        panel("Tree compression (raw / forwarded tokens)", "",
              (run, _field(records, "tree_compression_ratio"))),
        panel("Step time: waiting for rollouts vs training (s per step)", "s",
              *[(f"{run} {name}", _per_interval(records, f"{tr}{m}_sum", f"{tr}{m}_count"))
                for name, m in (("waiting for rollouts", "rollout_wait_seconds"),
                                ("training", "train_seconds"),
                                ("whole step", "step_seconds"))]),
        panel("Sandboxes by state", "",
              *[(s, _gauge(records, f'{gw}sandboxes{{state="{s}"}}')) for s in states]),
        panel("vLLM generation tokens/s", "",
              (f"{run} vLLM", _per_interval(records, "vllm:generation_tokens_total"))),
        panel("vLLM KV-cache usage", "percentunit",
              (f"{run} vLLM", _gauge(records, "vllm:kv_cache_usage_perc"))),
        panel("Gateway lease wait (mean per step)", "s",
              (f"{run} mean", _per_interval(records, gw + "lease_wait_seconds_sum",
                                            gw + "lease_wait_seconds_count"))),
        panel("Gateway execs/s", "",
              (run, _per_interval(records, gw + "exec_seconds_count"))),
    ]


def load_local(workdir: Path) -> list[dict]:
    from asyncgrpo.local.progress import PROGRESS_FILE, load

    path = workdir / PROGRESS_FILE
    if not path.exists():
        raise Unreachable(f"no {PROGRESS_FILE} in {workdir} (the work folder of "
                          "`asyncgrpo local run`, default .cache/local/<run name>)")
    records = load(path)
    if not records:
        raise Unreachable(f"{path} has no step yet")
    return records


# -- the command ------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report", help="draw the dashboard's main panels of a run as SVG + index.md, no "
        "Grafana needed: a cluster run from Prometheus, or a local run from its work folder")
    p.add_argument("run", nargs="?", help="the run's name (metadata.name); with --local, "
                   "the name shown (default: the work folder's name)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prometheus", type=prometheus_url,
                     help="Prometheus base URL (host:port means http://host:port)")
    src.add_argument("--local", type=Path, metavar="WORKDIR",
                     help="a local run's work folder (`asyncgrpo local run`; its "
                     "progress.jsonl: the trainer's, vLLM's and the gateway's figures per "
                     "step), while it runs or after")
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
    try:
        if args.local is not None:
            run = args.run or args.local.resolve().name
            panels = [p for p in local_panels(load_local(args.local), run) if p.series]
            files = write_report(panels, args.out, run, "local")
            empty: list[str] = []
        else:
            if not args.run:
                raise Unreachable("name the run: asyncgrpo report RUN --prometheus URL")
            end = time.time()
            start = end - args.since
            step = args.step or max(1.0, args.since / 300)
            panels = collect(args.prometheus, args.run, args.namespace, start, end, step,
                             args.dashboard)
            files = write_report(panels, args.out, args.run, args.namespace)
            empty = [p.title for p in panels if not p.series]
    except Unreachable as e:
        print(f"asyncgrpo report: {e}", file=sys.stderr)
        return 1
    print(f"{len(files)} panels in {args.out}/index.md"
          + (f"; no data for: {', '.join(empty)}" if empty else ""))
    return 0
