// The rlfleet dashboard page: polls the JSON endpoints of launch/dashboard/app.py once a second
// and draws one uPlot chart per metric name, one line per service, grouped by the name's prefix
// (CleanRL's charts/, losses/; reward/, eval/, rollout/ of LM runs). Each poll asks only for the
// records after its cursor. Text from the run (names, states) is set as text, never as HTML.
// The x axis counts env steps (each point's `steps`, from the learner's charts/global_step) or,
// by the header's toggle, wall time; runs that report no env steps (LM runs) draw wall time.
// Other runs can be overlaid (the compare picker): their learner's lines (or, without a learner,
// every line but the actors'), dashed, in a color per run, against env steps or the time since
// each run's first record. Smoothing is an exponential moving average over each line's points,
// as TensorBoard's slider does. Under `rlfleet studio` (launch/studio) studio.js adds its views.
"use strict";

const POLL_MS = 1000;
const RUNS_EVERY = 5; // polls between refreshes of the run list
const GROUP_ORDER = ["charts", "losses", "reward", "rewards", "eval", "rollout", "episodes", "sampler"];
// A game's own score (Snake's food eaten, Atari's unclipped score) as a metric of its own.
const SCORE_KEY = /(^|[/_])score$/i;
const FIRST_KEYS = ["charts/episodic_return", "score", "charts/episodic_length", "charts/SPS"];
const FEATURED = new Set(["charts/episodic_return", "score"]);
const LEARNER_COLOR = "#0d47a1";
const COLORS = ["#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00897b", "#6d4c41", "#546e7a", "#1e88e5"];
const CHART_HEIGHT = 200;
const X_MODE_STORE = "rlfleet.dashboard.x";
const SMOOTHING_STORE = "rlfleet.dashboard.smoothing";
const COMPARE_COLORS = ["#d81b60", "#00897b", "#f4511e", "#5e35b1", "#7cb342", "#6d4c41"];
const SEP = "\u0000"; // between a compared run's id and its service in a line's key

// What a series of a chart is, by its service's role (series' `role`, launch/dashboard/metrics.py).
const ROLE_NOTES = {
  "charts/episodic_return": { learner: "all actors, recent episodes", actor: "its own recent episodes" },
  "charts/episodic_length": { learner: "all actors, recent episodes", actor: "its own recent episodes" },
  score: { learner: "all actors, recent episodes", actor: "its own recent episodes" },
  "charts/SPS": { learner: "env steps trained on/s", actor: "its env steps/s" },
};

