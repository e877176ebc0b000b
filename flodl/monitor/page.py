"""The dashboard page: one self-contained HTML document (inline CSS, JS, SVG).

`page.py` holds the page as a template string so it ships inside the
package. The same document serves both modes: live (served by
`dashboard.py`, it follows ``/events`` with EventSource) and archive
(written by `archive.py`, it reads an embedded
``<script type="application/json" id="flodl-data">`` block). It fetches
nothing external, so an archive opens offline. Charts are hand-written SVG.

DOM contract (tests and headless checks rely on it):
  * every chart is ``<div class="chart" id="chart-NAME">``; each drawn series
    is an SVG ``<path data-series="SERIES" data-points="COUNT">`` (COUNT is
    the number of data points, before any thinning for drawing);
  * per-rank series are named ``METRIC:RANK`` (``throughput:rank0``), RANK
    being the node path without its ``root/`` prefix;
  * events are ``<li data-class="CLASS" data-sev="SEV">`` in ``#events``,
    ranks are ``<tr data-path="PATH" data-alive="true|false">`` in ``#ranks``;
  * ``<body data-mode="live|archive" data-rendered="N" data-records="N">``,
    and ``data-errors="N"`` once a JS error was caught.
"""

from __future__ import annotations

THEMES = (None, "light", "dark", "auto")
THEME_LINE = "const ARCHIVE_THEME=null;"
DATA_MARKER = "<!--flodl-data-->"


def check_theme(theme: object) -> str | None:
    """``theme`` if it is a valid ``dashboard_theme``.

    Raises:
        ValueError: anything but None, "light", "dark" or "auto".
    """
    if theme not in THEMES or (theme is not None and not isinstance(theme, str)):
        raise ValueError(f"dashboard_theme must be None, 'light', 'dark' or 'auto', not {theme!r}")
    return theme  # type: ignore[return-value]


def embed_json(text: str) -> str:
    """Make a JSON text safe inside a ``<script>`` element.

    ``<`` only occurs inside JSON strings, where ``\\u003c`` means the same;
    escaping every one means no string can close the script (``</script>``)
    or open an HTML comment.
    """
    return text.replace("<", "\\u003c")


def render_page(*, theme: str | None = None, data_json: str | None = None) -> str:
    """The page, with the theme pinned and, for an archive, the data embedded.

    Raises:
        ValueError: ``theme`` is not a valid ``dashboard_theme``.
    """
    check_theme(theme)
    html = PAGE
    if theme is not None:
        html = html.replace(THEME_LINE, f'const ARCHIVE_THEME="{theme}";')
    block = ""
    if data_json is not None:
        block = f'<script type="application/json" id="flodl-data">{embed_json(data_json)}</script>'
    return html.replace(DATA_MARKER, block)


PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>flodl dashboard</title>
<style>
:root{--bg:#f3f5f9;--card:#fff;--fg:#1b2230;--muted:#677287;--grid:#eaedf2;--axis:#b7bdc8;
  --border:#e0e4eb;--accent:#2f6fec;--eval:#8e5bd8;--crit:#d33a44;--warn:#c27803;--ok:#16884a;
  --shadow:0 1px 2px rgba(16,24,40,.05),0 1px 3px rgba(16,24,40,.07);color-scheme:light}
