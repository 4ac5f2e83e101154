// The status page: polls api/status every second and draws tables and two SVG charts. No build step.
"use strict";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function fmt(x, digits) { return typeof x === "number" ? x.toFixed(digits) : "–"; }

function stageTable(p) {
  const head = el("tr", {}, ...["stage", "queue", "λ (req/s)", "μ (req/s)", "replicas ready / desired",
    "min–max", "replicas (host · start source · state)"].map(h => el("th", {}, h)));
  const table = el("table", { class: "stages" }, head);
  for (const s of p.stages) {
    const replicas = el("td", {});
    for (const r of s.replicas || []) {
      replicas.append(el("span", { class: "replica " + r.state, title: r.id },
        r.host + " · ", el("span", { class: "src" }, r.source), " · " + r.state));
    }
    if (s.reason) replicas.append(el("div", { class: "reason" }, s.reason));
    const row = el("tr", { class: p.key_stages.includes(s.index) ? "key" : "" },
      el("td", {}, s.name), el("td", { class: "num" }, s.queue), el("td", { class: "num" }, fmt(s.arrival_rate, 2)),
      el("td", { class: "num" }, fmt(s.service_rate, 2)), el("td", { class: "num" }, `${s.ready ?? "–"} / ${s.desired ?? "–"}`),
      el("td", { class: "num" }, `${s.min ?? "–"}–${s.max ?? "–"}`), replicas);
    table.append(row);
  }
  return table;
}

function decisionTable(p) {
  const table = el("table", { class: "decisions" },
    el("tr", {}, ...["age (s)", "desired per stage", "ready per stage", "queue", "key stages", "reasons"].map(h => el("th", {}, h))));
  for (const d of p.decisions) {
    table.append(el("tr", {}, el("td", { class: "num" }, fmt(d.age_s, 1)), el("td", {}, d.desired.join(", ")),
      el("td", {}, d.replicas.join(", ")), el("td", {}, d.queue.join(", ")), el("td", {}, d.key_stages.join(", ") || "–"),
      el("td", {}, d.reasons.filter(Boolean).join("; ") || "–")));
  }
  if (!p.decisions.length) table.append(el("tr", {}, el("td", { colspan: 6, class: "empty" }, "no decision yet")));
  return table;
}

// A line chart of series [{name, color, points: [[x, y], ...]}] in an SVG; x = seconds ago (right = now).
function lineChart(title, series, unit) {
  const W = 600, H = 180, L = 48, B = 20, T = 8, R = 8;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const all = series.flatMap(s => s.points);
  const maxX = Math.max(60, ...all.map(p => p[0]));
  const maxY = Math.max(1, ...all.map(p => p[1])) * 1.1;
  const x = age => L + (W - L - R) * (1 - age / maxX);
  const y = v => T + (H - T - B) * (1 - v / maxY);
  const add = (tag, attrs, text) => {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
  };
  for (let i = 0; i <= 4; i++) {
    const v = maxY * i / 4;
    add("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#e3e6eb" });
    add("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#666" }, v.toFixed(v < 10 ? 1 : 0));
  }
  add("text", { x: L, y: H - 4, "font-size": 10, fill: "#666" }, `-${Math.round(maxX)} s`);
  add("text", { x: W - R, y: H - 4, "font-size": 10, fill: "#666", "text-anchor": "end" }, "now");
  for (const s of series) {
    if (!s.points.length) continue;
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
    add("path", { d, fill: "none", stroke: s.color, "stroke-width": 1.8, class: "series", "data-name": s.name });
  }
  const legend = el("div", { class: "legend" }, title + " (" + unit + "): ",
    ...series.map(s => el("span", { style: `color:${s.color};margin-right:10px` }, "■ " + s.name)));
  return el("div", { class: "chart" }, legend, svg);
}

function charts(p) {
  const lat = p.history.latency;
  const latency = lineChart("latency", [
    { name: "p50", color: COLORS[0], points: lat.map(r => [r.age_s, r.p50_ms]) },
    { name: "p99", color: COLORS[3], points: lat.map(r => [r.age_s, r.p99_ms]) }], "ms");
  const reps = p.history.replicas;
  const replicas = lineChart("ready replicas", p.stages.map((s, i) => ({
    name: "stage " + s.index, color: COLORS[i % COLORS.length], points: reps.map(r => [r.age_s, r.replicas[i] ?? 0]) })), "count");
  return el("div", { class: "charts" }, latency, replicas);
}

function render(doc) {
  const stages = doc.pipelines.reduce((n, p) => n + p.stages.length, 0);
  document.getElementById("summary").textContent =
    `policy ${doc.policy} · ${doc.pipelines.length} pipeline(s) · ${stages} stage(s) · ${doc.hosts.length} host(s)`;
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  const hosts = document.getElementById("hosts");
  hosts.replaceChildren(el("b", {}, "hosts: "), ...doc.hosts.map(h =>
    el("span", { class: "host" }, `${h.name} ${h.used}/${h.slots ?? "?"} slots`)));
  const root = document.getElementById("pipelines");
  if (!doc.pipelines.length) {
    root.replaceChildren(el("p", { class: "empty" }, "No pipeline is deployed (quartctl deploy -f stack.yml)."));
    return;
  }
  root.replaceChildren(...doc.pipelines.map(p => el("section", { class: "pipeline", "data-model": p.model },
    el("h2", {}, p.model), el("div", {},
      `latency over ${p.latency.window_s} s: p50 ${fmt(p.latency.p50_ms, 1)} ms · p99 ${fmt(p.latency.p99_ms, 1)} ms · `
      + `${p.latency.count} request(s) · key stages: ${p.key_stages.join(", ") || "none"}`),
    el("h3", {}, "Stages"), stageTable(p), el("h3", {}, "Charts"), charts(p),
    el("h3", {}, "Last decisions of the controller"), decisionTable(p))));
}

async function poll() {
  try {
    // the page's own URL without user:password (a fetch URL may not carry them; the browser sends the auth it has)
    const url = new URL("api/status", location.origin + location.pathname);
    const res = await fetch(url, { cache: "no-store", credentials: "same-origin" });
    if (!res.ok) throw new Error(res.status + " " + res.statusText);
    render(await res.json());
  } catch (err) {
    document.getElementById("updated").textContent = "status unavailable: " + err.message;
  }
}

poll();
setInterval(poll, 1000);
