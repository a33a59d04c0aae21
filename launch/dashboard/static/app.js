// The rlfleet dashboard page: polls the JSON endpoints of launch/dashboard/app.py once a second
// and draws one uPlot chart per metric name, one line per service, grouped by the name's prefix
// (CleanRL's charts/, losses/; reward/, eval/, rollout/ of LM runs). Each poll asks only for the
// records after its cursor. Text from the run (names, states) is set as text, never as HTML.
"use strict";

const POLL_MS = 1000;
const RUNS_EVERY = 5; // polls between refreshes of the run list
const GROUP_ORDER = ["charts", "losses", "reward", "rewards", "eval", "rollout"];
const FIRST_KEYS = ["charts/episodic_return", "charts/episodic_length", "charts/SPS"];
const COLORS = ["#1e88e5", "#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#6d4c41", "#546e7a"];
const CHART_HEIGHT = 200;

const view = {
  run: null, // the run shown (its directory name)
  current: null, // the run `rlfleet up` is running
  generation: null,
  cursor: 0,
  charts: new Map(), // metric name -> {box, plot, lines: Map(service -> {t: [], v: []}), nonfinite}
  polls: 0,
};

const $ = (id) => document.getElementById(id);

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    throw new Error(`${url}: ${response.status} ${body.detail || response.statusText}`);
  }
  return response.json();
}

// --- runs ---------------------------------------------------------------------------------------

async function refreshRuns() {
  const { runs } = await getJSON("/api/runs");
  const picker = $("run-picker");
  const current = runs.find((r) => r.current);
  view.current = current ? current.id : null;
  if (view.run === null && runs.length) view.run = (current || runs[0]).id;
  const wanted = runs.map((r) => r.id + (r.current ? " (current)" : ""));
  const have = Array.from(picker.options, (o) => o.textContent);
  if (wanted.join("\n") !== have.join("\n")) {
    picker.replaceChildren(
      ...runs.map((r, i) => {
        const option = new Option(wanted[i], r.id);
        option.selected = r.id === view.run;
        return option;
      }),
    );
  }
}

function showRun(runId) {
  view.run = runId;
  view.generation = null;
  view.cursor = 0;
  clearCharts();
}

// --- metrics ------------------------------------------------------------------------------------

function clearCharts() {
  for (const chart of view.charts.values()) chart.plot?.destroy();
  view.charts.clear();
  $("groups").replaceChildren();
}

async function pollMetrics() {
  if (view.run === null) return;
  const run = view.run;
  const query = `since=${view.cursor}` + (view.generation === null ? "" : `&generation=${view.generation}`);
  const reply = await getJSON(`/api/runs/${encodeURIComponent(run)}/metrics?${query}`);
  if (run !== view.run) return; // the user picked another run meanwhile
  if (reply.reset && view.cursor > 0) clearCharts();
  view.generation = reply.generation;
  view.cursor = reply.cursor;
  const touched = new Set();
  for (const s of reply.series) {
    const line = lineOf(s.key, s.service);
    for (const [t, v] of s.points) {
      line.t.push(t);
      line.v.push(v);
    }
    if (s.nonfinite && s.nonfinite.length) markNonfinite(view.charts.get(s.key), s.nonfinite);
    touched.add(s.key);
  }
  for (const key of touched) draw(key);
  $("empty").hidden = view.charts.size > 0;
  const problems = $("problems");
  problems.hidden = reply.skipped === 0;
  problems.textContent = reply.skipped
    ? `${reply.skipped} line(s) of metrics.jsonl skipped: ${reply.problems.join("; ")}`
    : "";
  return reply;
}

function lineOf(key, service) {
  let chart = view.charts.get(key);
  if (!chart) {
    chart = { box: makeBox(key), plot: null, lines: new Map() };
    view.charts.set(key, chart);
  }
  let line = chart.lines.get(service);
  if (!line) {
    line = { t: [], v: [] };
    chart.lines.set(service, line);
    chart.plot?.destroy(); // a new line: the chart is made again with one more series
    chart.plot = null;
  }
  return line;
}

// NaN/inf values (null in metrics.jsonl) make no point: the chart's title says how many and when.
function markNonfinite(chart, times) {
  chart.nonfinite = (chart.nonfinite || 0) + times.length;
  let note = chart.box.querySelector(".nonfinite");
  if (!note) {
    note = document.createElement("span");
    note.className = "nonfinite";
    chart.box.querySelector("h3").append(note);
  }
  const last = new Date(times[times.length - 1] * 1000).toLocaleTimeString();
  note.textContent = ` ⚠ ${chart.nonfinite} NaN/inf (last ${last})`;
}

function groupOf(key) {
  const slash = key.indexOf("/");
  return slash > 0 ? key.slice(0, slash) : "other";
}

