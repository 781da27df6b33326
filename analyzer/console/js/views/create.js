// Create a study (POST /v1/studies): columns with their bounds, the label, the kind (auto by
// default, with the recommendation of POST /v1/recommend: upload bytes per kind, and on request
// the predicted accuracy), the privacy target, and for a histogram its bins.

import { api } from "../api.js";
import { bytes, check, clear, errorBox, field, h, numCell, table } from "../dom.js";

const KINDS = [
  ["auto", "auto: the analyzer chooses (gram when its upload fits, else sketch)"],
  ["gram", "gram: central-model accuracy, about d²/2 values per report"],
  ["sketch", "sketch: OSNAP sketch, d values per report"],
  ["moments", "moments: the Gram alone (no column sums)"],
  ["l1", "l1: for least absolute deviations"],
  ["histogram", "histogram: counts in bins of one or two columns"],
];

function columnRow(index, onChange, onRemove) {
  const n = index + 1;
  const name = h("input", { type: "text", class: "name", "aria-label": `Column ${n} name`, "data-col": "name", spellcheck: "false" });
  const lower = h("input", { type: "number", step: "any", "aria-label": `Column ${n} lower bound`, "data-col": "lower" });
  const upper = h("input", { type: "number", step: "any", "aria-label": `Column ${n} upper bound`, "data-col": "upper" });
  const bins = h("input", { type: "text", "aria-label": `Column ${n} histogram bins`, "data-col": "bins", placeholder: "edges 0, 10, 20 or categories a, b" });
  const remove = h("button", { type: "button", class: "secondary", "aria-label": `Remove column ${n}`, onclick: onRemove }, "Remove");
  for (const input of [name, lower, upper, bins]) input.addEventListener("input", onChange);
  return { name, lower, upper, bins, tr: h("tr", { "data-column-row": String(n) }, h("td", {}, name), h("td", {}, lower), h("td", {}, upper), h("td", { "data-bins-cell": "" }, bins), h("td", {}, remove)) };
}

function parseBins(column, text) {
  const parts = text.split(",").map((x) => x.trim()).filter(Boolean);
  if (!parts.length) throw new Error(`give the bins of ${column}`);
  const numbers = parts.map(Number);
  return numbers.every(Number.isFinite) ? { column, edges: numbers } : { column, categories: parts };
}

