// tiercache ui: fetches the JSON endpoints (docs/ui.md) and draws them; no framework, no build step.
"use strict";

const NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const state = { refreshMs: 2000, selected: null, timer: null, lineage: null };

// ------------------------------------------------------------------ small helpers

function el(tag, attrs, ...kids) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const kid of kids) node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  return node;
}

function svgEl(tag, attrs, ...kids) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const kid of kids) node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  return node;
}

function table(target, head, rows) {
  target.replaceChildren(el("tr", {}, ...head.map((h) => el("th", { class: h.num ? "num" : null }, h.label ?? h))));
  for (const row of rows) target.append(row);
}

function bytes(n) {
  if (n === null || n === undefined) return "-";
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n, i = -1;
  do { v /= 1024; i++; } while (v >= 1024 && i < units.length - 1);
  return `${v.toFixed(1)} ${units[i]}`;
}

function rate(bps) { return bps ? `${bytes(Math.round(bps))}/s` : "-"; }

function dur(s) {
  if (s === null || s === undefined || !isFinite(s)) return "-";
  if (s < 60) return s < 10 ? `${s.toFixed(2)} s` : `${s.toFixed(1)} s`;
  const w = Math.round(s);
  for (const [big, small, a, b] of [[86400, 3600, "d", "h"], [3600, 60, "h", "m"], [60, 1, "m", "s"]]) {
    if (w >= big) return `${Math.floor(w / big)}${a} ${String(Math.floor((w % big) / small)).padStart(2, "0")}${b}`;
  }
  return `${w} s`;
}

function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString() : "-"; }
function pct(x) { return x === null || x === undefined ? "-" : `${(100 * x).toFixed(2)} %`; }

async function getJSON(path) {
  const res = await fetch(path, { credentials: "same-origin", cache: "no-store" });
  if (!res.ok) {
    let why = `HTTP ${res.status}`;
    try { why = (await res.json()).error || why; } catch (e) { /* not JSON */ }
    throw new Error(`${path}: ${why}`);
  }
  return res.json();
}

// ------------------------------------------------------------------ charts

// series: [{name, points: [[x, y], ...]}]; opts: {x: "time"|"log", yFmt, xFmt, markers: [{x, label}], yMin, yMax,
// steps: each value holds until the next point (a lag does not slide between two events)}
function lineChart(svg, series, opts) {
  const W = svg.clientWidth || 560, H = svg.clientHeight || 190;
  const m = { l: 64, r: 10, t: 18, b: 22 };
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) {
    svg.append(svgEl("text", { x: m.l, y: H / 2 }, opts.empty || "nothing measured yet"));
    return;
  }
  const fx = opts.x === "log" ? Math.log : (v) => v;
  const xs = pts.map((p) => fx(p[0]));
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const y1 = opts.yMax ?? Math.max(...pts.map((p) => p[1]), 1e-9) * 1.1;
  const y0 = opts.yMin ?? 0;
  const X = (v) => m.l + ((fx(v) - x0) / (x1 - x0)) * (W - m.l - m.r);
  const Y = (v) => H - m.b - ((v - y0) / (y1 - y0 || 1)) * (H - m.t - m.b);
  svg.append(svgEl("line", { class: "axis", x1: m.l, y1: H - m.b, x2: W - m.r, y2: H - m.b }));
  svg.append(svgEl("line", { class: "axis", x1: m.l, y1: m.t, x2: m.l, y2: H - m.b }));
  for (let i = 0; i <= 3; i++) {
    const v = y0 + ((y1 - y0) * i) / 3;
    svg.append(svgEl("text", { x: m.l - 4, y: Y(v) + 3, "text-anchor": "end" }, opts.yFmt(v)));
  }
  for (let i = 0; i <= 3; i++) {
    const fv = x0 + ((x1 - x0) * i) / 3;
    const v = opts.x === "log" ? Math.exp(fv) : fv;
    svg.append(svgEl("text", { x: X(v), y: H - 6, "text-anchor": "middle" }, opts.xFmt(v)));
  }
  series.forEach((s, i) => {
    const c = `c${i % 6}`;
    if (s.points.length > 1) {
      const line = opts.steps ? s.points.flatMap((p, j) => (j ? [[p[0], s.points[j - 1][1]], p] : [p])) : s.points;
      svg.append(svgEl("polyline", { class: `series ${c}`, points: line.map((p) => `${X(p[0])},${Y(p[1])}`).join(" ") }));
    }
    for (const p of s.points.length <= 64 ? s.points : []) svg.append(svgEl("circle", { class: `dot ${c}`, cx: X(p[0]), cy: Y(p[1]), r: 2.2 }));
    svg.append(svgEl("text", { x: m.l + 6 + i * 110, y: 11, class: c, stroke: "none" }, s.name));
  });
  for (const mk of opts.markers || []) {
    if (!(mk.x > 0)) continue;
    const x = X(mk.x);
    svg.append(svgEl("line", { class: `marker ${mk.cls || "c5"}`, x1: x, y1: m.t, x2: x, y2: H - m.b }));
    svg.append(svgEl("text", { class: "marker-label", x: x + 3, y: m.t + 10 + (mk.row || 0) * 11 }, mk.label));
  }
}