// One or two lines under each known chart's title: what it shows, what to do about it.
const HELP = {
  "charts/episodic_return":
    "Mean return per episode. Thick line: the learner's, over the last episode_window (20) episodes of all actors: " +
    "the run's headline, which target_return is checked against. Thin lines: each actor's mean over its own last 20 episodes.",
  score:
    "The game's own score per episode (e.g. food eaten in Snake, Atari's unclipped score), which the return " +
    "(clipped or shaped rewards) may not show.",
  "charts/episodic_length": "Mean episode length in env steps; lines as in episodic_return.",
  "charts/SPS":
    "Env steps per second: the learner's is the env steps it trained on per second since it started, " +
    "an actor's its own env steps per second over its last report interval.",
  "charts/policy_lag":
    "How many policy versions behind the learner the trained fragments were (mean per update). " +
    "Fragments more than max_policy_lag behind are dropped (see dropped_fragments).",
  "charts/dropped_fragments":
    "Fragments the learner threw away as stale (more than max_policy_lag versions old), counted since the run began. " +
    "Flat is good; a steady climb means the actors outrun the learner: fewer actors or envs, a larger " +
    "fragments_per_update or a higher max_policy_lag. Invalid fragments are in the learner's log and ledger, " +
    "NaN/inf updates in losses/nonfinite_updates.",
  "charts/update_s":
    "Seconds per learner update (all epochs and minibatches of one batch), not counting the wait for fragments. " +
    "Near the time the actors take to fill a batch, the learner is the bottleneck.",
  "charts/global_step": "Env steps the learner has trained on (CleanRL's global_step): what the env-steps x axis counts.",
  "charts/learning_rate": "The learner's learning rate (falls linearly to 0 with anneal_lr).",
  "charts/episodes": "Episodes each actor has finished.",
  "losses/policy_loss": "PPO's clipped surrogate loss, the policy-gradient part. Its level means little; watch for spikes.",
  "losses/value_loss": "Mean squared error of the value function against the returns.",
  "losses/loss": "The total loss: policy loss + vf_coef x value loss - ent_coef x entropy.",
  "losses/entropy":
    "Entropy of the policy's actions: falls as the policy grows sure. A collapse to 0 early means it stopped exploring.",
  "losses/approx_kl":
    "How far one update moved the policy (KL old to new, CleanRL's estimator). Small (about 0.02 or less) in healthy " +
    "PPO; if large, lower learning_rate or update_epochs, or set target_kl.",
  "losses/clipfrac":
    "Fraction of samples whose importance ratio (new / old policy probability) left [1 - clip_coef, 1 + clip_coef] " +
    "and was clipped: near 0, tiny updates; high, too large steps.",
  "losses/ratio_mean":
    "Mean importance ratio (new / old policy probability of the taken actions): 1 means the update left the policy " +
    "where it was; far from 1, the updates are large.",
  "losses/vtrace_rho_mean": "Mean V-trace importance weight (learner policy / acting policy) of the batch: how off-policy it was.",
  "losses/vtrace_rho_clipfrac": "Fraction of V-trace importance weights clipped at rho_bar.",
  "losses/explained_variance":
    "How well the value function predicts the returns: 1 perfectly, 0 no better than a constant, below 0 worse.",
  "losses/epochs": "Epochs run per update (fewer than update_epochs when target_kl stopped one early).",
  "losses/nonfinite_updates":
    "Updates skipped for a NaN/inf in the batch, loss or gradients (none applied). Any rise: the learner's log " +
    "names the fragments' source.",
  "sampler/prefix_cache_hit_rate":
    "Each sampler's share of prompt tokens found in its prefix cache (not computed again). Multi-turn episodes keep " +
    "every turn on one sampler, so their earlier turns are cached: near 1 is the goal; low means turns land elsewhere " +
    "or the cache (kv_cache_gib) is too small.",
  "rollout/prefix_cache_hit_rate": "The same hit rate, over the multi-turn turns one rollout driver sent.",
};

const isScore = (key) => SCORE_KEY.test(key);
const kind = (key) => (isScore(key) ? "score" : key); // a score metric's notes and place

const view = {
  run: null, // the run shown (its directory name)
  current: null, // the run `rlfleet up` is running
  generation: null,
  cursor: 0,
  compare: [], // runs overlaid on the shown one
  sources: new Map(), // compared run -> {cursor, generation, t0}
  t0: null, // the shown run's first record time (elapsed-time axis when comparing)
  smoothing: Math.min(Math.max(Number(localStorage.getItem(SMOOTHING_STORE)) || 0, 0), 0.99),
  studio: false, // served by `rlfleet studio` (studio.js sets it)
  charts: new Map(), // metric name -> {box, plot, lines: Map(service -> {t, v, s, role}), nonfinite}
  polls: 0,
  xWanted: localStorage.getItem(X_MODE_STORE) === "time" ? "time" : "steps", // the toggle
  hasSteps: false, // some point of this run has env steps
  xDrawn: null, // the x axis the charts are drawn with
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
  const compare = $("compare-picker");
  const others = runs.map((r) => r.id);
  const listed = Array.from(compare.options, (o) => o.value);
  if (others.join("\n") !== listed.join("\n")) {
    compare.replaceChildren(
      ...others.map((id) => {
        const option = new Option(id, id);
        option.selected = view.compare.includes(id);
        return option;
      }),
    );
  }
  for (const option of compare.options) option.disabled = option.value === view.run;
}

