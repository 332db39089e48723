// beamline's decoding playground: one prompt, up to four strategies side by side, each a request
// to the public API (what this page does, a script can do). Model output is inserted as text only.
"use strict";

const MAX_COLUMNS = 4;
let apiKey = null; // kept in memory only
let model = null; // the /v1/models card: id, max_model_len, limits

// Settings each strategy shows: [request field, label, default, kind, limit name].
const COMMON_SAMPLING = [
  ["temperature", "temperature", 0.8, "float"],
  ["top_k", "top-k (0 off)", 0, "int"],
  ["top_p", "top-p", 1, "float"],
  ["min_p", "min-p", 0, "float"],
  ["typical_p", "typical-p", 1, "float"],
  ["seed", "seed (blank: random)", "", "int"],
];
const PENALTIES = [
  ["repetition_penalty", "repetition penalty", 1, "float"],
  ["presence_penalty", "presence penalty", 0, "float"],
  ["frequency_penalty", "frequency penalty", 0, "float"],
];
const STRATEGIES = {
  greedy: { label: "Greedy", fixed: { temperature: 0 }, fields: [...PENALTIES] },
  sampling: {
    label: "Sampling",
    fixed: {},
    fields: [...COMMON_SAMPLING, ...PENALTIES, ["n", "n (choices)", 1, "int", "max_n"]],
  },
  beam: {
    label: "Beam search",
    fixed: {},
    fields: [
      ["num_beams", "num_beams", 4, "int", "max_num_beams"],
      ["n", "n (hypotheses)", 4, "int", "max_num_beams"],
      ["length_penalty", "length penalty", 1, "float"],
      ["early_stopping", "early stopping", "false", ["false", "true", "never"]],
    ],
  },
  diverse: {
    label: "Diverse beam search",
    fixed: {},
    fields: [
      ["num_beams", "num_beams", 4, "int", "max_num_beams"],
      ["num_beam_groups", "groups", 2, "int", "max_num_beams"],
      ["diversity_penalty", "diversity penalty", 1, "float"],
      ["n", "n (hypotheses)", 4, "int", "max_num_beams"],
      ["length_penalty", "length penalty", 1, "float"],
    ],
  },
  beam_sample: {
    label: "Beam sampling",
    fixed: { do_sample: true },
    fields: [
      ["num_beams", "num_beams", 4, "int", "max_num_beams"],
      ["n", "n (hypotheses)", 4, "int", "max_num_beams"],
      ["temperature", "temperature", 1, "float"],
      ["top_k", "top-k (0 off)", 0, "int"],
      ["top_p", "top-p", 1, "float"],
      ["seed", "seed (blank: random)", "", "int"],
    ],
  },
  best_of: {
    label: "Sample and rank (best_of)",
    fixed: {},
    fields: [
      ["best_of", "best_of (drawn)", 4, "int", "max_best_of"],
      ["n", "n (returned)", 2, "int", "max_n"],
      ["temperature", "temperature", 0.8, "float"],
      ["seed", "seed (blank: random)", "", "int"],
    ],
  },
};
const WHOLE_AT_END = new Set(["beam", "diverse", "beam_sample", "best_of"]);

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function errorMessage(resp) {
  try {
    const body = await resp.json();
    return `${resp.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch {
    return `${resp.status} ${resp.statusText}`;
  }
}

// ---- the model and its limits ------------------------------------------------------------------
async function loadModel() {
  const info = document.getElementById("model-info");
  const resp = await fetch("/v1/models", { headers: headers() });
  if (resp.status === 401) {
    document.getElementById("key-panel").hidden = false;
    info.textContent = "This server needs an API key.";
    return;
  }
  if (!resp.ok) {
    info.textContent = `Cannot reach the API: ${await errorMessage(resp)}`;
    return;
  }
  model = (await resp.json()).data[0];
  document.getElementById("key-panel").hidden = true;
  const l = model.limits || {};
  info.textContent =
    `Model ${model.id} · context ${model.max_model_len} tokens · at most ` +
    `${l.max_num_beams} beams, n ${l.max_n}, best_of ${l.max_best_of}, logprobs ${l.max_logprobs}`;
  document.getElementById("max-tokens").max = String(model.max_model_len);
  for (const column of document.querySelectorAll(".column")) applyLimits(column);
}

function applyLimits(column) {
  if (!model || !model.limits) return;
  for (const input of column.querySelectorAll("input[data-limit]")) {
    input.max = String(model.limits[input.dataset.limit]);
  }
}

// ---- columns -----------------------------------------------------------------------------------
function addColumn(strategy) {
  const columns = document.getElementById("columns");
  if (columns.children.length >= MAX_COLUMNS) return;
  const select = el("select", { "aria-label": "strategy" });
  for (const [key, s] of Object.entries(STRATEGIES)) {
    select.append(el("option", { value: key, text: s.label }));
  }
  select.value = strategy;
  const settings = el("div", { class: "settings" });
  const constraintKind = el("select", { "aria-label": "constraint" });
  for (const [value, label] of [["none", "no constraint"], ["json", "JSON schema"], ["regex", "regex"]]) {
    constraintKind.append(el("option", { value, text: label }));
  }
  const constraintText = el("textarea", { rows: "3", spellcheck: "false", hidden: "" });
  constraintKind.addEventListener("change", () => {
    constraintText.hidden = constraintKind.value === "none";
    if (constraintKind.value === "json" && !constraintText.value) {
      constraintText.value = '{"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}';
    } else if (constraintKind.value === "regex" && !constraintText.value) {
      constraintText.value = "(yes|no), because [a-z ]{1,40}\\.";
    }
  });
  const column = el(
    "section",
    { class: "column", "data-state": "idle" },
    el(
      "div",
      { class: "column-head" },
      select,
      el("button", { type: "button", title: "remove this column", "aria-label": "remove column", text: "×", onclick: () => column.remove() }),
    ),
    settings,
    el("div", { class: "constraint" }, el("label", {}, "output ", constraintKind), constraintText),
    el("div", { class: "status", text: "" }),
    el("div", { class: "choices" }),
  );
  column.dataset.strategy = strategy;
  select.addEventListener("change", () => {
    column.dataset.strategy = select.value;
    renderSettings(column);
  });
  columns.append(column);
  renderSettings(column);
  return column;
}

function renderSettings(column) {
  const settings = column.querySelector(".settings");
  settings.replaceChildren();
  for (const [name, label, value, kind, limit] of STRATEGIES[column.dataset.strategy].fields) {
    let input;
    if (Array.isArray(kind)) {
      input = el("select", { name });
      for (const option of kind) input.append(el("option", { value: option, text: option }));
      input.value = value;
    } else {
      input = el("input", { name, type: "number", step: kind === "int" ? "1" : "any" });
      input.value = String(value);
      if (kind === "int") input.min = "0";
      if (limit) input.dataset.limit = limit;
    }
    input.dataset.kind = Array.isArray(kind) ? "choice" : kind;
    settings.append(el("label", {}, label, input));
  }
  applyLimits(column);
}

function columnFields(column) {
  const strategy = STRATEGIES[column.dataset.strategy];
  const body = { ...strategy.fixed };
  for (const input of column.querySelectorAll(".settings [name]")) {
    const raw = input.value.trim();
    if (raw === "") continue;
    if (input.dataset.kind === "choice") {
      body[input.name] = raw === "never" ? "never" : raw === "true";
    } else {
      body[input.name] = input.dataset.kind === "int" ? parseInt(raw, 10) : parseFloat(raw);
    }
  }
  const kind = column.querySelector(".constraint select").value;
  const text = column.querySelector(".constraint textarea").value;
  if (kind === "json") body.structured_outputs = { json: JSON.parse(text) };
  if (kind === "regex") body.structured_outputs = { regex: text };
  return body;
}

// ---- running -----------------------------------------------------------------------------------
function requestBody(column, chat) {
  const prompt = document.getElementById("prompt").value;
  const body = {
    model: model ? model.id : undefined,
    max_tokens: parseInt(document.getElementById("max-tokens").value, 10),
    stream: true,
    stream_options: { include_usage: true },
    ...columnFields(column),
  };
  const withLogprobs = !model || !model.limits || model.limits.max_logprobs >= 1;
  if (chat) {
    body.messages = [{ role: "user", content: prompt }];
    if (withLogprobs) Object.assign(body, { logprobs: true, top_logprobs: 1 });
  } else {
    body.prompt = prompt;
    if (withLogprobs) body.logprobs = 1;
  }
  return body;
}

// Each chunk's logprobs as [{token, logprob, top: [[token, logprob]]}].
function chunkTokens(choice, chat) {
  const lp = choice.logprobs;
  if (!lp) return [];
  if (chat) {
    return (lp.content || []).map((t) => ({
      token: t.token,
      logprob: t.logprob,
      top: (t.top_logprobs || []).map((a) => [a.token, a.logprob]),
    }));
  }
  return lp.tokens.map((token, i) => ({
    token,
    logprob: lp.token_logprobs[i],
    top: Object.entries(lp.top_logprobs[i] || {}),
  }));
}

function tokenSpan(text, info) {
  const span = el("span", { class: "tok", text });
  if (info && info.logprob !== null && info.logprob !== undefined) {
    const p = Math.exp(info.logprob);
    const alternatives = info.top.map(([t, lp]) => `${JSON.stringify(t)} ${lp.toFixed(3)}`).join(", ");
    span.title = `${JSON.stringify(info.token)}: logprob ${info.logprob.toFixed(3)} (p ${p.toFixed(3)})` +
      (alternatives ? `\ntop: ${alternatives}` : "");
    span.style.backgroundColor = `rgba(var(--token), ${(0.08 + 0.3 * (1 - p)).toFixed(3)})`;
    span.dataset.logprob = String(info.logprob);
  }
  return span;
}

// Text is what the API returned; tokens only annotate it (when they spell it out exactly).
function appendText(target, text, tokens) {
  if (!text) return;
  if (tokens.length && tokens.map((t) => t.token).join("") === text) {
    for (const t of tokens) target.append(tokenSpan(t.token, t));
  } else if (tokens.length === 1) {
    target.append(tokenSpan(text, tokens[0]));
  } else {
    target.append(document.createTextNode(text));
  }
}

function choiceBox(column, index, choice) {
  const list = column.querySelector(".choices");
  let box = list.querySelector(`.choice[data-index="${index}"]`);
  if (!box) {
    box = el("div", { class: "choice", "data-index": String(index) },
      el("div", { class: "choice-head", text: `choice ${index}` }),
      el("div", { class: "choice-text" }));
    let parent = list;
    if (choice.beam_group !== undefined) {  // diverse beams: hypotheses by group
      const gid = `group-${choice.beam_group}`;
      parent = list.querySelector(`[data-group="${gid}"]`);
      if (!parent) {
        parent = el("div", { "data-group": gid },
          el("div", { class: "group-title", text: `group ${choice.beam_group}` }));
        list.append(parent);
      }
    }
    parent.append(box);
  }
  if (choice.beam_score !== undefined) {
    box.dataset.score = String(choice.beam_score);
    box.querySelector(".choice-head").textContent =
      `hypothesis ${index} · score ${choice.beam_score.toFixed(4)}` +
      (choice.beam_group !== undefined ? ` · group ${choice.beam_group}` : "");
  }
  return box;
}

async function runColumn(column, chat) {
  const status = column.querySelector(".status");
  const list = column.querySelector(".choices");
  list.replaceChildren();
  status.classList.remove("error");
  column.dataset.state = "running";
  let body;
  try {
    body = requestBody(column, chat);
  } catch (err) {
    status.textContent = `Invalid constraint: ${err.message}`;
    status.classList.add("error");
    column.dataset.state = "error";
    return;
  }
  const whole = WHOLE_AT_END.has(column.dataset.strategy);
  status.textContent = whole ? "running… (beam and best_of results arrive at the end)" : "running…";
  const started = performance.now();
  let firstAt = null;
  let usage = null;
  try {
    const resp = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
    });
    if (resp.status === 401) document.getElementById("key-panel").hidden = false;
    if (!resp.ok) throw new Error(await errorMessage(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const text = chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          const box = choiceBox(column, choice.index, choice);
          if (text && firstAt === null) firstAt = performance.now();
          appendText(box.querySelector(".choice-text"), text, chunkTokens(choice, chat));
          if (choice.finish_reason) box.dataset.finish = choice.finish_reason;
        }
      }
    }
    const seconds = (performance.now() - started) / 1000;
    const ttft = firstAt === null ? "–" : `${((firstAt - started) / 1000).toFixed(2)} s`;
    const tokens = usage ? usage.completion_tokens : 0;
    status.textContent = `done · TTFT ${ttft} · ${tokens} tokens · ${(tokens / seconds).toFixed(1)} tok/s`;
    column.dataset.state = "done";
  } catch (err) {
    status.textContent = `Error: ${err.message}`;
    status.classList.add("error");
    column.dataset.state = "error";
  }
}

async function runAll() {
  const button = document.getElementById("run");
  button.disabled = true;
  const chat = document.querySelector('input[name="mode"]:checked').value === "chat";
  try {
    await Promise.all([...document.querySelectorAll(".column")].map((c) => runColumn(c, chat)));
  } finally {
    button.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("run").addEventListener("click", runAll);
  document.getElementById("add-column").addEventListener("click", () => addColumn("sampling"));
  document.getElementById("key-use").addEventListener("click", () => {
    apiKey = document.getElementById("api-key").value.trim() || null;
    loadModel();
  });
  addColumn("greedy");
  addColumn("beam");
  loadModel();
});