// ------------------------------------------------------------------ sections

function renderOverview(ov) {
  $("summary").textContent = `tiers ${ov.tiers.join(" → ")} · policy ${ov.policy} · ${ov.versions} versions, ` +
    `${ov.branches} branches, ${ov.tags} tags`;
  const t = ov.trainer, pill = $("trainer");
  if (!t) { pill.textContent = "no saving process has published a status"; pill.className = "pill"; }
  else if (t.writer === "agent") {
    // The agent publishes for the trainers of its node and outlives them: its pid is no trainer's.
    const last = t.staged ? `, last save ${dur(ov.generated_at - t.staged.at)} ago` : "";
    if (t.trainers.length) {
      pill.textContent = `trainer pid ${t.trainers.join(", ")}: saving through node agent pid ${t.pid}` +
        `, status ${dur(t.age_s)} old`;
      pill.className = "pill live";
    } else {
      pill.textContent = `no trainer connected: status from node agent pid ${t.pid}` +
        (t.closed ? `, closed ${dur(t.age_s)} ago` : "") + last;
      pill.className = "pill closed";
    }
  }
  else if (t.closed) { pill.textContent = `trainer pid ${t.pid}: closed ${dur(t.age_s)} ago`; pill.className = "pill closed"; }
  else { pill.textContent = `trainer pid ${t.pid}: live, status ${dur(t.age_s)} old`; pill.className = "pill live"; }
  const a = ov.agent, ap = $("agent");
  ap.hidden = !a;
  if (a) {
    ap.textContent = `node agent pid ${a.pid}: ${a.clients} client(s), arena ${bytes(a.arena_used || 0)}` +
      (a.arena_capacity ? ` of ${bytes(a.arena_capacity)}` : "") + `, ${a.in_flight} version(s) in flight`;
    ap.className = "pill live";
  }
  $("updated").textContent = `read ${clock(ov.generated_at)}, every ${ov.refresh_s} s`;
  const ms = Math.max(250, ov.refresh_s * 1000);
  if (ms !== state.refreshMs) { state.refreshMs = ms; schedule(); }
}