export async function renderCreate(ctx) {
  const { main } = ctx;
  const rows = [];
  const tbody = h("tbody");
  const name = h("input", { type: "text", id: "study-name", required: true, maxlength: "200" });
  const useBounds = h("input", { id: "use-bounds", checked: true });
  const label = h("select", { id: "study-label" });
  const expected = h("input", { type: "number", id: "expected-reports", min: "2", step: "1", required: true });
  const epsilon = h("input", { type: "number", id: "epsilon", value: "1", min: "0", step: "any" });
  const delta = h("input", { type: "number", id: "delta", value: "0.000001", min: "0", step: "any" });
  const neighbouring = h("select", { id: "neighbouring" },
    h("option", { value: "replace-one" }, "replace-one (sensitivity 2B)"),
    h("option", { value: "add-remove" }, "add/remove (sensitivity B; servers hide counts)"));
  const floor = h("input", { type: "number", id: "epsilon-floor", min: "0", step: "any", placeholder: "default: max(4, ε)" });
  const population = h("input", { type: "text", id: "population", spellcheck: "false" });
  const minReports = h("input", { type: "number", id: "min-reports", min: "1", step: "1", placeholder: "default" });
  const maxReports = h("input", { type: "number", id: "max-reports", min: "1", step: "1", placeholder: "default" });
  const rowBound = h("input", { type: "number", id: "row-bound", value: "1", min: "0", step: "any" });
  const t = h("input", { type: "number", id: "t", value: "0", min: "0", step: "1" });
  const kindInputs = KINDS.map(([value]) => h("input", { type: "radio", name: "kind", id: `kind-${value}`, value, checked: value === "auto" }));
  const recommendation = h("div", { id: "recommendation", "aria-live": "polite" });
  const predict = h("button", { type: "button", class: "secondary", id: "predict" }, "Predict accuracy (simulates; seconds)");
  const preview = h("pre", { id: "request-preview" });
  const status = h("div", { id: "create-status" });
  const submit = h("button", { type: "submit", id: "create" }, "Create study");

  const kind = () => kindInputs.find((k) => k.checked).value;
  const columns = () => rows.map((r) => r.name.value.trim());
  const number = (input) => (input.value.trim() === "" ? undefined : Number(input.value));

  function body() {
    const out = { name: name.value.trim(), expected_reports: number(expected), epsilon: number(epsilon), delta: number(delta), neighbouring: neighbouring.value, kind: kind() };
    const cols = columns();
    if (kind() === "histogram") {
      out.histogram = { axes: rows.map((r, i) => parseBins(cols[i], r.bins.value)) };
    } else {
      out.columns = cols;
      if (label.value) out.label = label.value;
      if (useBounds.checked) out.bounds = Object.fromEntries(rows.map((r, i) => [cols[i], [number(r.lower), number(r.upper)]]));
    }
    for (const [key, input] of [["epsilon_floor", floor], ["min_reports", minReports], ["max_reports", maxReports], ["row_bound", rowBound], ["t", t]]) {
      const v = number(input);
      if (v !== undefined) out[key] = v;
    }
    if (population.value.trim()) out.population = population.value.trim();
    return out;
  }

  function syncForm() {
    const cols = columns();
    const previous = label.value;
    clear(label).append(h("option", { value: "" }, "(none)"), ...cols.filter(Boolean).map((c) => h("option", { value: c }, c)));
    label.value = cols.includes(previous) ? previous : (cols.filter(Boolean).slice(-1)[0] || "");
    const histogram = kind() === "histogram";
    for (const r of rows) {
      r.lower.disabled = histogram || !useBounds.checked;
      r.upper.disabled = histogram || !useBounds.checked;
      r.bins.disabled = !histogram;
    }
    label.disabled = histogram;
    try {
      preview.textContent = JSON.stringify(body(), null, 2);
    } catch (error) {
      preview.textContent = String(error.message);
    }
    scheduleRecommendation();
  }

  function addRow() {
    const r = columnRow(rows.length, syncForm, () => {
      if (rows.length <= 1) return;
      rows.splice(rows.indexOf(r), 1);
      r.tr.remove();
      syncForm();
    });
    rows.push(r);
    tbody.append(r.tr);
    syncForm();
    return r;
  }

  // The recommendation depends on d, n, the privacy target and the kind only: ask again when one
  // of them changed (each new design costs the analyzer up to a second), after a pause in typing.
  let timer = null;
  let asked = 0;
  let lastAsked = null;
  function scheduleRecommendation() {
    clearTimeout(timer);
    timer = setTimeout(() => {
      const key = JSON.stringify([rows.length, expected.value, epsilon.value, delta.value, neighbouring.value, floor.value, rowBound.value, t.value, kind()]);
      if (key !== lastAsked) {
        lastAsked = key;
        recommend(false);
      }
    }, 500);
  }

  async function recommend(withPrediction) {
    const n = number(expected);
    const d = rows.length;
    if (!(n >= 2) || kind() === "histogram") {
      clear(recommendation).append(h("p", { class: "note" }, kind() === "histogram"
        ? "A histogram study shares one count per cell; the recommendation compares gram and sketch studies."
        : "Enter the expected number of reports to see what each kind costs."));
      return;
    }
    const request = { d, expected_reports: n, epsilon: number(epsilon), delta: number(delta), neighbouring: neighbouring.value, row_bound: number(rowBound), t: number(t), predict: withPrediction };
    if (number(floor) !== undefined) request.epsilon_floor = number(floor);
    asked += 1;
    const mine = asked;
    if (withPrediction) clear(recommendation).append(h("p", { class: "status" }, "Simulating each kind on synthetic data of this size…"));
    try {
      const rec = await api.recommend(request);
      if (mine !== asked) return;
      clear(recommendation).append(...recommendationParts(rec, withPrediction));
    } catch (error) {
      if (mine === asked) clear(recommendation).append(errorBox(error));
    }
  }
  predict.addEventListener("click", () => recommend(true));

  const form = h("form", { id: "create-form", novalidate: true },
    field("Study name", name),
    h("fieldset", {},
      h("legend", {}, "Columns"),
      h("p", { class: "note" }, "Every value is clamped by its client to its column's public range [lower, upper]; analyses then answer in these units with an intercept."),
      h("table", { class: "columns" },
        h("caption", { class: "visually-hidden" }, "Columns and their bounds"),
        h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Name"), h("th", { scope: "col" }, "Lower"), h("th", { scope: "col" }, "Upper"), h("th", { scope: "col" }, "Histogram bins"), h("th", { scope: "col" }, h("span", { class: "visually-hidden" }, "Remove")))),
        tbody),
      h("div", { class: "actions" }, h("button", { type: "button", class: "secondary", id: "add-column", onclick: () => addRow().name.focus() }, "Add column")),
      check("Declare bounds (recommended: answers in the data's units)", useBounds),
      field("Label (the column regressions predict)", label)),
    h("fieldset", { id: "kind" },
      h("legend", {}, "Kind"),
      ...KINDS.map(([value, text], i) => h("div", { class: "check" }, kindInputs[i], h("label", { for: `kind-${value}` }, text))),
      h("h2", { class: "minor" }, "What each kind costs"),
      recommendation,
      predict),
    h("fieldset", {},
      h("legend", {}, "Privacy target"),
      h("div", { class: "row" },
        field("Expected reports", expected),
        field("ε", epsilon),
        field("δ", delta),
        field("Neighbouring", neighbouring),
        field("Floor ε", floor, "blank: the default"),
        field("Population (charged to its ledger)", population, "optional"))),
    h("details", {}, h("summary", {}, "Advanced"),
      h("div", { class: "row" }, field("Min reports", minReports), field("Max reports", maxReports), field("Row bound B", rowBound), field("Tolerated corrupt clients t", t))),
    h("details", {}, h("summary", {}, "The request this form sends"), preview),
    h("div", { class: "actions" }, submit),
    status);
  for (const input of [name, expected, epsilon, delta, floor, population, minReports, maxReports, rowBound, t]) input.addEventListener("input", syncForm);
  for (const input of [neighbouring, label, useBounds, ...kindInputs]) input.addEventListener("change", syncForm);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(status);
    let request;
    try {
      if (!name.value.trim()) throw new Error("give the study a name");
      if (columns().some((c) => !c)) throw new Error("every column needs a name");
      request = body();
    } catch (error) {
      status.append(errorBox(error));
      return;
    }
    submit.disabled = true;
    status.append(h("p", { class: "status" }, "Creating the study on every share server…"));
    try {
      const created = await api.create(request);
      ctx.navigate(`/study/${created.study_id}`);
    } catch (error) {
      clear(status).append(errorBox(error));
      submit.disabled = false;
    }
  });

  clear(main);
  main.append(h("h1", {}, "New study"),
    h("p", { class: "lede" }, "A study is immutable once created: its columns, bounds, kind and privacy target are public, and every share server checks them."),
    form);
  addRow();
  addRow();
  name.focus();
}

