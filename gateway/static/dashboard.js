// pdserve's live dashboard: polls `stats` and `v1/requests` (relative to the page, so any
// route prefix works), keeps a short history and derives rates from successive readings.
// The charts are uPlot (vendored beside this file). `window.pdserveDashboard` exposes the
// charts' data and the number of readings, for the browser test.
"use strict";

const REFRESH_MS = 1500;
const HISTORY_POINTS = 120;   // 3 minutes at REFRESH_MS
const RECENT_LIMIT = 50;
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
// Prompt KV sources, in prompt order per worker (see gateway/request_provenance.py).
const SOURCES = {
  prefill_cache_hit: ["P", "#2ca02c", "prefill cache hit"],
  prefill_tier_hit: ["P", "#8c564b", "prefill KV tier hit"],
  prefill_computed: ["P", "#ff7f0e", "computed by prefill"],
  decode_cache_hit: ["D", "#17becf", "held by decode (dedup)"],
  decode_tier_hit: ["D", "#bcbd22", "decode KV tier hit"],
  pulled_early: ["D", "#aec7e8", "pulled while prefilling (offers)"],
  pulled: ["D", "#1f77b4", "pulled from prefill"],
  decode_recomputed: ["D", "#d62728", "recomputed on decode"],
  decode_prefilled: ["D", "#9467bd", "prefilled on decode"],
};

const state = { previous: null, times: [], workers: [], series: {}, charts: {}, updates: 0 };
window.pdserveDashboard = state;

function byteString(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes, unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}
const pct = (ratio) => `${(100 * ratio).toFixed(1)}%`;
const ms = (seconds) => `${(1000 * seconds).toFixed(1)} ms`;

function element(tag, text, attributes = {}) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  return node;
}

// ---------------------------------------------------------------- time-series charts

function lineChart(id, labels, formatValue) {
  const target = document.getElementById(id);
  const series = [{}].concat(labels.map((label, i) => ({
    label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true })));
  const data = [[]].concat(labels.map(() => []));
  const yAxis = formatValue ? { size: 70, values: (u, splits) => splits.map(formatValue) } : {};
  const options = { width: target.clientWidth - 12, height: 190, series,
    scales: { x: { time: true } }, axes: [{}, yAxis], legend: { live: false } };
  return new uPlot(options, data, target);
}

function push(name, values) {
  const data = state.series[name];
  data[0] = state.times;
  values.forEach((value, i) => {
    data[i + 1].push(value);
    if (data[i + 1].length > HISTORY_POINTS) data[i + 1].shift();
  });
  state.charts[name].setData(data);
}

function createCharts(workers) {
  const ids = workers.map((w) => w.worker_id);
  const kinds = {
    usage: ids,
    hit: ids,
    bytes: workers.map((w) => `${w.worker_id} ${w.role === "consumer" ? "recv" : "sent"}`),
    blocks: ids.flatMap((id) => [`${id} sent`, `${id} recv`, `${id} dedup`]),
    latency: ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"],
  };
  for (const [name, labels] of Object.entries(kinds)) {
    state.charts[name] = lineChart(`chart-${name}`, labels, name === "bytes" ? byteString : null);
    state.series[name] = [[]].concat(labels.map(() => []));
  }
  state.workers = ids;
  state.times = [];  // the charts' history starts with their first reading
}

function rate(now, before, key, seconds) {
  return before ? Math.max(0, now[key] - before[key]) / seconds : null;
}

function record(stats, time) {
  const previous = state.previous;
  const seconds = previous ? Math.max(time - previous.time, 1e-3) : 1;
  const before = (id) => previous && previous.rows[id];
  const rows = Object.fromEntries(stats.workers.map((w) => [w.worker_id, w]));
  state.times.push(time);
  if (state.times.length > HISTORY_POINTS) state.times.shift();
  const known = state.workers.map((id) => rows[id] || null);
  push("usage", known.map((w) => (w ? 100 * w.kv_cache_usage : null)));
  push("hit", known.map((w) => {
    const b = w && before(w.worker_id);
    if (!w || !b) return null;
    const queries = w.prefix_cache_queries - b.prefix_cache_queries;
    return queries > 0 ? 100 * (w.prefix_cache_hits - b.prefix_cache_hits) / queries : null;
  }));
  push("bytes", known.map((w) => w && rate(w, before(w.worker_id),
    w.role === "consumer" ? "num_bytes_received" : "num_bytes_sent", seconds)));
  push("blocks", known.flatMap((w) => ["num_blocks_sent", "num_blocks_received",
    "num_dedup_skipped_blocks"].map((key) => w && rate(w, before(w.worker_id), key, seconds))));
  const g = stats.gateway;
  push("latency", [g.ttft_p50_s, g.ttft_p99_s, g.itl_p50_s, g.itl_p99_s].map((s) => 1000 * s));
  state.previous = { time, rows, gateway: g };
}