function renderLineage(lin) {
  state.lineage = lin;
  $("lineage-count").textContent = `${lin.total} versions` + (lin.total > lin.versions.length ? `, newest ${lin.versions.length} drawn` : "");
  const svg = $("dag");
  svg.replaceChildren();
  const cols = new Map();
  for (const v of [...lin.versions].reverse()) if (!cols.has(v.branch)) cols.set(v.branch, cols.size);
  for (const b of lin.branches) if (!cols.has(b.name)) cols.set(b.name, cols.size);
  const ROW = 24, COL = 22, top = 14, left = 12;
  const textX = left + COL * Math.max(cols.size, 1) + 10;
  const rowOf = new Map(lin.versions.map((v, i) => [v.id, i]));
  const pos = (v) => [left + COL * cols.get(v.branch), top + ROW * rowOf.get(v.id)];
  svg.setAttribute("width", 900);
  svg.setAttribute("height", top + ROW * lin.versions.length);
  const edges = svgEl("g", {}), nodes = svgEl("g", {});
  svg.append(edges, nodes);
  lin.versions.forEach((v) => {
    const [x, y] = pos(v);
    if (v.parent !== null && rowOf.has(v.parent)) {
      const [px, py] = pos(lin.versions[rowOf.get(v.parent)]);
      const mid = (y + py) / 2;
      edges.append(svgEl("path", { class: "edge", d: px === x ? `M${x},${y}L${px},${py}` : `M${x},${y}C${x},${mid} ${px},${mid} ${px},${py}` }));
    }
    const g = svgEl("g", { class: `version${v.rolled_back ? " rolled" : ""}${v.id === state.selected ? " selected" : ""}`, "data-id": v.id, "data-branch": v.branch, "data-step": v.step });
    g.append(svgEl("circle", { class: `node c${cols.get(v.branch) % 6}`, cx: x, cy: y, r: 6 }));
    g.append(svgEl("text", { class: "id", x: textX, y: y + 4 }, v.short));
    g.append(svgEl("text", { class: "label", x: textX + 98, y: y + 4 }, `${v.branch}@${v.step}`));
    let rx = textX + 200;
    for (const r of v.refs) {
      const [kind, name] = r.split("/");
      const t = svgEl("text", { class: `ref ${kind}`, x: rx, y: y + 4 }, kind === "tag" ? `tag: ${name}` : name);
      g.append(t);
      rx += 14 + 7 * (kind === "tag" ? name.length + 5 : name.length);
    }
    if (v.rolled_back) g.append(svgEl("text", { x: rx, y: y + 4 }, "rolled back"));
    g.append(svgEl("title", {}, `${v.id}\n${v.branch}@${v.step} · ${bytes(v.nbytes)} · ${clock(v.created_at)}`));
    g.addEventListener("click", () => showVersion(v.id, true));
    nodes.append(g);
  });
  renderResidency(lin);
  renderReflog(lin);
}

function stateCell(tier, s) {
  return el("td", { "data-tier": tier, "data-state": s.state },
    el("span", { class: `state ${s.state}`, title: s.reason || s.state }, s.state),
    s.reason ? el("div", { class: "reason" }, s.reason) : "");
}

function renderResidency(lin) {
  const rows = lin.versions.slice(0, 60).map((v) =>
    el("tr", { "data-id": v.id }, el("td", { class: "id" }, v.short), el("td", { class: "num" }, v.step), el("td", {}, v.branch),
      ...lin.tiers.map((t) => stateCell(t, v.states[t] || { state: "absent", reason: "" }))));
  table($("residency"), ["version", { label: "step", num: true }, "branch", ...lin.tiers], rows);
}

function renderReflog(lin) {
  $("reflog-source").textContent = "(saves, rollbacks, resumes, branches, tags)";
  const rows = lin.reflog.slice(0, 100).map((m) => el("tr", {},
    el("td", {}, clock(m.at)), el("td", {}, `${m.kind}/${m.name}`), el("td", {}, m.why),
    el("td", { class: "id" }, m.version.slice(0, 10)), el("td", { class: "id" }, m.previous ? m.previous.slice(0, 10) : "-")));
  table($("reflog"), ["when", "ref", "why", "to", "from"], rows);
}