function recommendationParts(rec, withPrediction) {
  const predicted = withPrediction && rec.options.some((o) => o.predicted && Object.keys(o.predicted).length);
  const headers = ["Kind", h("th", { scope: "col", class: "num" }, "Values per report"), h("th", { scope: "col", class: "num" }, "Upload per client (all servers)"),
    h("th", { scope: "col", class: "num" }, "Per server"), h("th", { scope: "col", class: "num" }, "Client noise σ")];
  if (predicted) headers.push(h("th", { scope: "col", class: "num" }, "Predicted ridge error ratio"), h("th", { scope: "col", class: "num" }, "Predicted PCA error ratio"));
  headers.push("Note");
  const rows = rec.options.map((o) => h("tr", { "data-kind": o.kind },
    h("th", { scope: "row" }, o.kind, o.kind === rec.kind ? " (recommended)" : ""),
    numCell(o.width), h("td", { class: "num", "data-value": String(o.upload_bytes) }, bytes(o.upload_bytes)),
    h("td", { class: "num", "data-value": String(o.share_bytes) }, bytes(o.share_bytes)), numCell(o.sigma),
    predicted ? [numCell(o.predicted?.ridge ?? null), numCell(o.predicted?.pca ?? null)] : null,
    h("td", {}, o.feasible ? o.note : `not possible: ${o.note}`)));
  return [
    h("p", {}, "auto chooses ", h("strong", { id: "recommended-kind" }, rec.kind), " (unless a server's storage policy refuses it): ", rec.reasons.join(" ")),
    table("Cost of each kind for these columns and reports", headers, rows, { id: "recommendation-table" }),
    predicted ? h("p", { class: "note" }, `Error ratio to the non-private optimum (1 = optimum), simulated on synthetic data of ${rec.simulated_reports ?? "this many"} reports: a prediction for data like the benchmark's, not a promise about yours.`) : null,
  ];
}