// ---------------------------------------------------------------- transfer histogram

function drawTransferHistogram(histogram) {
  if (!histogram) return;
  const labels = histogram.bounds.map((b) => `≤${Number((1000 * b).toPrecision(2))} ms`)
    .concat("more");
  const data = [labels.map((_, i) => i), histogram.counts.slice()];
  if (!state.charts.transfer) {
    const target = document.getElementById("chart-transfer");
    state.charts.transfer = new uPlot({
      width: target.clientWidth - 12, height: 190, legend: { show: false },
      scales: { x: { time: false, range: [-0.5, labels.length - 0.5] } },
      axes: [{ values: (u, splits) => splits.map((i) => labels[i] || "") }, {}],
      series: [{}, { label: "pulls", fill: "#1f77b4", stroke: "#1f77b4",
                     paths: uPlot.paths.bars({ size: [0.8, 40] }) }],
    }, data, target);
  } else {
    state.charts.transfer.setData(data);
  }
}

// ---------------------------------------------------------------- autoscaler

// The autoscaler's own history (its readings since it started), so the chart shows the
// steps before the page opened too; its newest decisions, newest first, with their reasons.
function drawAutoscaler(report) {
  const figure = document.getElementById("autoscaler");
  if (!report) { figure.hidden = true; return; }
  figure.hidden = false;
  document.getElementById("autoscaler-state").textContent = report.state;
  const data = [report.history.map((h) => h[0]), report.history.map((h) => h[1]),
                report.history.map((h) => h[2])];
  if (!state.charts.scale) {
    const target = document.getElementById("chart-scale");
    const stepped = uPlot.paths.stepped({ align: 1 });
    state.charts.scale = new uPlot({
      width: target.clientWidth - 12, height: 190, scales: { x: { time: true } },
      series: [{}, { label: "prefill", stroke: COLORS[0], width: 2, paths: stepped },
               { label: "decode", stroke: COLORS[1], width: 2, paths: stepped }],
    }, data, target);
  } else {
    state.charts.scale.setData(data);
  }
  const items = report.decisions.slice(-8).reverse().map((d) => element("li",
    `${new Date(d.time * 1000).toLocaleTimeString()} ${d.role} ${d.workers_from} → ` +
    `${d.workers_to}: ${d.reason}`));
  document.getElementById("decisions").replaceChildren(...items);
}

// ---------------------------------------------------------------- tables

function workerRow(w) {
  const cells = [w.worker_id, w.role, w.num_requests_running, w.num_requests_waiting,
    pct(w.kv_cache_usage), pct(w.prefix_cache_hit_rate), w.num_blocks_sent,
    w.num_blocks_received, w.num_blocks_received_early, w.num_blocks_received_in_handoff, byteString(w.num_bytes_sent), byteString(w.num_bytes_received),
    w.num_dedup_skipped_blocks, w.num_leases_held, w.num_failed_transfers,
    w.num_lease_expiries, w.num_recompute_fallbacks, ms(w.transfer_latency_p50_s),
    ms(w.transfer_latency_p99_s), w.num_structured_requests,
    Math.round(w.masked_tokens_per_row), `${w.num_grammar_compiles}/${w.num_grammar_cache_hits}`,
    ms(w.grammar_compile_seconds), w.num_spec_decode_drafts, pct(w.spec_decode_acceptance_rate),
    w.spec_decode_mean_accepted_length.toFixed(2), loraCell(w)];
  const row = element("tr");
  cells.forEach((cell) => row.appendChild(element("td", String(cell))));
  return row;
}

// The adapters a worker holds in memory, each with the requests that ran it there.
function loraCell(w) {
  const held = Object.keys(w.lora_adapters_resident || {}).sort();
  const requests = w.lora_requests || {};
  return held.map((name) => `${name} (${requests[name] || 0})`).join(", ") || "–";
}

