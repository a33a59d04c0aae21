// The studio's views on the dashboard's page, shown when the page is served by `rlfleet studio`
// (launch/studio/app.py answers /api/studio): the runs table with stop / resume / start afresh /
// delete; a new-run form built from the job kind's knob tree (what `rlfleet jobs KIND` prints),
// which writes the run file, validates it with the server's validator (each problem beside the
// field it names) and starts it; and, beside a run's curves, its actions, services, logs, an
// episode video or a prompt box, and export (with a progress bar) then serve. Text from runs
// and the server is set as text, never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const dash = window.rlfleetDashboard;
  const RUNS_MS = 2000;
  const TASK_MS = 1000;
  const LOG_LINES = 200;
  const LIVE = new Set(["running", "starting"]);
  const SAMPLE_PROMPT = "What is 12 + 30?";

  const studio = {
    runs: [],
    schema: null, // the picked job kind's knob tree
    catalogs: {},
    yamlEdited: false,
    entry: null, // the shown run's entry
    logRun: null,
    exported: null, // {run, folder} of the last finished language-model export
    serving: null, // {run, port, name} of the serve run started from the page
  };

  async function api(method, url, body) {
    const init = { method, cache: "no-store", headers: {} };
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(url, init);
    const data = response.status === 204 ? null : await response.json().catch(() => null);
    if (!response.ok) {
      const error = new Error((data && data.detail) || `${response.status} ${response.statusText}`);
      error.status = response.status;
      error.body = data;
      throw error;
    }
    return data;
  }

  const runURL = (id, rest = "") => `/api/studio/runs/${encodeURIComponent(id)}${rest}`;
  const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
  const el = (tag, props = {}, ...children) => {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (k === "dataset") Object.assign(node.dataset, v);
      else if (k in node) node[k] = v;
      else node.setAttribute(k, v);
    }
    node.append(...children);
    return node;
  };

  // --- views ------------------------------------------------------------------------------------

  function setView(name) {
    document.body.dataset.view = name;
    $("view-runs").hidden = name !== "runs";
    $("view-new").hidden = name !== "new";
    $("view-curves").hidden = name !== "curves";
    for (const b of $("studio-nav").querySelectorAll("button")) b.classList.toggle("active", b.dataset.view === name);
    if (name === "curves" && dash.view.run) history.replaceState(null, "", `#run/${dash.view.run}`);
    else history.replaceState(null, "", `#${name}`);
  }

  function openRun(id) {
    if (dash.view.run !== id) dash.showRun(id);
    setView("curves");
    studio.exported = null;
    $("serve-box").hidden = true;
    $("episode-video").hidden = true;
    $("answers").replaceChildren();
    $("ask-status").textContent = $("play-status").textContent = $("export-status").textContent = "";
    $("export-progress").hidden = true;
    refreshRunPanel().catch(() => {});
    dash.pollMetrics().catch(() => {});
  }

  // --- runs -------------------------------------------------------------------------------------

  const ACTIONS = [
    ["stop", "Stop", (r) => LIVE.has(r.state)],
    ["resume", "Resume", (r) => !LIVE.has(r.state) && r.state !== "new"],
    ["restart", "Start afresh", (r) => !LIVE.has(r.state)],
    ["delete", "Delete", (r) => !LIVE.has(r.state)],
  ];

  async function act(run, action) {
    if (action === "delete") {
      if (!confirm(`Delete run '${run}' and everything in its directory?`)) return;
      await api("DELETE", runURL(run));
      if (dash.view.run === run) setView("runs");
    } else if (action === "restart") {
      if (!confirm(`Start '${run}' afresh? Its checkpoints, metrics and logs are deleted first.`)) return;
      await api("POST", runURL(run, "/restart"), {});
    } else {
      await api("POST", runURL(run, `/${action}`), {});
    }
  }

  function actionButtons(entry) {
    return ACTIONS.filter(([, , shown]) => shown(entry)).map(([action, label]) =>
      el("button", {
        type: "button",
        textContent: label,
        dataset: { action, run: entry.id },
        onclick: () =>
          act(entry.id, action)
            .then(refreshRuns)
            .catch((err) => say(`${label} ${entry.id}: ${err.message}`)),
      }),
    );
  }

  function say(text) {
    $("runs-note").textContent = text;
    $("run-message").textContent = text;
  }

  async function refreshRuns() {
    const { runs } = await api("GET", "/api/studio/runs");
    studio.runs = runs;
    const rows = runs.map((r) => {
      const open = el("button", { type: "button", className: "link", textContent: r.id, onclick: () => openRun(r.id) });
      const line = (r.line || "").split("\n")[0];
      const row = el(
        "tr",
        { dataset: { run: r.id, state: r.state } },
        el("td", {}, open),
        el("td", { textContent: r.kind }),
        el("td", { className: "state", textContent: r.state, title: r.message || "" }),
        el("td", { className: "line", textContent: line }),
        el("td", { textContent: when(r.started) }),
        el("td", { className: "buttons" }, ...actionButtons(r)),
      );
      return row;
    });
    $("runs").tBodies[0].replaceChildren(...rows);
    if (!runs.length) $("runs-note").textContent = "No runs yet: start one from New run.";
    if (dash.view.run) await refreshRunPanel();
  }

  async function refreshRunPanel() {
    const id = dash.view.run;
    if (!id) return;
    const entry = studio.runs.find((r) => r.id === id) || (await api("GET", runURL(id)).catch(() => null));
    studio.entry = entry;
    $("run-panel").hidden = !entry;
    for (const panel of document.querySelectorAll(".panels")) panel.hidden = !entry;
    if (!entry) return;
    $("run-title").textContent = entry.id;
    $("run-state").textContent = entry.state;
    $("run-panel").dataset.state = entry.state;
    $("run-line").textContent = entry.line || "";
    $("run-message").textContent = entry.message || "";
    $("run-actions").replaceChildren(...actionButtons(entry));
    $("watch-episode").hidden = entry.watch !== "episode";
    $("watch-prompt").hidden = entry.watch !== "prompt";
    $("watch-none").hidden = entry.watch !== "";
    $("quantize-label").hidden = entry.watch !== "prompt";
    $("export-panel").hidden = entry.watch === "";
    if (entry.watch === "prompt") await refreshEvalSamples(id);
    await refreshLogs(id);
  }

  // --- logs -------------------------------------------------------------------------------------

  async function refreshLogs(id) {
    const { logs } = await api("GET", runURL(id, "/logs"));
    const picker = $("log-picker");
    const have = Array.from(picker.options, (o) => o.value);
    if (logs.join("\n") !== have.join("\n") || studio.logRun !== id) {
      const keep = studio.logRun === id ? picker.value : "";
      picker.replaceChildren(...logs.map((name) => new Option(name, name)));
      picker.value = logs.includes(keep) ? keep : logs.includes("launcher.log") ? "launcher.log" : logs[0] || "";
      studio.logRun = id;
    }
    if (!picker.value) {
      $("log-tail").textContent = "";
      return;
    }
    const { lines } = await api("GET", runURL(id, `/logs/${encodeURIComponent(picker.value)}?lines=${LOG_LINES}`));
    const tail = $("log-tail");
    const atEnd = tail.scrollTop + tail.clientHeight >= tail.scrollHeight - 4;
    tail.textContent = lines.join("\n");
    if (atEnd) tail.scrollTop = tail.scrollHeight;
  }

  // --- tasks: video, ask, export ----------------------------------------------------------------

  async function runTask(run, body, onUpdate) {
    let task = await api("POST", runURL(run, "/tasks"), body);
    onUpdate(task);
    while (task.state === "running") {
      await new Promise((resolve) => setTimeout(resolve, TASK_MS));
      task = await api("GET", `/api/studio/tasks/${task.id}`);
      onUpdate(task);
    }
    if (task.state !== "done") {
      const tail = task.output.slice(-3).join(" / ");
      throw new Error(`${body.kind} failed (exit ${task.exit}): ${tail}`);
    }
    return task;
  }

  const fileURL = (run, path) => runURL(run, `/files/${path.split("/").slice(1).map(encodeURIComponent).join("/")}`);

  async function playEpisode() {
    const run = dash.view.run;
    const status = $("play-status");
    const video = $("episode-video");
    status.textContent = "playing an episode…";
    video.hidden = true;
    try {
      const task = await runTask(run, { kind: "video", deterministic: $("play-greedy").checked }, (t) => {
        if (t.stage) status.textContent = t.stage;
      });
      const [movie, summary] = task.files;
      video.src = fileURL(run, movie);
      video.hidden = false;
      // rlfleet play's summary (--json): mean_return, mean_length over its episodes.
      const result = await fetch(fileURL(run, summary)).then((r) => r.json()).catch(() => null);
      status.textContent = result
        ? `episode return ${Number(result.mean_return).toFixed(1)}, ${result.mean_length} steps`
        : "episode recorded";
    } catch (err) {
      status.textContent = err.message;
    }
  }

  async function askModel() {
    const run = dash.view.run;
    const prompt = $("prompt-box").value.trim() || SAMPLE_PROMPT;
    const status = $("ask-status");
    status.textContent = "loading the latest model…";
    $("answers").replaceChildren();
    try {
      const task = await runTask(run, { kind: "ask", prompt }, () => {});
      const answer = task.result || {};
      status.textContent = answer.source || "";
      $("answers").replaceChildren(
        el("dt", { textContent: "greedy" }),
        el("dd", { className: "answer", dataset: { mode: "greedy" }, textContent: answer.greedy ?? "" }),
        el("dt", { textContent: "sampled" }),
        el("dd", { className: "answer", dataset: { mode: "sampled" }, textContent: answer.sampled ?? "" }),
      );
    } catch (err) {
      status.textContent = err.message;
    }
  }

  async function refreshEvalSamples(id) {
    const { eval: record } = await api("GET", runURL(id, "/eval-samples"));
    const list = $("eval-samples");
    if (!record) {
      list.replaceChildren(el("li", { textContent: "no evaluation yet" }));
      return;
    }
    list.replaceChildren(
      ...record.samples.map((s) => {
        const text = s.messages
          ? s.messages.map((m) => `${m.role}: ${m.content}`).join("\n")
          : `${s.prompt}\n→ ${s.completion}`;
        const score = s.score ?? s.reward;
        return el("li", { title: `version ${record.version}` }, el("pre", { textContent: text }), el("span", { textContent: `score ${score}` }));
      }),
    );
  }

  async function exportRun() {
    const run = dash.view.run;
    const quantize = studio.entry?.watch === "prompt" ? $("quantize").value : "";
    const bar = $("export-progress");
    const status = $("export-status");
    bar.hidden = false;
    bar.value = 0;
    status.textContent = "exporting…";
    $("serve-box").hidden = true;
    try {
      const task = await runTask(run, { kind: "export", quantize: quantize || null }, (t) => {
        if (t.stages_total) bar.value = Math.min(t.stages / t.stages_total, 0.99);
        if (t.stage) status.textContent = t.stage;
      });
      bar.value = 1;
      const folder = task.files[0];
      const files = task.result?.files ? Object.keys(task.result.files).join(", ") : "";
      status.textContent = `exported to runs/${run}/${folder}` + (files ? ` (${files})` : "");
      status.dataset.folder = folder;
      if (studio.entry?.watch === "prompt") {
        studio.exported = { run, folder };
        $("serve-box").hidden = false;
      }
    } catch (err) {
      status.textContent = err.message;
    }
  }

  // --- serve ------------------------------------------------------------------------------------

  async function serveExport() {
    const { run, folder } = studio.exported;
    const { port } = await api("GET", "/api/studio/free-port");
    const name = `${run}-serve`.slice(0, 63);
    const yaml = [
      "# written by rlfleet studio: serve an export over the OpenAI API",
      "run:",
      `  name: ${name}`,
      "job:",
      "  kind: serve",
      `  model: runs/${run}/${folder}`,
      `  served_model_name: ${run}`,
      `  engine: ${$("serve-engine").value}`,
      "  host: 127.0.0.1",
      `  port: ${port}`,
      "",
    ].join("\n");
    const status = $("serve-status");
    try {
      const existing = studio.runs.find((r) => r.id === name);
      if (existing && LIVE.has(existing.state)) await api("POST", runURL(name, "/stop"), {});
      if (existing) await waitFor(name, (e) => !LIVE.has(e.state));
      if (existing) await api("DELETE", runURL(name));
      await api("POST", "/api/studio/runs", { yaml, start: true });
    } catch (err) {
      status.textContent = err.message;
      return;
    }
    studio.serving = { run: name, port, model: run };
    status.textContent = `starting ${name}…`;
    const entry = await waitFor(name, (e) => gatewayUp(e) || ["failed", "stopped", "finished"].includes(e.state), 600);
    if (!gatewayUp(entry)) {
      status.textContent = `${name} ${entry.state}: ${entry.message}`;
      return;
    }
    const base = `http://127.0.0.1:${port}/v1`;
    status.textContent = `serving ${run} at ${base} (run ${name}; stop it from Runs)`;
    status.dataset.baseUrl = base;
    const snippet = $("serve-snippet");
    snippet.hidden = false;
    snippet.textContent = [
      "from openai import OpenAI",
      "",
      `client = OpenAI(base_url="${base}", api_key="unused")`,
      "reply = client.chat.completions.create(",
      `    model="${run}",`,
      `    messages=[{"role": "user", "content": "${SAMPLE_PROMPT}"}],`,
      ")",
      "print(reply.choices[0].message.content)",
    ].join("\n");
  }

  const gatewayUp = (entry) =>
    entry.state === "running" && entry.services.length > 0 && entry.services.every((s) => ["healthy", "running"].includes(s.state));

  async function waitFor(run, done, seconds = 60) {
    const deadline = Date.now() + seconds * 1000;
    for (;;) {
      const entry = await api("GET", runURL(run));
      if (done(entry) || Date.now() > deadline) return entry;
      await new Promise((resolve) => setTimeout(resolve, TASK_MS));
    }
  }

  // --- the new-run form -------------------------------------------------------------------------

  async function loadJobs() {
    const [{ jobs }, catalogs] = await Promise.all([api("GET", "/api/studio/jobs"), api("GET", "/api/studio/catalogs")]);
    studio.catalogs = catalogs;
    $("job-kind").replaceChildren(...jobs.map((j) => new Option(`${j.kind}: ${j.description}`, j.kind)));
    const datalists = [
      ["catalog-envs", (catalogs.envs || []).map((e) => [e.env_id, `${e.kind} env (${e.source})`])],
      ["catalog-rewards", (catalogs.rewards || []).map((r) => [r.name, r.kind])],
    ];
    for (const [id, rows] of datalists) {
      document.body.append(el("datalist", { id }, ...rows.map(([value, label]) => el("option", { value, label }))));
    }
    $("job-kind").value = jobs.some((j) => j.kind === "ppo") ? "ppo" : jobs[0]?.kind;
    await loadSchema($("job-kind").value);
  }

  async function loadSchema(kind) {
    studio.schema = await api("GET", `/api/studio/jobs/${encodeURIComponent(kind)}`);
    $("job-description").textContent = studio.schema.description;
    const runFields = studio.schema.run.fields.filter((f) => f.name !== "dir"); // the studio places runs
    const box = $("form-fields");
    box.replaceChildren(
      fieldset("run", "run", runFields, {}),
      fieldset("job", "job", studio.schema.job.fields, studio.schema.job.notes),
    );
    const stamp = new Date().toISOString().slice(5, 16).replace(/[-T:]/g, "");
    box.querySelector('[data-path="run.name"]').value = `${kind.replace(/_/g, "-")}-${stamp}`;
    studio.yamlEdited = false;
    $("yaml-edited").hidden = true;
    writeYaml();
    $("run-issues").replaceChildren();
  }

  function fieldset(legend, path, fields, notes) {
    const set = el("fieldset", { className: "knobs" }, el("legend", { textContent: legend }));
    for (const f of fields) set.append(fieldRow(f, `${path}.${f.name}`));
    const noteNames = Object.keys(notes || {});
    if (noteNames.length) {
      const list = el("dl", { className: "notes" });
      for (const name of noteNames) list.append(el("dt", { textContent: name }), el("dd", { textContent: notes[name] }));
      set.append(el("details", {}, el("summary", { textContent: "names other tools use" }), list));
    }
    return set;
  }

  function describe(f) {
    const parts = [f.type];
    if (f.required) parts.push("required");
    else if (f.default !== null && typeof f.default !== "object") parts.push(`default ${f.default}`);
    const bounds = Object.entries(f.bounds).map(([op, v]) => `${op}${v}`);
    if (bounds.length) parts.push(bounds.join(", "));
    if (f.aliases.length) parts.push(`also called ${f.aliases.join(", ")}`);
    if (f.name === "rewards" && studio.catalogs.rewards?.length) {
      parts.push(`installed: ${studio.catalogs.rewards.map((r) => r.name).join(", ")}`);
    }
    return parts.join(" · ");
  }

  function fieldRow(f, path) {
    if (f.input === "model" && f.fields) {
      const inner = fieldset(f.name, path, f.fields, {});
      return el("details", { className: "nested", dataset: { field: path } }, el("summary", { textContent: `${f.name} — ${f.description}` }), inner);
    }
    const id = `knob-${path}`;
    let input;
    if (f.input === "bool" || f.input === "choice") {
      const choices = f.input === "bool" ? [true, false] : f.choices;
      const fallback = f.default === null ? "unset" : String(f.default);
      input = el("select", {}, new Option(f.required ? "(pick one)" : `(default: ${fallback})`, ""));
      for (const c of choices) input.append(new Option(String(c), JSON.stringify(c)));
    } else if (f.input === "int" || f.input === "float") {
      input = el("input", { type: "number", step: f.input === "int" ? "1" : "any" });
      if (f.bounds[">="] !== undefined) input.min = f.bounds[">="];
      if (f.bounds["<="] !== undefined) input.max = f.bounds["<="];
      if (f.default !== null) input.placeholder = String(f.default);
    } else if (f.input === "str") {
      input = el("input", { type: "text" });
      if (/(^|_)env(_id)?$/.test(f.name)) input.setAttribute("list", "catalog-envs");
      if (/reward/.test(f.name)) input.setAttribute("list", "catalog-rewards");
      if (f.default !== null) input.placeholder = String(f.default);
    } else {
      input = el("textarea", { rows: 2, placeholder: f.default === null ? "YAML" : JSON.stringify(f.default) });
      input.title = "YAML: a list as [a, b], a mapping as {key: value}";
    }
    input.id = id;
    input.dataset.path = path;
    input.dataset.input = f.input;
    input.addEventListener("input", () => writeYaml());
    return el(
      "div",
      { className: "field", dataset: { field: path } },
      el("label", { htmlFor: id, textContent: f.name + (f.required ? " *" : "") }),
      input,
      el("small", { className: "meta", textContent: describe(f) }),
      el("p", { className: "help", textContent: f.description }),
      el("p", { className: "issue" }),
    );
  }

  // The form's filled-in knobs as {run: {...}, job: {kind, ...}}; textareas stay YAML text.
  function formValues() {
    const root = { run: {}, job: { kind: studio.schema.kind } };
    for (const input of $("form-fields").querySelectorAll("[data-path]")) {
      const raw = input.value.trim();
      if (raw === "") continue;
      const path = input.dataset.path.split(".");
      let node = root;
      for (const key of path.slice(0, -1)) node = node[key] ??= {};
      const kind = input.dataset.input;
      if (kind === "bool" || kind === "choice") node[path.at(-1)] = JSON.parse(raw);
      else if (kind === "int" || kind === "float") node[path.at(-1)] = Number(raw);
      else if (kind === "str") node[path.at(-1)] = raw;
      else node[path.at(-1)] = { yaml: raw };
    }
    return root;
  }

  const PLAIN = /^[A-Za-z_/.][\w./@+-]*$/;
  const RESERVED = /^(true|false|yes|no|on|off|null|~|y|n)$/i;

  function scalar(v) {
    if (typeof v === "string") return PLAIN.test(v) && !RESERVED.test(v) ? v : JSON.stringify(v);
    return String(v);
  }

  function toYaml(node, indent) {
    const lines = [];
    for (const [key, value] of Object.entries(node)) {
      if (value && typeof value === "object" && "yaml" in value) {
        const text = value.yaml.split("\n");
        if (text.length === 1) lines.push(`${indent}${key}: ${text[0]}`);
        else lines.push(`${indent}${key}:`, ...text.map((t) => `${indent}  ${t}`));
      } else if (value && typeof value === "object") {
        lines.push(`${indent}${key}:`, ...toYaml(value, indent + "  "));
      } else {
        lines.push(`${indent}${key}: ${scalar(value)}`);
      }
    }
    return lines;
  }

  function writeYaml() {
    if (studio.yamlEdited || !studio.schema) return;
    const values = formValues();
    const text = [`# written by rlfleet studio (job kind ${studio.schema.kind})`, ...toYaml(values, ""), ""].join("\n");
    $("run-yaml").value = text;
  }

  function runName() {
    const match = /^\s+name:\s*("?)([a-z0-9-]+)\1\s*$/m.exec($("run-yaml").value);
    return match ? match[2] : "run";
  }

  function showIssues(error) {
    for (const row of document.querySelectorAll(".field, .nested")) {
      row.classList.remove("invalid");
      const issue = row.querySelector(":scope > .issue");
      if (issue) issue.textContent = "";
    }
    const list = $("run-issues");
    if (!error) {
      list.replaceChildren();
      return;
    }
    const issues = error.body?.issues?.length ? error.body.issues : [{ path: "", line: null, message: error.message }];
    list.replaceChildren(
      ...issues.map((i) => el("li", { className: "error", textContent: `${i.line ? `line ${i.line}: ` : ""}${i.path ? `${i.path}: ` : ""}${i.message}` })),
    );
    for (const issue of issues) {
      // The field the path names, or the nearest enclosing one the form has.
      const parts = issue.path.split(".");
      for (let n = parts.length; n > 1; n--) {
        const row = document.querySelector(`[data-field="${CSS.escape(parts.slice(0, n).join("."))}"]`);
        if (!row) continue;
        row.classList.add("invalid");
        const slot = row.querySelector(":scope > .issue");
        if (slot) slot.textContent = issue.message;
        if (row.tagName === "DETAILS") row.open = true;
        break;
      }
    }
  }

  async function validateRun() {
    try {
      const reply = await api("POST", "/api/studio/validate", { yaml: $("run-yaml").value });
      showIssues(null);
      $("run-issues").replaceChildren(
        el("li", { className: "ok", textContent: `valid: run '${reply.run}', services ${reply.services.join(", ")}` }),
      );
      return true;
    } catch (err) {
      showIssues(err);
      return false;
    }
  }

  async function startRun() {
    try {
      const entry = await api("POST", "/api/studio/runs", { yaml: $("run-yaml").value, start: true });
      showIssues(null);
      await refreshRuns().catch(() => {});
      openRun(entry.id);
    } catch (err) {
      showIssues(err);
    }
  }

  function downloadRun() {
    const blob = new Blob([$("run-yaml").value], { type: "application/yaml" });
    const link = el("a", { href: URL.createObjectURL(blob), download: `${runName()}.yaml` });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 1000);
  }

  // --- start ------------------------------------------------------------------------------------

  async function loop() {
    try {
      if (document.body.dataset.view !== "new") await refreshRuns();
    } catch (err) {
      say(`cannot reach the studio: ${err.message}`);
    }
    setTimeout(loop, RUNS_MS);
  }

  async function start() {
    const about = await fetch("/api/studio", { cache: "no-store" }).catch(() => null);
    if (!about || !about.ok) return; // the dashboard of `rlfleet up`: no studio
    const { runs_dir: runsDir } = await about.json();
    dash.view.studio = true;
    document.title = "rlfleet studio";
    document.body.classList.add("studio");
    $("studio-nav").hidden = false;
    for (const node of document.querySelectorAll(".studio-only")) node.hidden = false;
    $("runs-note").textContent = `runs in ${runsDir}`;
    for (const b of $("studio-nav").querySelectorAll("button")) b.addEventListener("click", () => setView(b.dataset.view));
    $("new-run-button").addEventListener("click", () => setView("new"));
    $("job-kind").addEventListener("change", (e) => loadSchema(e.target.value));
    $("run-yaml").addEventListener("input", () => {
      studio.yamlEdited = true;
      $("yaml-edited").hidden = false;
    });
    $("reset-yaml").addEventListener("click", () => {
      studio.yamlEdited = false;
      $("yaml-edited").hidden = true;
      writeYaml();
    });
    $("validate-run").addEventListener("click", validateRun);
    $("start-run").addEventListener("click", startRun);
    $("download-run").addEventListener("click", downloadRun);
    $("play-episode").addEventListener("click", playEpisode);
    $("ask-model").addEventListener("click", askModel);
    $("export-run").addEventListener("click", exportRun);
    $("serve-export").addEventListener("click", serveExport);
    $("log-picker").addEventListener("change", () => refreshLogs(dash.view.run).catch(() => {}));
    $("run-picker").addEventListener("change", () => openRun(dash.view.run));
    const hash = location.hash.slice(1);
    if (!hash.startsWith("run/")) setView(["new", "curves"].includes(hash) ? hash : "runs");
    await loadJobs().catch((err) => say(`cannot load the job kinds: ${err.message}`));
    await refreshRuns().catch(() => {});
    if (hash.startsWith("run/")) openRun(decodeURIComponent(hash.slice(4)));
    loop();
  }

  window.rlfleetStudio = { openRun, setView, formValues, toYaml, refreshRuns, studio };
  start();
})();