function rank(list, item) {
  const i = list.indexOf(item);
  return i < 0 ? list.length : i;
}

function makeBox(key) {
  const group = groupOf(key);
  let section = document.querySelector(`section.group[data-group="${CSS.escape(group)}"]`);
  if (!section) {
    section = document.createElement("section");
    section.className = "group";
    section.dataset.group = group;
    const title = document.createElement("h2");
    title.textContent = group + "/";
    const grid = document.createElement("div");
    grid.className = "charts";
    section.append(title, grid);
    const order = (g) => [rank(GROUP_ORDER, g), g];
    const after = Array.from($("groups").children).find((s) => {
      const [a, b] = [order(s.dataset.group), order(group)];
      return a[0] > b[0] || (a[0] === b[0] && a[1] > b[1]);
    });
    $("groups").insertBefore(section, after || null);
  }
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.key = key;
  box.dataset.points = "0";
  const title = document.createElement("h3");
  title.textContent = key.slice(key.indexOf("/") + 1) || key;
  title.title = key;
  box.append(title);
  const grid = section.querySelector(".charts");
  const order = (k) => [rank(FIRST_KEYS, k), k];
  const after = Array.from(grid.children).find((b) => {
    const [a, c] = [order(b.dataset.key), order(key)];
    return a[0] > c[0] || (a[0] === c[0] && a[1] > c[1]);
  });
  grid.insertBefore(box, after || null);
  return box;
}

function chartWidth() {
  const columns = Math.max(1, Math.floor((document.body.clientWidth - 40) / 420));
  return Math.floor((document.body.clientWidth - 40) / columns) - 20;
}

function draw(key) {
  const chart = view.charts.get(key);
  const services = Array.from(chart.lines.keys());
  const tables = services.map((s) => [chart.lines.get(s).t, chart.lines.get(s).v]);
  const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
  if (!chart.plot) {
    const series = services.map((s, i) => ({
      label: s || "(run)",
      stroke: COLORS[i % COLORS.length],
      width: 1.5,
      spanGaps: true,
      value: (u, v) => (v == null ? "–" : formatValue(v)),
    }));
    const options = {
      width: chartWidth(),
      height: CHART_HEIGHT,
      scales: { x: { time: true } },
      series: [{ label: "time" }, ...series],
      axes: [{}, { size: 60 }],
    };
    chart.plot = new uPlot(options, data, chart.box);
  } else {
    chart.plot.setData(data);
  }
  const points = tables.reduce((n, [t]) => n + t.length, 0);
  chart.box.dataset.points = String(points);
}

function formatValue(v) {
  const a = Math.abs(v);
  if (a >= 1e4) return (v / 1e3).toFixed(a >= 1e5 ? 0 : 1) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1 || a === 0) return v.toFixed(2);
  return v.toPrecision(2);
}

// --- services -----------------------------------------------------------------------------------

async function pollServices() {
  const live = view.run !== null && view.run === view.current;
  $("services").hidden = !live;
  const note = $("services-note");
  note.hidden = live;
  note.textContent = live ? "" : `${view.run ?? "This run"} is an earlier run: no services running.`;
  if (!live) return;
  const { services } = await getJSON("/api/services");
  const rows = services.map((s) => {
    const row = document.createElement("tr");
    row.dataset.service = s.name;
    row.dataset.state = s.state;
    const cells = [s.name, s.kind, s.state, s.restarts, s.pid ?? "", s.address ?? "", s.last_exit ?? ""];
    for (const [i, text] of cells.entries()) {
      const cell = document.createElement("td");
      cell.textContent = String(text);
      if (i === 2) cell.className = "state";
      row.append(cell);
    }
    return row;
  });
  $("services").tBodies[0].replaceChildren(...rows);
}

// --- the loop -----------------------------------------------------------------------------------

async function tick() {
  try {
    if (view.polls % RUNS_EVERY === 0) await refreshRuns();
    view.polls += 1;
    await Promise.all([pollMetrics(), pollServices()]);
    const points = Array.from(view.charts.values()).reduce((n, c) => n + Number(c.box.dataset.points), 0);
    $("status").textContent = `${view.run ?? "no run"}: ${view.cursor} records, ${points} points, updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("status").textContent = `cannot reach the dashboard server (has the run ended?): ${err.message}`;
  }
  setTimeout(tick, POLL_MS);
}

$("run-picker").addEventListener("change", (event) => {
  showRun(event.target.value);
  Promise.all([pollMetrics(), pollServices()]).catch(() => {}); // now, not at the next tick
});

window.addEventListener("resize", () => {
  for (const chart of view.charts.values()) chart.plot?.setSize({ width: chartWidth(), height: CHART_HEIGHT });
});

tick();