function showRun(runId) {
  view.run = runId;
  view.compare = view.compare.filter((id) => id !== runId);
  resetSources();
}

function setCompare(runIds) {
  view.compare = runIds.filter((id) => id !== view.run);
  resetSources();
}

// Every run's metrics from the start again (a new shown run or a new set of compared runs).
function resetSources() {
  view.generation = null;
  view.cursor = 0;
  view.t0 = null;
  view.sources = new Map(view.compare.map((id) => [id, { cursor: 0, generation: null, t0: null }]));
  clearCharts();
}

// --- metrics ------------------------------------------------------------------------------------

function clearCharts() {
  for (const chart of view.charts.values()) chart.plot?.destroy();
  view.charts.clear();
  view.hasSteps = false;
  $("groups").replaceChildren();
}

// Env steps unless the toggle says wall time or the run reports no env steps (yet).
function xMode() {
  return view.xWanted === "steps" && view.hasSteps ? "steps" : "time";
}

function redrawAll() {
  for (const [key, chart] of view.charts) {
    chart.plot?.destroy();
    chart.plot = null;
    if (chart.lines.size) draw(key);
  }
}

function metricsURL(run, source) {
  const query = `since=${source.cursor}` + (source.generation === null ? "" : `&generation=${source.generation}`);
  return `/api/runs/${encodeURIComponent(run)}/metrics?${query}`;
}

// Points of one reply into the charts' lines; `run` is null for the shown run's.
function ingest(reply, run, source, touched) {
  for (const s of reply.series) {
    if (run !== null && s.role === "actor") continue; // a compared run shows its run-wide lines
    const points = s.points;
    if (points.length && source.t0 === null) source.t0 = points[0][0];
    const line = lineOf(s.key, run === null ? s.service : run + SEP + s.service, s.role || "", run);
    const steps = s.steps || [];
    for (const [i, [t, v]] of points.entries()) {
      line.t.push(t);
      line.v.push(v);
      line.s.push(steps[i] ?? null);
      if (steps[i] != null) view.hasSteps = true;
    }
    if (run === null && s.nonfinite && s.nonfinite.length) markNonfinite(view.charts.get(s.key), s.nonfinite);
    touched.add(s.key);
  }
}

async function pollMetrics() {
  if (view.run === null) return;
  const run = view.run;
  const compared = [...view.sources.entries()];
  const [reply, ...others] = await Promise.all([
    getJSON(metricsURL(run, view)),
    ...compared.map(([id, source]) => getJSON(metricsURL(id, source)).catch(() => null)),
  ]);
  if (run !== view.run || view.sources.size !== compared.length) return; // picked anew meanwhile
  if ((reply.reset && view.cursor > 0) || others.some((r, i) => r && r.reset && compared[i][1].cursor > 0)) {
    resetSources(); // a file read again from its start: every line starts over, next poll
    return reply;
  }
  view.generation = reply.generation;
  view.cursor = reply.cursor;
  const touched = new Set();
  const own = { t0: view.t0 };
  ingest(reply, null, own, touched);
  view.t0 = own.t0;
  for (const [i, other] of others.entries()) {
    if (!other) continue;
    const [id, source] = compared[i];
    source.generation = other.generation;
    source.cursor = other.cursor;
    ingest(other, id, source, touched);
  }
  showXMode();
  if (view.xDrawn !== xMode()) redrawAll(); // the first env steps of a run, or a new run
  else for (const key of touched) draw(key);
  view.xDrawn = xMode();
  $("empty").hidden = view.charts.size > 0;
  const problems = $("problems");
  problems.hidden = reply.skipped === 0;
  problems.textContent = reply.skipped
    ? `${reply.skipped} line(s) of metrics.jsonl skipped: ${reply.problems.join("; ")}`
    : "";
  return reply;
}