async function showVersion(id, redraw) {
  state.selected = id;
  if (redraw && state.lineage) {
    for (const g of document.querySelectorAll("#dag .version")) g.classList.toggle("selected", g.dataset.id === id);
  }
  const box = $("detail");
  let v;
  try { v = await getJSON(`/api/version/${encodeURIComponent(id)}`); } catch (e) { box.replaceChildren(el("p", { class: "error" }, e.message)); return; }
  if (v.pruned) {
    box.replaceChildren(el("h3", {}, "version"), el("dl", {},
      el("dt", {}, "id"), el("dd", { class: "id" }, v.id),
      el("dt", {}, "where"), el("dd", {}, `${v.branch}@${v.step}`),
      el("dt", {}, "saved"), el("dd", {}, new Date(v.created_at * 1000).toLocaleString()),
      el("dt", {}, "parent"), el("dd", { class: "id" }, v.parent || "-"),
      el("dt", {}, "size"), el("dd", {}, bytes(v.nbytes)),
      el("dt", {}, "pruned"), el("dd", { class: "pruned" }, v.pruned)));
    return;
  }
  const d = v.dedup;
  const dl = el("dl", {},
    el("dt", {}, "id"), el("dd", { class: "id" }, v.id),
    el("dt", {}, "where"), el("dd", {}, `${v.branch}@${v.step}`),
    el("dt", {}, "saved"), el("dd", {}, new Date(v.created_at * 1000).toLocaleString()),
    el("dt", {}, "parent"), el("dd", { class: "id" }, v.parent || "-"),
    el("dt", {}, "size"), el("dd", {}, `${bytes(v.nbytes)} in ${v.tensors} tensors`),
    el("dt", {}, "chunks"), el("dd", {}, `${v.chunks} (${v.unique_chunks} distinct, ${bytes(v.chunk_bytes)})`),
    el("dt", {}, "dedup"), el("dd", { id: "dedup" }, v.parent === null ? "no parent: every chunk is new" :
      `${d.shared_chunks} chunks (${bytes(d.shared_bytes)}, ${(100 * d.ratio).toFixed(1)} %) shared with the parent; ` +
      `${d.new_chunks} new (${bytes(d.new_bytes)})` + (d.parent_known ? "" : " — parent not listed")),
    el("dt", {}, "refs"), el("dd", {}, v.refs.join(", ") || "-"),
    el("dt", {}, "tiers"), el("dd", {}, Object.entries(v.states).map(([t, s]) => `${t}: ${s.state}`).join(" · ")));
  box.replaceChildren(el("h3", {}, "version"), dl, el("h3", {}, "meta"), el("pre", {}, JSON.stringify(v.meta, null, 1)));
}

function renderLag(lag) {
  const rows = Object.entries(lag.branches).map(([name, b]) => el("tr", { "data-branch": name },
    el("td", {}, name), el("td", { class: "num", "data-field": "training" }, b.training ? b.training.step : "-"),
    ...lag.levels.map((lvl) => {
      const x = b.levels[lvl];
      return el("td", { class: "lagcell", "data-branch": name, "data-level": lvl },
        x ? el("b", {}, `${x.steps} step${x.steps === 1 ? "" : "s"}`) : "-", x ? el("div", { class: "reason" }, `${dur(x.seconds)} · step ${x.step}`) : "");
    })));
  table($("lag"), ["branch", { label: "training", num: true }, ...lag.levels], rows);
  const branch = lag.branches.main ? "main" : Object.keys(lag.branches)[0];
  const hist = lag.history.filter((h) => h.branch === branch);
  const series = lag.levels.map((lvl) => ({
    name: lvl, points: hist.filter((h) => h.levels[lvl]).map((h) => [h.t, h.levels[lvl].seconds]) }));
  lineChart($("lag-chart"), series, { x: "time", steps: true, yFmt: dur, xFmt: clock,
    empty: "no lag history: no saving process has published one" });
}