function sourceBar(label, record, kind) {
  const bar = element("div", undefined, { class: "bar" });
  const counts = record.prompt_tokens_by_source;
  for (const [source, [side, color, title]] of Object.entries(SOURCES)) {
    const tokens = counts[source];
    if (side !== kind || !tokens) continue;
    const blocks = Math.ceil(tokens / record.block_size);
    const span = element("span", undefined, {
      title: `${title}: ${tokens} tokens (${blocks} blocks)`, "data-source": source,
      style: `width:${(100 * tokens) / record.num_prompt_tokens}%;background:${color}` });
    bar.appendChild(span);
  }
  const cell = element("div");
  cell.appendChild(element("span", label, { class: "bar-label" }));
  cell.appendChild(bar);
  cell.style.display = "flex";
  bar.style.flex = "1";
  return cell;
}

function workerCell(part) {
  return part ? `${part.worker_id}${part.node_ip ? "@" + part.node_ip : ""}` : "–";
}

function requestRow(record, now) {
  const row = element("tr", undefined, { "data-request-id": record.request_id });
  const bars = element("td", undefined, { class: "bars" });
  if (record.prefill) bars.appendChild(sourceBar("P", record, "P"));
  if (record.decode) bars.appendChild(sourceBar("D", record, "D"));
  const transfer = record.transfer;
  const cells = [record.request_id.slice(0, 17), `${Math.max(0, now - record.created).toFixed(0)} s`,
    record.num_prompt_tokens, record.num_output_tokens, bars, workerCell(record.prefill),
    workerCell(record.decode), `${transfer.num_blocks_early} + ${transfer.num_blocks}`,
    byteString(transfer.num_bytes_early + transfer.num_bytes),
    ms(transfer.seconds), transfer.handed_off ? "yes" : "–",
    ms(record.ttft_s), ms(record.itl_s), record.finish_reason || "–"];
  cells.forEach((cell) => row.appendChild(cell instanceof Node ? cell : element("td", String(cell))));
  row.firstChild.title = record.request_id;
  return row;
}

function replaceRows(tableId, rows) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...rows);
}

function drawLegend() {
  const legend = document.getElementById("legend");
  for (const [side, color, title] of Object.values(SOURCES)) {
    const entry = element("span");
    entry.appendChild(element("i", undefined, { style: `background:${color}` }));
    entry.appendChild(document.createTextNode(`${side}: ${title}`));
    legend.appendChild(entry);
  }
}

function drawSummary(stats, time) {
  const g = stats.gateway;
  const previous = state.previous;
  const seconds = previous ? Math.max(time - previous.time, 1e-3) : null;
  const perSecond = (key) => (seconds ? ((g[key] - previous.gateway[key]) / seconds).toFixed(1) : "–");
  document.getElementById("model").textContent = stats.model;
  document.getElementById("summary").textContent =
    `${g.num_requests} requests (${perSecond("num_requests")}/s), ${g.num_requests_in_flight} in flight, ` +
    `${g.num_generation_tokens} tokens (${perSecond("num_generation_tokens")}/s), ` +
    `${g.num_retries} retries; TTFT p50 ${ms(g.ttft_p50_s)} p99 ${ms(g.ttft_p99_s)}; ` +
    `ITL p50 ${ms(g.itl_p50_s)} p99 ${ms(g.itl_p99_s)}`;
  const sources = Object.entries(g.prompt_tokens_by_kv_source || {})
    .map(([source, tokens]) => `${SOURCES[source] ? SOURCES[source][2] : source} ${tokens}`);
  document.getElementById("sources").textContent =
    `Prompt tokens by KV source, all requests: ${sources.join(" · ")}`;
}

// ---------------------------------------------------------------- the loop

async function getJson(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const [stats, recent] = await Promise.all([getJson("stats"),
                                               getJson(`v1/requests?limit=${RECENT_LIMIT}`)]);
    const time = Date.now() / 1000;
    if (!state.workers.length && stats.workers.length) createCharts(stats.workers);
    drawSummary(stats, time);
    record(stats, time);
    drawTransferHistogram(stats.totals.transfer_latency);
    drawAutoscaler(stats.autoscaler);
    replaceRows("workers", stats.workers.map(workerRow));
    replaceRows("requests", recent.data.map((r) => requestRow(r, time)));
    state.updates += 1;
    status.textContent = `updated ${new Date().toLocaleTimeString()} · every ${REFRESH_MS / 1000} s`;
    status.className = "status";
  } catch (error) {
    status.textContent = `no reading: ${error.message}`;  // shown, not thrown: keep polling
    status.className = "status error";
  }
  setTimeout(refresh, REFRESH_MS);
}

drawLegend();
refresh();