function lineOf(key, service, role, run) {
  let chart = view.charts.get(key);
  if (!chart) {
    chart = { box: makeBox(key), plot: null, lines: new Map() };
    view.charts.set(key, chart);
  }
  let line = chart.lines.get(service);
  if (!line || line.role !== role) {
    // A new line, or one whose label changes: the chart is made again with its series.
    line = line || { t: [], v: [], s: [], run };
    line.role = role;
    chart.lines.set(service, line);
    chart.plot?.destroy();
    chart.plot = null;
  }
  return line;
}

function showXMode() {
  for (const input of document.querySelectorAll('input[name="x-axis"]')) input.checked = input.value === view.xWanted;
  const note = $("x-note");
  note.hidden = xMode() === view.xWanted;
  note.textContent = note.hidden ? "" : "(no env steps reported yet: wall time)";
  document.body.dataset.x = xMode();
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
  if (FEATURED.has(kind(key))) box.classList.add("featured");
  const help = HELP[kind(key)];
  if (help) {
    const text = document.createElement("p");
    text.className = "help";
    text.textContent = help;
    box.append(text);
  }
  const grid = section.querySelector(".charts");
  const order = (k) => [rank(FIRST_KEYS, kind(k)), k];
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

// The shown run's learner first (drawn thick: its curve is the run's), then its other lines by
// name, then the compared runs' in the order they were picked.
function orderedServices(chart) {
  const rankOf = (s) => {
    const line = chart.lines.get(s);
    if (line.run) return 2 + view.compare.indexOf(line.run);
    return line.role === "learner" ? 0 : 1;
  };
  return Array.from(chart.lines.keys()).sort((a, b) => rankOf(a) - rankOf(b) || a.localeCompare(b));
}

function seriesLabel(key, service, role) {
  if (service.includes(SEP)) {
    const [run, name] = service.split(SEP);
    return `${run}: ${name || "(run)"}`;
  }
  const note = ROLE_NOTES[kind(key)]?.[role];
  const name = service || "(run)";
  return note ? `${name} (${note})` : name;
}

const comparing = () => view.compare.length > 0;

// Dots on a line of few points (an actor reports every few seconds), or a short run shows
// its legend entry without a line.
function sparse(u, seriesIdx) {
  let n = 0;
  for (const v of u.data[seriesIdx]) if (v != null && ++n > 30) return false;
  return true;
}

// Exponential moving average with TensorBoard's debiasing (the first points are not pulled
// towards 0): weight w keeps w of the average and adds 1 - w of each new point.
function smooth(values, weight) {
  if (!(weight > 0)) return values;
  let last = 0;
  let debias = 1;
  return values.map((v) => {
    last = last * weight + (1 - weight) * v;
    debias *= weight;
    return last / (1 - debias);
  });
}

function table(line, mode) {
  if (mode === "time") {
    // Compared runs started at different times: each is drawn from its own first record.
    const t0 = line.run ? view.sources.get(line.run)?.t0 : view.t0;
    const xs = comparing() ? line.t.map((t) => t - (t0 ?? t)) : line.t;
    return [xs, smooth(line.v, view.smoothing)];
  }
  const xs = [];
  const ys = [];
  for (let i = 0; i < line.s.length; i++) {
    if (line.s[i] == null) continue; // before the learner's first env-step count
    xs.push(line.s[i]);
    ys.push(line.v[i]);
  }
  return [xs, smooth(ys, view.smoothing)];
}

// A single x (a run's first point) gets uPlot's default span, years on a time axis in seconds:
// a minute either side of it on a time axis, one unit (or a tenth of it) either side otherwise.
function spanned(u, min, max, time) {
  const xs = u.data[0];
  if (!xs?.length || xs[0] !== xs[xs.length - 1]) return [min, max];
  const pad = time ? 60 : Math.max(1, Math.abs(xs[0]) * 0.1);
  return [xs[0] - pad, xs[0] + pad];
}

function draw(key) {
  const chart = view.charts.get(key);
  const mode = xMode();
  const services = orderedServices(chart);
  const tables = services.map((s) => table(chart.lines.get(s), mode));
  // join() sorts by x and lines up the series: env steps of different lines never coincide.
  const data = tables.length === 1 && mode === "time" ? tables[0] : uPlot.join(tables);
  if (!chart.plot) {
    let other = 0;
    const series = services.map((s) => {
      const line = chart.lines.get(s);
      const learner = line.role === "learner";
      if (line.run) {
        const color = COMPARE_COLORS[view.compare.indexOf(line.run) % COMPARE_COLORS.length];
        return {
          label: seriesLabel(key, s, line.role),
          stroke: color,
          width: 1.75,
          dash: [6, 4],
          spanGaps: true,
          points: { show: sparse },
          value: (u, v) => (v == null ? "–" : formatValue(v)),
        };
      }
      return {
        label: seriesLabel(key, s, line.role),
        stroke: learner ? LEARNER_COLOR : COLORS[other++ % COLORS.length],
        width: services.length === 1 ? 1.5 : learner ? 2.5 : 1.25,
        spanGaps: true,
        points: { show: sparse },
        value: (u, v) => (v == null ? "–" : formatValue(v)),
      };
    });
    const steps = mode === "steps";
    const elapsed = !steps && comparing();
    const xSeries = steps
      ? { label: "env steps", value: (u, v) => (v == null ? "–" : formatValue(v)) }
      : elapsed
        ? { label: "time since start", value: (u, v) => (v == null ? "–" : formatElapsed(v)) }
        : { label: "time" };
    const options = {
      width: chartWidth(),
      height: CHART_HEIGHT,
      scales: { x: { time: !steps && !elapsed, range: (u, min, max) => spanned(u, min, max, !steps && !elapsed) } },
      series: [xSeries, ...series],
      axes: [
        steps ? { values: tickValues, size: 36 } : elapsed ? { values: (u, splits) => splits.map(formatElapsed) } : {},
        { values: tickValues, size: axisSize },
      ],
    };
    chart.plot = new uPlot(options, data, chart.box);
  } else {
    chart.plot.setData(data);
  }
  const points = tables.reduce((n, [t]) => n + t.length, 0);
  chart.box.dataset.points = String(points);
}

// --- numbers ------------------------------------------------------------------------------------

const SUFFIXES = [
  [1e12, "T"],
  [1e9, "G"],
  [1e6, "M"],
  [1e3, "k"],
];

// Digits after the point that x needs (read at 6 significant digits, so 0.1 + 0.2 is 0.3).
function decimals(x) {
  const text = String(Number(Math.abs(x).toPrecision(6)));
  const e = text.indexOf("e-");
  if (e >= 0) return Number(text.slice(e + 2)) + (text.slice(0, e).split(".")[1] || "").length;
  return (text.split(".")[1] || "").length;
}

const trim = (text) => (text.includes(".") ? text.replace(/\.?0+$/, "") : text);

// A tick label: as short as the axis allows (1.5k, 2M, 0.25, 5e-4), yet with the digits that
// tell ticks `incr` apart. Without `incr`, three significant digits (legend values).
function formatTick(v, incr) {
  if (v == null || !Number.isFinite(v)) return "";
  const exact = incr > 0;
  if (!exact) v = Number(v.toPrecision(3)); // first, so 999999 becomes 1M, not 1000k
  if (v === 0) return "0";
  const a = Math.abs(v);
  for (const [size, suffix] of SUFFIXES) {
    if (a >= size) {
      const text = exact ? (v / size).toFixed(Math.min(decimals(incr / size), 6)) : (v / size).toPrecision(3);
      return trim(text) + suffix;
    }
  }
  if (exact ? incr < 1e-4 && a < 1e-2 : a < 1e-3) return Number(v.toPrecision(3)).toExponential();
  if (exact) return trim(v.toFixed(Math.min(decimals(incr), 8)));
  return trim(v.toPrecision(3));
}

const formatValue = (v) => formatTick(v);

// Seconds since a run's start as 45s, 12m30s, 2h05m.
function formatElapsed(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

function tickValues(u, splits, axisIdx, space, incr) {
  return splits.map((v) => formatTick(v, incr));
}

// Wide enough for the longest tick label, so none is cut at the chart's left edge.
function axisSize(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1) return axis._size;
  let size = axis.ticks.size + axis.gap + 4;
  const longest = (values || []).reduce((a, v) => (v.length > a.length ? v : a), "");
  if (longest) {
    u.ctx.font = axis.font[0];
    size += u.ctx.measureText(longest).width / devicePixelRatio;
  }
  return Math.ceil(size);
}

// --- services -----------------------------------------------------------------------------------

// The shown run's services: the launcher's own table under `rlfleet up`; under the studio, what
// the run's launcher last wrote to its state file (launch/run_state.py).
async function runServices() {
  if (!view.studio) {
    const live = view.run !== null && view.run === view.current;
    return { live, services: live ? (await getJSON("/api/services")).services : [] };
  }
  if (view.run === null) return { live: false, services: [] };
  const entry = await getJSON(`/api/studio/runs/${encodeURIComponent(view.run)}`).catch(() => null);
  if (!entry) return { live: false, services: [] };
  return { live: entry.state === "running" || entry.services.length > 0, services: entry.services, state: entry.state };
}

async function pollServices() {
  const { live, services, state } = await runServices();
  $("services").hidden = !live;
  const note = $("services-note");
  note.hidden = live;
  const why = state ? `${view.run} is ${state}: no services running.` : `${view.run ?? "This run"} is an earlier run: no services running.`;
  note.textContent = live ? "" : why;
  if (!live) return;
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

for (const input of document.querySelectorAll('input[name="x-axis"]')) {
  input.addEventListener("change", (event) => {
    view.xWanted = event.target.value;
    localStorage.setItem(X_MODE_STORE, view.xWanted);
    showXMode();
    view.xDrawn = xMode();
    redrawAll();
  });
}

$("run-picker").addEventListener("change", (event) => {
  showRun(event.target.value);
  Promise.all([pollMetrics(), pollServices()]).catch(() => {}); // now, not at the next tick
});

$("compare-picker").addEventListener("change", (event) => {
  setCompare(Array.from(event.target.selectedOptions, (o) => o.value));
  pollMetrics().catch(() => {});
});

$("smoothing").value = String(view.smoothing);
$("smoothing-value").textContent = view.smoothing.toFixed(2);
$("smoothing").addEventListener("input", (event) => {
  view.smoothing = Number(event.target.value);
  localStorage.setItem(SMOOTHING_STORE, String(view.smoothing));
  $("smoothing-value").textContent = view.smoothing.toFixed(2);
  for (const key of view.charts.keys()) if (view.charts.get(key).plot) draw(key);
});

window.addEventListener("resize", () => {
  for (const chart of view.charts.values()) chart.plot?.setSize({ width: chartWidth(), height: CHART_HEIGHT });
});

// For tests and the console: the number formatting and what each chart's axes show.
window.rlfleetDashboard = {
  formatTick,
  xMode,
  axes: (key) => {
    const plot = view.charts.get(key)?.plot;
    return plot ? { x: plot.axes[0]._values, y: plot.axes[1]._values, xTime: plot.scales.x.time } : null;
  },
  labels: (key) => view.charts.get(key)?.plot?.series.slice(1).map((s) => s.label) ?? null,
  // The values drawn for one line of a chart (after smoothing), by its label.
  drawn: (key, label) => {
    const plot = view.charts.get(key)?.plot;
    const i = plot ? plot.series.findIndex((s) => s.label === label) : -1;
    return i > 0 ? plot.data[i].filter((v) => v != null) : null;
  },
  smooth,
  view,
  showRun: (runId) => {
    $("run-picker").value = runId;
    showRun(runId);
  },
  setCompare,
  pollMetrics,
};

tick();
