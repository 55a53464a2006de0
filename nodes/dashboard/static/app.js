// The coordinator dashboard: polls the JSON API and draws it. Every string from the run
// (node names, reasons, settings) goes into the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const W = 340, H = 150, M = {left: 44, right: 10, top: 10, bottom: 24};

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "" : Number(x).toFixed(digits);
}

// A line chart of `series` ([{points: [[x, y]...], cls}]) in `svg`, with y from `lo` to `hi`
// (default: the data's range) and an optional dashed `threshold` series of [x, y].
function chart(svg, series, {lo, hi, width = W, height = H, margin = M, label = fmt, threshold, axes = true} = {}) {
  svg.replaceChildren();
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const all = series.flatMap((s) => s.points).concat(threshold || []);
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]).filter((y) => y !== null);
  if (!xs.length) {
    svg.append(svgEl("text", {x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty"}, "no rounds yet"));
    return;
  }
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = lo ?? Math.min(...ys), y1 = hi ?? Math.max(...ys);
  if (y1 === y0) { y1 += 1; y0 = Math.min(y0, 0); }
  const px = (x) => margin.left + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (width - margin.left - margin.right);
  const py = (y) => height - margin.bottom - (y - y0) / (y1 - y0) * (height - margin.top - margin.bottom);
  if (axes) {
    svg.append(svgEl("line", {x1: margin.left, y1: height - margin.bottom, x2: width - margin.right,
                              y2: height - margin.bottom, class: "axis"}));
    svg.append(svgEl("line", {x1: margin.left, y1: margin.top, x2: margin.left, y2: height - margin.bottom, class: "axis"}));
    for (const y of [y0, y1]) {
      svg.append(svgEl("text", {x: margin.left - 4, y: py(y) + 4, "text-anchor": "end", class: "tick"}, label(y)));
    }
    for (const [x, anchor] of x0 === x1 ? [[x0, "middle"]] : [[x0, "start"], [x1, "end"]]) {
      svg.append(svgEl("text", {x: px(x), y: height - 6, "text-anchor": anchor, class: "tick"}, `round ${x}`));
    }
  }
  if (threshold && threshold.length) {
    svg.append(svgEl("polyline", {points: threshold.map((p) => `${px(p[0])},${py(p[1])}`).join(" "), class: "threshold"}));
  }
  for (const s of series) {
    const known = s.points.filter((p) => p[1] !== null);
    svg.append(svgEl("polyline", {points: known.map((p) => `${px(p[0])},${py(p[1])}`).join(" "), class: `line ${s.cls}`}));
    for (const [x, y] of known) {
      const dot = svgEl("circle", {cx: px(x), cy: py(y), r: axes ? 2.5 : 1.5, class: `point ${s.cls}`, "data-round": x});
      dot.append(svgEl("title", {}, `round ${x}: ${label(y)}`));
      svg.append(dot);
    }
  }
}

function renderStatus(s) {
  const state = document.getElementById("state");
  state.textContent = s.state;
  state.className = `badge ${s.state}`;
  document.getElementById("progress").textContent = `round ${s.round} of ${s.rounds}`;
  document.getElementById("folder").textContent = s.folder;
  const rows = [
    ["rule", `${s.settings.aggregator} (f=${s.settings.tolerate})`],
    ["protocol", s.settings.protocol],
    ["rounds", `${s.settings.round}${s.settings.round === "async" ? `, buffer ${s.settings.buffer}` : `, late ${s.settings.late}`}`],
    ["codec", `${s.settings.compression} up, ${s.settings.downlink} down`],
    ["quorum", `${s.settings.quorum} valid replies, deadline ${s.settings.deadline} s`],
    ["flag policy", `flag above ${s.settings["flag-ratio"]}x the ${s.settings["flag-own"] ? "run's or the node's own" : "run's"} ` +
                    `typical distance, quarantine after ${s.settings["quarantine-after"]}` +
                    (s.settings["false-alarm"] ? `, evidence at false-alarm ${s.settings["false-alarm"]}` : "")],
    ["spot checks", s.settings["spot-check"] ? `${s.settings["spot-check"]} of the updates` : "off"],
    ["data, model", `${s.settings.dataset}, ${s.settings.model}, seed ${s.settings.seed}`],
    ["time per round", s.last_round_seconds === null ? "" : `last ${fmt(s.last_round_seconds, 1)} s, mean ${fmt(s.mean_round_seconds, 1)} s`],
    ["accuracy", s.accuracy === null ? "" : `last ${fmt(s.accuracy)}, best ${fmt(s.best_accuracy)}`],
  ];
  if (s.model_sha256) rows.push(["result", `final accuracy ${fmt(s.final_accuracy, 4)}, model ${s.model_sha256.slice(0, 16)}…`]);
  if (s.failure) rows.push(["failure", s.failure]);
  const dl = document.getElementById("settings");
  dl.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  const c = s.counts;
  document.getElementById("node-counts").textContent =
    `${c.admitted} admitted, ${c.online} replied last round, ${c.flagged} flagged, ${c.quarantined} quarantined, ${c.convicted} convicted`;
  const a = s.audit;
  const chain = a.chain === "intact" ? `intact through round ${a.through}` : `broken: ${a.problem}`;
  document.getElementById("audit-list").replaceChildren(
    el("dt", {}, "hash chain"), el("dd", {class: a.chain, id: "chain"}, chain),
    el("dt", {}, "spot checks"), el("dd", {id: "spot"}, `${a.spot.drawn} drawn, ${a.spot.cleared} cleared, ${a.spot.convicted} convicted`),
    el("dt", {}, "disputes"), el("dd", {id: "disputes"},
       `${a.disputes.opened} opened, ${a.disputes.cleared} cleared (hardware rounding), ${a.disputes.convicted} convicted`),
    el("dt", {}, "full check"), el("dd", {}, `robust audit verify ${s.folder} (signatures, every round recomputed)`));
  document.getElementById("event-list").replaceChildren(...(s.events.length ? s.events.map(e =>
    el("li", {}, `${new Date(e.time * 1000).toLocaleTimeString()} ${e.node ? e.node + ": " : ""}${e.what}`))
    : [el("li", {class: "dim"}, "none")]));
}

function renderRounds(rounds) {
  chart(document.getElementById("accuracy-chart"), [{points: rounds.map((r) => [r.round, r.accuracy]), cls: "accuracy"}],
        {lo: 0, hi: 1});
  chart(document.getElementById("seconds-chart"), [{points: rounds.map((r) => [r.round, r.seconds]), cls: "seconds"}],
        {lo: 0, label: (y) => fmt(y, 1)});
  document.getElementById("round-costs").textContent = roundCosts(rounds[rounds.length - 1]);
  chart(document.getElementById("bytes-chart"), [
    {points: rounds.map((r) => [r.round, r.bytes_up]), cls: "up"},
    {points: rounds.map((r) => [r.round, r.bytes_down]), cls: "down"}], {lo: 0, label: fmtBytes});
}

function roundCosts(r) {
  // where the last round's seconds went, largest first: waiting (the slowest training in it) and the coordinator's own
  if (!r || !r.costs || !Object.keys(r.costs).length) return "";
  const parts = Object.entries(r.costs).filter(([, s]) => s >= 0.05).sort((a, b) => b[1] - a[1]).map(([k, s]) =>
    `${k} ${fmt(s, 1)}` + (k === "waiting" && r.train_seconds_max ? ` (slowest training ${fmt(r.train_seconds_max, 1)})` : ""));
  return `round ${r.round}: ${fmt(r.seconds, 1)} s` + (parts.length ? `: ${parts.join(", ")}` : "");
}

function evidenceChart(node) {
  if (!node.evidence.length) return el("span", {class: "dim"}, "none recorded");
  const svg = svgEl("svg", {class: "spark", role: "img"});
  const last = node.evidence[node.evidence.length - 1];
  chart(svg, [{points: node.evidence.map((e) => [e[0], e[1]]), cls: "evidence"}],
        {lo: 0, width: 100, height: 32, margin: {left: 2, right: 2, top: 2, bottom: 2}, axes: false,
         threshold: node.evidence.map((e) => [e[0], e[2]])});
  return el("div", {class: "evidence"}, svg, last ? `${fmt(last[1], 1)} / ${fmt(last[2], 1)}` : "");
}

function nodeState(n) {
  if (n.convicted) return "convicted";
  if (n.quarantined !== null) return "quarantined";
  return n.flags ? "flagged" : "ok";
}

function renderNodes(nodes) {
  const body = document.querySelector("#node-table tbody");
  const rows = [];
  for (const n of nodes) {
    const state = nodeState(n);
    const flags = n.flag_rounds.length ? `${n.flags}: ` + n.flag_rounds.slice(-3).map((f) => `round ${f.round}, ${f.reason}`).join("; ") : "0";
    const row = el("tr", {"data-node": n.id, "data-state": state, class: state},
      el("td", {class: "id", title: n.fingerprint}, n.id, n.admitted ? "" : el("span", {class: "dim"}, " (not admitted)")),
      el("td", {}, n.online ? "yes" : "no"),
      el("td", {}, n.asked), el("td", {}, n.accepted), el("td", {}, n.rejected),
      el("td", {}, `${n.failed} / ${n.declined}`), el("td", {}, `${n.missing} / ${n.late}`),
      el("td", {class: "flags"}, flags),
      el("td", {}, evidenceChart(n)),
      el("td", {class: "why"}, n.quarantined === null ? "" : `since round ${n.quarantined}: ${n.why}`),
      el("td", {class: "convicted"}, !n.convicted ? "" : n.convicted.dispute !== null
         ? `round ${n.convicted.round}, in a dispute: ${n.convicted.dispute}`
         : `round ${n.convicted.round}, spot check by ${n.convicted.verifier}` +
           (n.convicted.distance === null ? "" : ` (distance ${Number(n.convicted.distance).toPrecision(3)})`)),
      el("td", {}, fmt(n.reply_seconds, 2)), el("td", {}, fmt(n.staleness, 2)), el("td", {}, fmtBytes(n.bytes_up)));
    rows.push(row);
    if (n.reasons.length) {
      rows.push(el("tr", {class: "reasons", "data-reasons-of": n.id}, el("td", {colspan: 14},
        ...n.reasons.map((r) => el("div", {class: "reason"}, `round ${r.round} ${r.kind}: ${r.reason}`)))));
    }
  }
  body.replaceChildren(...rows);
  markOverflow();
}

// Whether the node table is wider than its frame (a narrow window): the frame then scrolls
// sideways, and a line above it says so, since many browsers hide a scrollbar until it is used.
// The frame keeps the overflow in pixels (0: the table fits) in data-overflow.
function markOverflow() {
  const frame = document.getElementById("node-frame");
  const over = Math.max(0, frame.scrollWidth - frame.clientWidth);
  frame.dataset.overflow = over;
  document.getElementById("node-hint").hidden = over === 0;
}

async function getJSON(name) {
  const response = await fetch(`/api/${name}`, {credentials: "same-origin", cache: "no-store"});
  const body = await response.json().catch(() => ({error: response.statusText}));
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

async function refresh() {
  const error = document.getElementById("error");
  try {
    const [status, rounds, nodes] = await Promise.all(["status", "rounds", "nodes"].map(getJSON));
    renderStatus(status);
    renderRounds(rounds);
    renderNodes(nodes);
    error.hidden = true;
    document.body.dataset.round = status.round;
    document.getElementById("updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
  } catch (err) {
    error.textContent = `Could not read the run: ${err.message}. Retrying every ${POLL_MS / 1000} s.`;
    error.hidden = false;
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

window.addEventListener("resize", markOverflow);
refresh();