@media (prefers-color-scheme:dark){:root:not([data-theme=light]){--bg:#0e1218;--card:#161b24;
  --fg:#e3e7ee;--muted:#8b95a7;--grid:#232a35;--axis:#3c4555;--border:#262d39;--accent:#6d9bff;
  --eval:#b996ff;--crit:#ff6b73;--warn:#f0b43c;--ok:#3ccf7e;--shadow:none;color-scheme:dark}}
:root[data-theme=dark]{--bg:#0e1218;--card:#161b24;--fg:#e3e7ee;--muted:#8b95a7;--grid:#232a35;
  --axis:#3c4555;--border:#262d39;--accent:#6d9bff;--eval:#b996ff;--crit:#ff6b73;--warn:#f0b43c;
  --ok:#3ccf7e;--shadow:none;color-scheme:dark}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
  font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
header.top{display:flex;align-items:center;gap:18px;padding:10px 20px;background:var(--card);
  border-bottom:1px solid var(--border);position:sticky;top:0;z-index:5}
.brand{display:flex;align-items:baseline;gap:10px;white-space:nowrap}
.logo{font-weight:700;font-size:18px;letter-spacing:-.01em}.logo i{color:var(--accent);font-style:normal}
.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
#run-id{color:var(--muted);font-size:12px}
.chips{display:flex;flex-wrap:wrap;gap:6px;flex:1}
.chip{border:1px solid var(--border);border-radius:999px;padding:1px 10px;font-size:12px;color:var(--muted);white-space:nowrap}
.chip b{color:var(--fg);font-weight:600}
.status{font-size:12px;white-space:nowrap;color:var(--muted)}
.status::before{content:"";display:inline-block;width:8px;height:8px;border-radius:50%;background:currentColor;margin-right:6px}
.status[data-state=live]{color:var(--ok)}.status[data-state=reconnecting],.status[data-state=connecting]{color:var(--warn)}
#theme-toggle{background:transparent;border:1px solid var(--border);color:var(--fg);border-radius:8px;
  padding:3px 10px;cursor:pointer;font:inherit}
#theme-toggle:hover{border-color:var(--axis)}
.tiles{display:grid;grid-template-columns:repeat(6,minmax(0,1fr));gap:12px;padding:14px 20px 0}
.tile{background:var(--card);border:1px solid var(--border);border-radius:10px;padding:9px 14px;box-shadow:var(--shadow);min-width:0}
.tile .k{font-size:10.5px;text-transform:uppercase;letter-spacing:.07em;color:var(--muted)}
.tile .v{font-size:21px;font-weight:650;font-variant-numeric:tabular-nums;margin-top:1px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.tile .s{font-size:11px;color:var(--muted);white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.tile.bad .v{color:var(--crit)}
.bar{height:4px;background:var(--grid);border-radius:2px;margin-top:5px;overflow:hidden}
.bar i{display:block;height:100%;background:var(--accent)}
main.grid{display:grid;grid-template-columns:repeat(3,minmax(0,1fr));gap:12px;padding:12px 20px 16px}
@media (max-width:1150px){main.grid{grid-template-columns:repeat(2,minmax(0,1fr))}.tiles{grid-template-columns:repeat(3,minmax(0,1fr))}}
@media (max-width:720px){main.grid{grid-template-columns:minmax(0,1fr)}.tiles{grid-template-columns:repeat(2,minmax(0,1fr))}}
.card{background:var(--card);border:1px solid var(--border);border-radius:10px;padding:10px 14px 10px;
  box-shadow:var(--shadow);position:relative;min-width:0}
.card h2{font-size:13px;font-weight:600;margin:0 0 4px;display:flex;justify-content:space-between;gap:8px}
.card h2 small{font-weight:400;color:var(--muted);font-size:11.5px}
.chart{position:relative;min-height:200px}
.chart svg{display:block;overflow:visible}
.chart .gl{stroke:var(--grid);stroke-width:1}
.chart .ax{stroke:var(--axis);stroke-width:1}
.chart text{fill:var(--muted);font-size:10.5px;font-variant-numeric:tabular-nums}
.chart text.ttl{font-size:11px}
.chart path.s{fill:none;stroke-linejoin:round;stroke-linecap:round}
.chart .mk{stroke-width:1;stroke-dasharray:3 3}
.chart .hover{stroke:var(--axis);stroke-width:1;visibility:hidden}
.chart:hover .hover{visibility:visible}
.legend{display:flex;flex-wrap:wrap;gap:2px 12px;font-size:11.5px;color:var(--muted);margin-top:2px}
.legend .sw{display:inline-block;width:12px;height:3px;border-radius:2px;margin-right:5px;vertical-align:middle}
.legend b{color:var(--fg);font-weight:600;font-variant-numeric:tabular-nums;margin-left:3px}
.legend .lost{text-decoration:line-through}
.empty{display:flex;align-items:center;justify-content:center;height:200px;color:var(--muted);font-size:12px}
.tip{position:absolute;pointer-events:none;background:var(--card);border:1px solid var(--border);border-radius:6px;
  padding:5px 8px;font-size:11px;box-shadow:0 4px 14px rgba(0,0,0,.16);white-space:nowrap;z-index:3;display:none}
.tip .sw{display:inline-block;width:8px;height:8px;border-radius:50%;margin-right:5px}
.scroll{max-height:222px;overflow:auto}
table{width:100%;border-collapse:collapse;font-size:12px;font-variant-numeric:tabular-nums}
th{text-align:left;font-weight:500;color:var(--muted);border-bottom:1px solid var(--border);padding:3px 6px;position:sticky;top:0;background:var(--card)}
td{padding:4px 6px;border-bottom:1px solid var(--grid);white-space:nowrap}
td .sw{display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:6px;vertical-align:-1px}
.st-alive{color:var(--ok)}.st-lost{color:var(--crit);font-weight:600}
tr[data-alive=false] td:not(.st-lost){color:var(--muted)}
ol#events{list-style:none;margin:0;padding:0}
#events li{display:grid;grid-template-columns:52px auto 1fr;align-items:baseline;gap:8px;padding:4px 2px;border-bottom:1px solid var(--grid);font-size:12px}
#events .when{color:var(--muted);font-variant-numeric:tabular-nums}
#events .what{overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.badge{font-size:10.5px;font-weight:600;padding:0 7px;border-radius:999px;border:1px solid currentColor;white-space:nowrap}
[data-sev=critical] .badge{color:var(--crit)}[data-sev=warn] .badge{color:var(--warn)}[data-sev=info] .badge{color:var(--accent)}
.muted{color:var(--muted)}
footer{padding:0 20px 14px;color:var(--muted);font-size:11px}
</style>
</head>
<body data-mode="live">
<script>
const ARCHIVE_THEME=null;
(function () {
  // Installed first, so a headless browser's DOM dump shows any JS error.
  let count = 0;
  function note(what) {
    count += 1;
    document.body.dataset.errors = String(count);
    document.body.dataset.lastError = String(what).slice(0, 300);
  }
  window.flodlNoteError = note;
  window.onerror = function (msg, src, line) { note(msg + " @" + line); };
  window.onunhandledrejection = function (ev) { note("unhandled rejection: " + (ev && ev.reason)); };
  const pinned = ARCHIVE_THEME === "light" || ARCHIVE_THEME === "dark" ? ARCHIVE_THEME : null;
  if (pinned) document.documentElement.dataset.theme = pinned;
})();
</script>
<header class="top">
  <div class="brand"><span class="logo">flo<i>dl</i></span><span id="run-id" class="mono"></span></div>
  <div id="run-info" class="chips"></div>
  <span id="status" class="status" data-state="connecting">connecting</span>
  <button id="theme-toggle" type="button" title="Switch between light and dark">&#9680; theme</button>
</header>
<section id="tiles" class="tiles"></section>
<main class="grid">
  <section class="card"><h2>Loss <small>by epoch &middot; thin: sub-epoch windows</small></h2><div class="chart" id="chart-loss"></div></section>
  <section class="card" data-optional="eval"><h2><span id="eval-title">Eval</span> <small>by epoch</small></h2><div class="chart" id="chart-eval"></div></section>
  <section class="card"><h2>Membership &amp; events <small id="events-note"></small></h2><div class="scroll"><ol id="events"></ol></div></section>
  <section class="card"><h2>Throughput <small>samples/s per rank &middot; dashed: total</small></h2><div class="chart" id="chart-throughput"></div></section>
  <section class="card"><h2>Batch share <small>fraction of the samples per rank</small></h2><div class="chart" id="chart-batch-share"></div></section>
  <section class="card"><h2>Ranks <small id="ranks-note"></small></h2><div class="scroll"><table id="ranks"><thead><tr>
    <th>rank</th><th>dev</th><th>state</th><th>samples/s</th><th>share</th><th>loss</th><th>starve</th></tr></thead><tbody></tbody></table></div></section>
  <section class="card" data-optional="sync"><h2>Anchor &amp; syncs <small>dashed: syncs (right axis)</small></h2><div class="chart" id="chart-sync"></div></section>
  <section class="card"><h2>Data starvation <small>per rank</small></h2><div class="chart" id="chart-starve"></div></section>
  <section class="card" data-optional="cache"><h2>Sample cache <small>share served by the staging tiers</small></h2><div class="chart" id="chart-cache"></div></section>
  <section class="card" data-optional="gpu"><h2>GPU utilisation <small>% per rank</small></h2><div class="chart" id="chart-gpu"></div></section>
  <section class="card" data-optional="vram"><h2>VRAM allocated <small>GiB per rank &middot; axis top: VRAM size</small></h2><div class="chart" id="chart-vram"></div></section>
  <section class="card" data-optional="cpu"><h2>Host CPU <small>% per rank</small></h2><div class="chart" id="chart-cpu"></div></section>
  <section class="card" data-optional="rss"><h2>Host memory <small>RSS GiB per rank</small></h2><div class="chart" id="chart-rss"></div></section>
</main>
<footer id="footer"></footer>
<!--flodl-data-->
<script>
"use strict";
(function () {
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"];
const MAX_PER_PATH = 5000, MAX_EVENTS = 2000, MAX_DRAWN = 1200, H = 200;
const GIB = 1024 * 1024 * 1024;
const M = {l: 50, r: 14, t: 10, b: 34};
const state = {meta: null, nodes: new Map(), events: [], t0: null, records: 0, conn: "connecting", mode: "live"};

// ---------------------------------------------------------------- helpers
const $ = (id) => document.getElementById(id);
const ESC = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
const num = (v) => (typeof v === "number" && isFinite(v) ? v : null);
const natural = (a, b) => a.localeCompare(b, undefined, {numeric: true});
const parentOf = (p) => { const i = p.lastIndexOf("/"); return i < 0 ? null : p.slice(0, i); };
const rankLabel = (p) => (p.startsWith("root/") ? p.slice(5) : p);
const metric = (r, k) => num(r.metrics && r.metrics[k]);
const res = (r, k) => num(r.res && r.res[k]);
const recsOf = (p) => state.nodes.get(p) || [];
const isTick = (r) => num(r.tick) !== null && !r.epoch_complete;
const run = () => (state.meta && state.meta.run) || {};

function fmt(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
  if (a >= 100 || v === 0) return String(Math.round(v));
  return String(+v.toPrecision(3));
}
const pct = (v) => (v === null ? "–" : +(v * 100).toPrecision(3) + "%");

function clock(seconds) {
  const s = Math.max(0, Math.round(seconds)), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  const ss = String(s % 60).padStart(2, "0");
  return h ? h + ":" + String(m).padStart(2, "0") + ":" + ss : m + ":" + ss;
}

// ---------------------------------------------------------------- state
function reset() {
  state.meta = null; state.nodes = new Map(); state.events = []; state.t0 = null; state.records = 0;
}

function ingest(r) {
  if (!r || typeof r !== "object") return;
  state.records += 1;
  if (r.kind === "meta") state.meta = r;
  else if (r.kind === "event") { state.events.push(r); if (state.events.length > MAX_EVENTS) state.events.shift(); }
  else if (typeof r.path === "string") {
    let ring = state.nodes.get(r.path);
    if (!ring) { ring = []; state.nodes.set(r.path, ring); }
    ring.push(r);
    if (ring.length > MAX_PER_PATH) ring.splice(0, ring.length - MAX_PER_PATH);
  }
  const ts = num(r.ts);
  if (ts !== null && (state.t0 === null || ts < state.t0)) state.t0 = ts;
}

function leaves() {
  const paths = [...state.nodes.keys()];
  const parents = new Set(paths.map(parentOf).filter(Boolean));
  const ls = paths.filter((p) => p !== "root" && !parents.has(p)).sort(natural);
  return ls.length ? ls : paths.filter((p) => p === "root");
}

function lastTs() {
  let t = state.t0 || 0;
  for (const ring of state.nodes.values()) if (ring.length) t = Math.max(t, num(ring[ring.length - 1].ts) || 0);
  for (const e of state.events) t = Math.max(t, num(e.ts) || 0);
  return t;
}

function latestWith(path, pick) {
  const ring = recsOf(path);
  for (let i = ring.length - 1; i >= 0; i--) { const v = pick(ring[i]); if (v !== null) return v; }
  return null;
}

function alive(path) {
  const ring = recsOf(path);
  return !ring.length || ring[ring.length - 1].alive !== false;
}

// ---------------------------------------------------------------- x axes
function timeUnit() {
  const span = (lastTs() - (state.t0 || 0)) / 1000;
  if (span > 3 * 3600) return {div: 3600, name: "h"};
  if (span > 180) return {div: 60, name: "min"};
  return {div: 1, name: "s"};
}
const timeX = (r, tu) => (num(r.ts) === null ? null : (r.ts - state.t0) / 1000 / tu.div);

// Sub-epoch windows sit at epoch + k/R (R = reports per epoch). Producers
// number windows within the epoch (1..R) or across the run, so a tick is
// taken as k only when the epoch's ticks all fit 1..R in order; otherwise k
// is the window's ordinal within its epoch.
function windowXs(recs) {
  const byEpoch = new Map();
  for (const r of recs) {
    if (!isTick(r) || num(r.epoch) === null) continue;
    if (!byEpoch.has(r.epoch)) byEpoch.set(r.epoch, []);
    byEpoch.get(r.epoch).push(r);
  }
  let R = num(run().reports_per_epoch) || 0;
  if (!R) for (const g of byEpoch.values()) R = Math.max(R, g.length);
  const xs = new Map();
  for (const [e, g] of byEpoch) {
    const fits = g.every((r, i) => r.tick >= 1 && r.tick <= R && (i === 0 || r.tick > g[i - 1].tick));
    g.forEach((r, i) => xs.set(r, e + Math.min(1, (fits ? r.tick : i + 1) / R)));
  }
  return xs;
}
function epochX(r, xs) {
  const e = num(r.epoch);
  if (e === null) return null;
  if (!isTick(r)) return e + 1;  // a completed epoch e (0-based) plots at its end
  return xs.has(r) ? xs.get(r) : null;
}

// A time series takes a path's sub-epoch windows when they carry the value
// (epoch averages would zig-zag against window values), else every record
// that does (some keys, like anchor and syncs, ride on epoch records only).
function timePoints(path, pick, tu) {
  const ring = recsOf(path), xOf = (r) => timeX(r, tu);
  const windows = points(ring.filter(isTick), xOf, pick);
  return windows.length ? windows : points(ring, xOf, pick);
}

function points(recs, xOf, yOf) {
  const pts = [];
  for (const r of recs) { const x = xOf(r), y = yOf(r); if (x !== null && y !== null) pts.push([x, y]); }
  return pts.sort((a, b) => a[0] - b[0]);
}

// ---------------------------------------------------------------- charts
function niceStep(span, n) {
  const raw = span / n, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
}
function scale(lo, hi, n, nice, integer) {
  if (!(hi > lo)) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
  let step = niceStep(hi - lo, n);
  if (integer) step = Math.max(1, Math.round(step));
  if (nice) { lo = Math.floor(lo / step) * step; hi = Math.ceil(hi / step) * step; }
  const ticks = [];
  for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) ticks.push(+v.toPrecision(12));
  return {lo, hi, ticks};
}

// Keep the min and the max of each bucket: spikes survive thinning.
function thin(pts) {
  if (pts.length <= MAX_DRAWN) return pts;
  const per = Math.ceil(pts.length / (MAX_DRAWN / 2)), out = [];
  for (let i = 0; i < pts.length; i += per) {
    let lo = pts[i], hi = pts[i];
    for (let j = i; j < Math.min(i + per, pts.length); j++) {
      if (pts[j][1] < lo[1]) lo = pts[j];
      if (pts[j][1] > hi[1]) hi = pts[j];
    }
    if (lo === hi) out.push(lo); else if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo);
  }
  if (out[out.length - 1] !== pts[pts.length - 1]) out.push(pts[pts.length - 1]);
  return out;
}

function yRange(series, axis, spec) {
  let lo = Infinity, hi = -Infinity;
  for (const s of series) if ((s.axis || "left") === axis) for (const p of s.pts) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); }
  if (lo === Infinity) return null;
  if (axis === "left" && spec.yMin !== undefined) lo = Math.min(lo, spec.yMin);
  if (axis === "left" && spec.yMax !== undefined) hi = Math.max(hi, spec.yMax);
  if (axis === "right") lo = Math.min(lo, 0);
  return scale(lo, hi, 4, true, false);
}

function svgText(x, y, text, anchor, cls, extra) {
  return '<text x="' + x.toFixed(1) + '" y="' + y.toFixed(1) + '" text-anchor="' + anchor + '"' +
    (cls ? ' class="' + cls + '"' : "") + (extra || "") + ">" + esc(text) + "</text>";
}

function pathD(pts, sx, sy) {
  let d = "";
  pts.forEach((p, i) => { d += (i ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1); });
  return pts.length === 1 ? d + "h0.01" : d;  // a lone point still shows as a round dot
}

function drawChart(id, spec) {
  const el = $(id);
  if (!el) return false;
  const series = spec.series.filter((s) => s.pts.length);
  el.dataset.drawn = String(series.length);
  if (!series.length) { el.innerHTML = '<div class="empty">' + esc(spec.empty || "no data yet") + "</div>"; el._geo = null; return false; }
  const W = Math.max(260, el.clientWidth || 420);
  const right = series.some((s) => s.axis === "right");
  const m = {l: M.l, r: right ? 46 : M.r, t: M.t, b: M.b};
  let x0 = Infinity, x1 = -Infinity;
  for (const s of series) for (const p of s.pts) { x0 = Math.min(x0, p[0]); x1 = Math.max(x1, p[0]); }
  if (spec.xMin !== undefined) x0 = Math.min(x0, spec.xMin);
  if (spec.xMax !== undefined) x1 = Math.max(x1, spec.xMax);
  const xs = scale(x0, x1, Math.max(3, Math.floor(W / 90)), false, spec.integerX);
  const yl = yRange(series, "left", spec) || scale(0, 1, 4, true), yr = right ? yRange(series, "right", spec) : null;
  const pw = W - m.l - m.r, ph = H - m.t - m.b;
  const sx = (x) => m.l + ((x - xs.lo) / (xs.hi - xs.lo)) * pw;
  const syOf = (sc) => (y) => m.t + ph - ((y - sc.lo) / (sc.hi - sc.lo)) * ph;
  const out = ['<svg width="' + W + '" height="' + H + '" viewBox="0 0 ' + W + " " + H + '">'];
  const yFmt = spec.yFmt || fmt, xFmt = spec.xFmt || fmt;
  for (const t of yl.ticks) {
    const y = syOf(yl)(t);
    out.push('<line class="gl" x1="' + m.l + '" x2="' + (W - m.r) + '" y1="' + y.toFixed(1) + '" y2="' + y.toFixed(1) + '"/>');
    out.push(svgText(m.l - 6, y + 3.5, yFmt(t), "end"));
  }
  if (yr) for (const t of yr.ticks) out.push(svgText(W - m.r + 6, syOf(yr)(t) + 3.5, (spec.y2Fmt || fmt)(t), "start"));
  for (const t of xs.ticks) out.push(svgText(sx(t), H - m.b + 14, xFmt(t), "middle"));
  out.push('<line class="ax" x1="' + m.l + '" x2="' + (W - m.r) + '" y1="' + (H - m.b) + '" y2="' + (H - m.b) + '"/>');
  out.push(svgText(m.l + pw / 2, H - 4, spec.xLabel || "", "middle", "ttl"));
  out.push(svgText(12, m.t + ph / 2, spec.yLabel || "", "middle", "ttl", ' transform="rotate(-90 12 ' + (m.t + ph / 2).toFixed(1) + ')"'));
  for (const mk of spec.markers || []) {
    if (mk.x < xs.lo || mk.x > xs.hi) continue;
    const x = sx(mk.x).toFixed(1);
    out.push('<line class="mk" style="stroke:' + mk.color + '" x1="' + x + '" x2="' + x + '" y1="' + m.t + '" y2="' + (H - m.b) + '"><title>' + esc(mk.title) + "</title></line>");
    const flip = +x > W - m.r - 60;  // near the right edge: label on the left of the rule
    if (mk.label) out.push(svgText(+x + (flip ? -3 : 3), m.t + 9, mk.label, flip ? "end" : "start", "", ' style="fill:' + mk.color + '"'));
  }
  for (const s of series) {
    const sy = syOf(s.axis === "right" ? yr : yl), drawn = thin(s.pts);
    out.push('<path class="s" data-series="' + esc(s.name) + '" data-points="' + s.pts.length + '" style="stroke:' + s.color +
      ";stroke-width:" + (s.width || 1.8) + (s.dash ? ";stroke-dasharray:" + s.dash : "") + (s.opacity ? ";opacity:" + s.opacity : "") +
      '" d="' + pathD(drawn, sx, sy) + '"/>');
    if (s.dots && s.pts.length <= 60) for (const p of s.pts) out.push('<circle r="2.6" cx="' + sx(p[0]).toFixed(1) + '" cy="' + sy(p[1]).toFixed(1) + '" style="fill:' + s.color + '"/>');
  }
  out.push('<line class="hover" y1="' + m.t + '" y2="' + (H - m.b) + '" x1="-9" x2="-9"/></svg>');
  out.push(legend(series, spec), '<div class="tip"></div>');
  el.innerHTML = out.join("");
  el._geo = {series, sx, xs, pw, m, xFmt, yFmt, y2Fmt: spec.y2Fmt || fmt, xName: spec.xLabel || "x"};
  hookHover(el);
  return true;
}

function legend(series, spec) {
  const items = series.filter((s) => !s.noLegend).map((s) => {
    const last = s.pts[s.pts.length - 1][1];
    const f = s.axis === "right" ? spec.y2Fmt || fmt : spec.yFmt || fmt;
    return '<span class="' + (s.lost ? "lost" : "") + '"><span class="sw" style="background:' + s.color + '"></span>' +
      esc(s.label) + "<b>" + esc(f(last)) + "</b></span>";
  });
  return '<div class="legend">' + items.join("") + "</div>";
}

// Hover: a vertical rule and each series' nearest value.
function hookHover(el) {
  if (el.dataset.hover) return;
  el.dataset.hover = "1";
  el.addEventListener("mousemove", (ev) => showTip(el, ev));
  el.addEventListener("mouseleave", () => { const t = el.querySelector(".tip"); if (t) t.style.display = "none"; });
}

function nearest(pts, x) {
  let lo = 0, hi = pts.length - 1;
  while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (pts[mid][0] < x) lo = mid; else hi = mid; }
  return Math.abs(pts[lo][0] - x) <= Math.abs(pts[hi][0] - x) ? pts[lo] : pts[hi];
}

function showTip(el, ev) {
  const g = el._geo, tip = el.querySelector(".tip"), rule = el.querySelector("line.hover");
  if (!g || !tip || !rule) return;
  const box = el.getBoundingClientRect(), px = ev.clientX - box.left;
  if (px < g.m.l || px > g.m.l + g.pw) { tip.style.display = "none"; return; }
  const x = g.xs.lo + ((px - g.m.l) / g.pw) * (g.xs.hi - g.xs.lo);
  const rows = g.series.map((s) => {
    const p = nearest(s.pts, x), f = s.axis === "right" ? g.y2Fmt : g.yFmt;
    return '<div><span class="sw" style="background:' + s.color + '"></span>' + esc(s.label) + " <b>" + esc(f(p[1])) + "</b></div>";
  });
  tip.innerHTML = '<div class="muted">' + esc(g.xName) + " " + esc(g.xFmt(x)) + "</div>" + rows.join("");
  tip.style.display = "block";
  tip.style.left = Math.min(px + 12, box.width - tip.offsetWidth - 4) + "px";
  tip.style.top = "8px";
  rule.setAttribute("x1", px); rule.setAttribute("x2", px);
}

// ---------------------------------------------------------------- chart specs
function markers(kind, tu) {
  const out = [], g = windowXs(recsOf("root"));
  for (const e of state.events) {
    const cls = e["class"], color = cls === "rank_lost" ? "var(--crit)" : cls === "rank_joined" ? "var(--ok)" : null;
    if (!color || num(e.ts) === null) continue;
    const x = kind === "time" ? timeX(e, tu) : epochAt(e.ts, g);
    if (x === null) continue;
    const who = rankLabel(e.path || "");
    out.push({x, color, title: cls + " " + who + ": " + (e.detail || ""), label: (cls === "rank_lost" ? "✕ " : "+ ") + who});
  }
  return out;
}

function epochAt(ts, g) {
  let x = null;
  for (const r of recsOf("root")) if (num(r.ts) !== null && r.ts <= ts) { const e = epochX(r, g); if (e !== null) x = e; }
  return x;
}

// Gauges (resources) are samples, not window aggregates: every record counts.
function perRank(ls, key, pick, tu, gauge) {
  return ls.map((p, i) => ({
    name: key + ":" + rankLabel(p), label: rankLabel(p), color: PALETTE[i % PALETTE.length], lost: !alive(p),
    pts: gauge ? points(recsOf(p), (r) => timeX(r, tu), pick) : timePoints(p, pick, tu),
  }));
}

function renderCharts() {
  const ls = leaves(), tu = timeUnit(), root = recsOf("root"), g = windowXs(root);
  const epochs = num(run().epochs) || undefined;
  const ep = {xLabel: "epoch", integerX: true, xMin: 0, xMax: epochs, markers: markers("epoch", tu)};
  const tm = {xLabel: "time (" + tu.name + ")", xMin: 0, markers: markers("time", tu)};
  const shown = {};
  drawChart("chart-loss", Object.assign({yLabel: "loss", series: [
    {name: "loss-window", label: "window", color: "var(--accent)", width: 1.1, opacity: 0.45, pts: points(root.filter(isTick), (r) => epochX(r, g), (r) => metric(r, "loss"))},
    {name: "loss", label: "epoch", color: "var(--accent)", width: 2.2, dots: true, pts: points(root.filter((r) => !isTick(r)), (r) => epochX(r, g), (r) => metric(r, "loss"))},
  ]}, ep));
  const evalName = run().eval_metric || "eval";
  $("eval-title").textContent = "Eval: " + evalName;
  shown.eval = drawChart("chart-eval", Object.assign({yLabel: evalName, empty: run().eval_metric ? "no eval yet" : "no eval metric", series: [
    {name: "eval", label: evalName, color: "var(--eval)", width: 2.2, dots: true, pts: points(root.filter((r) => !isTick(r)), (r) => epochX(r, g), (r) => metric(r, "eval"))},
  ]}, ep)) || !!run().eval_metric;
  const multi = ls.length > 1 || ls[0] !== "root";
  const total = multi ? [{name: "throughput:total", label: "total", color: "var(--fg)", width: 1.4, dash: "5 4", pts: timePoints("root", (r) => metric(r, "throughput"), tu)}] : [];
  drawChart("chart-throughput", Object.assign({yLabel: "samples/s", yMin: 0, series: perRank(ls, "throughput", (r) => metric(r, "throughput"), tu).concat(total)}, tm));
  drawChart("chart-batch-share", Object.assign({yLabel: "share", yMin: 0, yFmt: pct, series: perRank(ls, "batch_share", (r) => metric(r, "batch_share"), tu)}, tm));
  shown.sync = drawChart("chart-sync", Object.assign({yLabel: "anchor", y2Fmt: fmt, yMin: 0, series: [
    {name: "anchor", label: "anchor", color: "var(--accent)", width: 2, pts: timePoints("root", (r) => metric(r, "anchor"), tu)},
    {name: "syncs", label: "syncs", color: "#f28e2b", width: 1.6, dash: "5 4", axis: "right", pts: timePoints("root", (r) => metric(r, "syncs"), tu)},
  ]}, tm));
  drawChart("chart-starve", Object.assign({yLabel: "data starvation", yMin: 0, series: perRank(ls, "data_starve", (r) => metric(r, "data_starve"), tu)}, tm));
  renderResources(ls, tu, tm, shown);
  for (const card of document.querySelectorAll("[data-optional]")) card.hidden = !shown[card.dataset.optional];
}

function renderResources(ls, tu, tm, shown) {
  let vramTotal = 0;
  for (const p of ls) vramTotal = Math.max(vramTotal, latestWith(p, (r) => res(r, "vram_total")) || 0);
  shown.gpu = drawChart("chart-gpu", Object.assign({yLabel: "GPU %", yMin: 0, series: perRank(ls, "gpu_util", (r) => res(r, "gpu_util"), tu, true)}, tm));
  shown.vram = drawChart("chart-vram", Object.assign({yLabel: "GiB", yMin: 0, yMax: vramTotal ? vramTotal / GIB : undefined,
    series: perRank(ls, "vram", (r) => { const v = res(r, "vram_alloc"); return v === null ? null : v / GIB; }, tu, true)}, tm));
  shown.cache = drawChart("chart-cache", Object.assign({yLabel: "hit rate", yMin: 0, yMax: 1, yFmt: pct,
    series: perRank(ls, "cache_hit_rate", (r) => metric(r, "cache_hit_rate"), tu)}, tm));
  shown.cpu = drawChart("chart-cpu", Object.assign({yLabel: "CPU %", yMin: 0, series: perRank(ls, "cpu_util", (r) => res(r, "cpu_util"), tu, true)}, tm));
  shown.rss = drawChart("chart-rss", Object.assign({yLabel: "GiB", yMin: 0,
    series: perRank(ls, "rss", (r) => { const v = res(r, "rss_bytes"); return v === null ? null : v / GIB; }, tu, true)}, tm));
}

// ---------------------------------------------------------------- header, tiles, tables
function renderHeader() {
  const r = run();
  $("run-id").textContent = r.run_id || "";
  const chips = [["mode", r.mode], ["task", r.task], ["world", r.world_size], ["epochs", r.epochs],
    ["samples", r.dataset_len !== undefined && r.dataset_len !== null ? fmt(r.dataset_len) : null], ["batch", r.batch_size], ["eval", r.eval_metric]];
  $("run-info").innerHTML = chips.filter((c) => c[1] !== undefined && c[1] !== null && c[1] !== "")
    .map((c) => '<span class="chip">' + esc(c[0]) + " <b>" + esc(c[1]) + "</b></span>").join("");
  const st = $("status");
  st.dataset.state = state.mode === "archive" ? "archive" : state.conn;
  st.textContent = state.mode === "archive" ? "archive" : state.conn;
  if (r.run_id) document.title = "flodl · " + r.run_id;
}

function tile(key, value, sub, extra) {
  return '<div class="tile' + (extra && extra.bad ? " bad" : "") + '"><div class="k">' + esc(key) + '</div><div class="v">' + esc(value) +
    '</div><div class="s">' + esc(sub || "\u00a0") + "</div>" + (extra && extra.bar !== undefined ? '<div class="bar"><i style="width:' + (100 * extra.bar).toFixed(1) + '%"></i></div>' : "") + "</div>";
}

function renderTiles() {
  const r = run(), ls = leaves(), root = recsOf("root");
  let done = 0;
  for (const rec of root) if (rec.epoch_complete && num(rec.epoch) !== null) done = Math.max(done, rec.epoch + 1);
  const epochs = num(r.epochs);
  const loss = latestWith("root", (x) => metric(x, "loss"));
  const ev = latestWith("root", (x) => (isTick(x) ? null : metric(x, "eval")));
  const tput = latestWith("root", (x) => metric(x, "throughput"));
  const up = ls.filter(alive).length;
  const alerts = state.events.filter((e) => e.sev === "critical" || e.sev === "warn").length;
  $("tiles").innerHTML = [
    tile("epoch", done + (epochs ? " / " + epochs : ""), epochs ? pct(done / epochs) + " done" : "", {bar: epochs ? Math.min(1, done / epochs) : undefined}),
    tile("loss", fmt(loss), "latest report"),
    tile(r.eval_metric || "eval", fmt(ev), "latest epoch"),
    tile("throughput", fmt(tput), "samples/s, all ranks"),
    tile("ranks alive", up + " / " + (num(r.world_size) || ls.length), ls.length - up ? ls.length - up + " lost" : "all healthy", {bad: up < ls.length}),
    tile("alerts", String(alerts), alerts ? "warn + critical" : "none", {bad: alerts > 0}),
  ].join("");
}

function renderRanks() {
  const ls = leaves();
  const rows = ls.map((p, i) => {
    const up = alive(p), last = recsOf(p)[recsOf(p).length - 1] || {};
    const cell = (k, f) => "<td>" + esc((f || fmt)(latestWith(p, (r) => metric(r, k)))) + "</td>";
    return '<tr data-path="' + esc(p) + '" data-alive="' + up + '"><td><span class="sw" style="background:' + PALETTE[i % PALETTE.length] + '"></span>' +
      esc(rankLabel(p)) + "</td><td>" + esc(last.device === undefined ? "–" : last.device) + '</td><td class="' + (up ? "st-alive" : "st-lost") + '">' +
      (up ? "alive" : "lost") + "</td>" + cell("throughput") + cell("batch_share", pct) + cell("loss") + cell("data_starve") + "</tr>";
  });
  document.querySelector("#ranks tbody").innerHTML = rows.join("");
  $("ranks-note").textContent = ls.length + " rank" + (ls.length === 1 ? "" : "s");
}

function renderEvents() {
  const hiddenSync = state.events.filter((e) => e["class"] === "sync").length;
  const shown = state.events.filter((e) => e["class"] !== "sync").slice(-200).reverse();
  $("events").innerHTML = shown.length ? shown.map((e) => {
    const when = num(e.ts) !== null ? clock((e.ts - state.t0) / 1000) : "";
    const abs = num(e.ts) !== null ? new Date(e.ts).toISOString() : "";
    const count = num(e.count) > 1 ? ' <span class="muted">×' + e.count + "</span>" : "";
    return '<li data-class="' + esc(e["class"] || "") + '" data-sev="' + esc(e.sev || "info") + '"><span class="when" title="' + esc(abs) + '">' + when +
      '</span><span class="badge">' + esc((e["class"] || "event").replace(/_/g, " ")) + '</span><span class="what" title="' + esc(e.detail || "") + '"><b>' +
      esc(rankLabel(e.path || "")) + "</b> " + esc(e.detail || "") + count + "</span></li>";
  }).join("") : '<li class="muted" data-class="none">no events yet</li>';
  $("events-note").textContent = hiddenSync ? hiddenSync + " sync events not listed" : state.events.length + " total";
}

function renderFooter() {
  const saved = lastTs();
  $("footer").textContent = state.records + " records" + (saved ? " · last " + new Date(saved).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "") +
    (state.mode === "archive" ? " · archived dashboard, no server needed" : "");
}

// ---------------------------------------------------------------- drawing loop
function guard(name, fn) {
  try { fn(); } catch (err) { console.error("flodl dashboard: " + name + ": " + (err && err.stack || err)); window.flodlNoteError(name + ": " + err); }
}

function render() {
  guard("header", renderHeader); guard("tiles", renderTiles); guard("charts", renderCharts);
  guard("ranks", renderRanks); guard("events", renderEvents); guard("footer", renderFooter);
  document.body.dataset.records = String(state.records);
  document.body.dataset.rendered = String((+document.body.dataset.rendered || 0) + 1);
}

// Redraw at most a few times a second, on an animation frame when there is
// one (a hidden tab has none; the timeout fallback still keeps it current).
let pending = false, lastDraw = 0;
function flush() { if (!pending) return; pending = false; lastDraw = Date.now(); render(); }
function schedule() {
  if (pending) return;
  pending = true;
  setTimeout(() => { requestAnimationFrame(flush); setTimeout(flush, 500); }, Math.max(0, 250 - (Date.now() - lastDraw)));
}

function toggleTheme() {
  const root = document.documentElement;
  const dark = root.dataset.theme ? root.dataset.theme === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
  root.dataset.theme = dark ? "light" : "dark";
  schedule();
}

function connect() {
  const es = new EventSource("events");
  es.onopen = () => { reset(); state.conn = "live"; schedule(); };  // the server replays everything on (re)connect
  es.onmessage = (ev) => {
    let rec;
    try { rec = JSON.parse(ev.data); } catch (err) { document.body.dataset.badRecords = String((+document.body.dataset.badRecords || 0) + 1); return; }
    ingest(rec); schedule();
  };
  es.onerror = () => {
    state.conn = "reconnecting"; schedule();
    if (es.readyState === 2) setTimeout(connect, 5000);  // CLOSED: the browser gave up, try again ourselves
  };
}

function start() {
  $("theme-toggle").addEventListener("click", toggleTheme);
  window.addEventListener("resize", schedule);
  const blob = $("flodl-data");
  if (blob) {
    state.mode = "archive";
    document.body.dataset.mode = "archive";
    const data = JSON.parse(blob.textContent);
    for (const r of Array.isArray(data) ? data : data.records || []) ingest(r);
    render();
  } else {
    render();
    connect();
  }
}
start();
})();
</script>
</body>
</html>
"""