function renderThroughput(th) {
  $("throughput-source").textContent = th.source === "status" ? "(live, from the saving process)" : "(last run's meter)";
  const keys = [...new Set(th.history.map((h) => `${h.tier} ${h.direction}`))].sort();
  const series = keys.map((k) => ({ name: k, points: th.history.filter((h) => `${h.tier} ${h.direction}` === k && h.bps).map((h) => [h.t, h.bps]) }));
  lineChart($("throughput-chart"), series, { x: "time", yFmt: rate, xFmt: clock });
  table($("rates"), ["tier", "read", "write"], Object.entries(th.rates).map(([t, d]) =>
    el("tr", {}, el("td", {}, t), el("td", {}, rate(d.read && d.read.bps)), el("td", {}, rate(d.write && d.write.bps)))));
  table($("queues"), ["level", { label: "versions pending", num: true }], Object.entries(th.queues).map(([l, n]) =>
    el("tr", { "data-level": l }, el("td", {}, l), el("td", { class: "num" }, n))));
  table($("codecs"), ["codec", { label: "ratio", num: true }, "encode"], Object.entries(th.codecs).map(([c, s]) =>
    el("tr", {}, el("td", {}, c), el("td", { class: "num" }, s.ratio ? s.ratio.toFixed(3) : "-"), el("td", {}, rate(s.encode_bps)))));
  table($("usage"), ["tier", "state", "used", "capacity", "free"], Object.entries(th.tiers).map(([t, u]) =>
    el("tr", { "data-state": u.state || "" }, el("td", {}, t),
      el("td", {}, u.state || (u.available ? "available" : "unavailable")), el("td", {}, bytes(u.used_bytes)),
      el("td", {}, u.capacity === null ? "-" : bytes(u.capacity)),
      el("td", {}, bytes(u.free_bytes)))));
  $("errors").replaceChildren(...(th.errors.length ? th.errors.map((e) =>
    el("li", {}, `${clock(e.t)} ${e.level} ${e.version.slice(0, 10)} (${e.branch}@${e.step}): ${e.error}: ${e.message}`)) :
    [el("li", { class: "muted" }, "none")]));
}

function renderAdvice(adv) {
  const box = $("advice"), p = adv.plan;
  if (!p) {
    box.replaceChildren(el("p", {}, adv.reason || "no advice"));
    lineChart($("goodput-chart"), [], { x: "log", yFmt: pct, xFmt: dur, empty: "no goodput curve without an MTTF" });
    return;
  }
  const steps = p.interval_steps ? ` (every ${p.interval_steps} steps)` : "";
  const why = p.bound ? `bounded by ${p.bound.replace(/_/g, " ")}` : "availability-optimal";
  const inputs = ["mttf", "save_wait", "time_to_level", "restore", "restart"].map((k) => {
    const f = p.inputs[k];
    return el("tr", {}, el("td", {}, k.replace(/_/g, " ")), el("td", { class: "num" }, f ? dur(f.seconds) : "-"),
      el("td", {}, f ? f.source : "missing"), el("td", { class: "reason" }, f ? f.note : ""));
  });
  const t = el("table", {});
  table(t, ["input", { label: "value", num: true }, "source", "how"], inputs);
  box.replaceChildren(
    el("div", {}, "save every ", el("span", { class: "big", id: "advised" }, dur(p.interval_s)), steps),
    el("div", { class: "muted" }, `${why}; expected goodput ${pct(p.goodput)}; Young ${dur(p.young_s)}, Daly ${dur(p.daly_s)} · ` +
      (adv.source === "trainer" ? "from the trainer's advisor" : "computed from this cache's measured figures")),
    t);
  lineChart($("goodput-chart"), [{ name: "expected goodput", points: p.curve }], {
    x: "log", yFmt: pct, xFmt: dur, yMin: Math.max(0, Math.min(...p.curve.map((c) => c[1]))), yMax: 1,
    markers: [{ x: p.interval_s, label: "advised", cls: "c2" }, { x: p.young_s, label: "Young", row: 1 }, { x: p.daly_s, label: "Daly", row: 2 }],
  });
}

// ------------------------------------------------------------------ refresh loop

async function refresh() {
  try {
    const [ov, lin, lag, th, adv] = await Promise.all(["overview", "lineage", "lag", "throughput", "advice"].map((p) => getJSON(`/api/${p}`)));
    renderLineage(lin);
    renderLag(lag);
    renderThroughput(th);
    renderAdvice(adv);
    renderOverview(ov);
    if (state.selected) await showVersion(state.selected, false);
    $("error").hidden = true;
  } catch (e) {
    $("error").textContent = `cannot refresh: ${e.message}`;
    $("error").hidden = false;
  } finally {
    document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes || 0) + 1);
  }
}

function schedule() {
  clearInterval(state.timer);
  state.timer = setInterval(refresh, state.refreshMs);
}

refresh();
schedule();
