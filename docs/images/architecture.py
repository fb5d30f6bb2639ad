"""Writes docs/images/architecture.svg (README and docs/architecture.md): the ASCII picture's facts
as a figure. Run `python3 docs/images/architecture.py`, then look at it rendered
(`rsvg-convert docs/images/architecture.svg -o /tmp/a.png`)."""
import html

W, H = 980, 590
out = []
e = html.escape
def box(x, y, w, h, title, lines, fill, stroke):
    out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>')
    out.append(f'<text x="{x + w/2}" y="{y + 22}" text-anchor="middle" font-weight="bold" font-size="14">{e(title)}</text>')
    for i, l in enumerate(lines):
        out.append(f'<text x="{x + w/2}" y="{y + 42 + 16*i}" text-anchor="middle" fill="#333">{e(l)}</text>')
def label(x, y, text, anchor="middle", color="#222"):
    out.append(f'<text x="{x}" y="{y}" text-anchor="{anchor}" fill="{color}" paint-order="stroke" stroke="white" stroke-width="4">{e(text)}</text>')
def path(d, color="#555", dash=False, end=True, start=False):
    m = (f' marker-end="url(#a{color[1:]})"' if end else "") + (f' marker-start="url(#s{color[1:]})"' if start else "")
    dashed = ' stroke-dasharray="5 4"' if dash else ""
    out.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.6"{dashed}{m}/>')

colors = ["#555", "#1f77b4", "#2ca02c", "#d62728", "#9467bd"]
defs = "".join(
    f'<marker id="a{c[1:]}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
    f'<marker id="s{c[1:]}" viewBox="0 0 10 10" refX="1" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M10,0 L0,5 L10,10 z" fill="{c}"/></marker>'
    for c in colors)
# the run and the operator
box(250, 16, 480, 58, "AsyncGRPORun", ["spec: model, lora, trainer, rollout, sandboxes, adapterStore, data, reward"], "#f3f3f3", "#888")
path("M490,74 L490,112")
label(500, 98, "kubectl apply; the operator watches it", anchor="start", color="#555")
box(280, 112, 420, 74, "kopf operator", ["reconcile (pure builders), status, metrics; reads rank 0's", "/metrics, scales the pool from the gateway's demand"], "#eef3fb", "#5b7fb5")
# the children
xs, w, top, h = [20, 262, 504, 746], 214, 256, 118
path("M490,186 L490,214")
out.append(f'<path d="M{xs[0] + w/2},214 L{xs[3] + w/2},214" fill="none" stroke="#555" stroke-width="1.6"/>')
for x in xs:
    path(f"M{x + w/2},214 L{x + w/2},{top}")
label(700, 207, "creates and keeps (ownerReferences)", color="#555")
children = [
    ("trainer", ["StatefulSet, torchrun nodes", "TRL AsyncGRPOTrainer", "FSDP2 (+ expert parallel)", "tree packing; rollout worker"]),
    ("vLLM", ["Deployment + Service", "OpenAI API server", "S3 LoRA resolver plugin:", "loads policy-v{N} by name"]),
    ("sandbox gateway + pool", ["gateway Deployment leases", "warm sandbox pods to rollouts;", "execs go direct;", "the operator scales the pool"]),
    ("S3-compatible bucket", ["adapters/v{N}/ + manifest,", "weights/v{N}, checkpoints;", "set up and emptied by Jobs", "in the run's namespace"]),
]
fills = [("#fdf1e6", "#d08a3c"), ("#eaf5ea", "#4f9a4f"), ("#f5eefa", "#8b6bb0"), ("#fbeeee", "#c25b5b")]
for x, (t, ls), (f, s) in zip(xs, children, fills):
    box(x, top, w, h, t, ls, f, s)
bot = top + h
cx = [x + w/2 for x in xs]
# data flow, one lane per step of a training step
lanes = [
    (bot + 34, cx[0] - 60, cx[1] - 30, colors[1], "1  rollouts from policy-v{N}", True, (cx[0] + 20 + cx[1] - 30) / 2),
    (bot + 74, cx[0] - 20, cx[2], colors[2], "2  tool calls (lease, then exec)", True, (cx[1] + 30 + cx[2]) / 2),
    (bot + 114, cx[0] + 20, cx[3] - 30, colors[3], "3  publish adapter v{N+1} (files, manifest with sha256 last)", False, (cx[1] + 30 + cx[3] - 30) / 2),
    (bot + 154, cx[3] + 30, cx[1] + 30, colors[4], "4  vLLM resolves policy-v{N+1} from the bucket on first use", False, None),
]
for y, x1, x2, c, text, both, lx in lanes:
    path(f"M{x1},{bot} L{x1},{y} L{x2},{y} L{x2},{bot}", color=c, start=both)
    label(lx if lx else (x1 + x2) / 2, y - 6, text, color=c)
out.append(f'<text x="{W/2}" y="{H - 14}" text-anchor="middle" fill="#444">Between trainer and vLLM only HTTP and the bucket: no NCCL, no shared disk. Full fine-tuning: a puller sidecar in each vLLM pod swaps weights/v{{N}} in.</text>')
svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">'
       f'<defs>{defs}</defs><rect width="{W}" height="{H}" fill="white"/>' + "\n".join(out) + "</svg>\n")
from pathlib import Path

(Path(__file__).parent / "architecture.svg").write_text(svg)
