// One study: its guarantees, design, bounds and explanation (GET /v1/studies/{id}), its progress
// at every server, finalization with a confirmation that says what cannot be undone, and once
// released the certificate and the analyses (results.js).

import { api } from "../api.js";
import { announce, check, clear, errorBox, fmt, h, numCell, table } from "../dom.js";
import { serverProgress } from "./progress.js";
import { renderResults } from "./results.js";
import { stateBadge } from "./studies.js";

function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.filter(Boolean).flatMap(([term, value, key]) => [
    h("dt", {}, term),
    h("dd", key ? { "data-fact": key } : {}, value),
  ]));
}

const NEIGHBOURING = {
  "replace-one": "replace-one: two data sets are neighbours when one person's row is replaced by another (sensitivity 2B)",
  "add-remove": "add/remove: two data sets are neighbours when one person's row is added or removed (sensitivity B); servers hide exact report counts",
};

function guarantees(view) {
  const g = view.guarantees;
  const floor = g.floor_epsilon === null
    ? "none: no floor (a report with no other honest report has no guarantee)"
    : `${fmt(g.floor_epsilon)} (target ${fmt(g.floor_epsilon_target)})`;
  return [
    h("h2", {}, "Guarantees"),
    h("p", { class: "note" }, "What every honest report gets (docs/trust.md): ε with the other honest reports in the release, and the floor ε even if every other report is an adversary's and all servers but one collude."),
    facts([
      ["ε (per report)", `${fmt(g.epsilon)} (target ${fmt(g.epsilon_target)})`, "epsilon"],
      ["δ", fmt(g.delta), "delta"],
      ["floor ε", floor, "floor_epsilon"],
      ["neighbouring", NEIGHBOURING[g.neighbouring] || g.neighbouring, "neighbouring"],
      ["λ* (certificate threshold)", fmt(g.lambda_star), "lambda_star"],
      ["noise", g.discrete_noise ? "exact discrete Gaussian" : "Gaussian", "discrete_noise"],
      ["secret sign", g.secret_sign ? "yes: clients multiply their row by a secret ±1 (docs/secret_sign.md)" : "no", "secret_sign"],
    ]),
  ];
}

function certificate(view) {
  if (view.state === "collecting") return null;
  const study = view.study;
  if (view.state === "finalizing") {
    return [h("h2", {}, "Inclusion set"),
      h("p", {}, "The inclusion set is recorded (hash ", h("code", { "data-fact": "inclusion_hash" }, view.inclusion_hash),
        "); commits or aggregates are under way. Finalize again to complete the release over the same set.")];
  }
  return [
    h("h2", {}, "Release certificate"),
    facts([
      ["reports in the release", String(view.n_reports), "n_reports"],
      ["inclusion hash", h("code", {}, view.inclusion_hash), "inclusion_hash"],
      ["certificate", `every share server checked λ_min(S Sᵀ) − t ≥ λ* = ${fmt(study.lambda_star)} (t = ${study.t}) over exactly this inclusion set before it released its share, and committed to this set for ever`, "certificate"],
    ]),
  ];
}

function design(view) {
  const st = view.study;
  return [
    h("h2", {}, "Design"),
    facts([
      ["kind", st.kind, "kind"],
      ["columns", st.columns.join(", "), "columns"],
      ["label", st.label ?? "none", "label"],
      ["sketch", `k = ${st.k} rows in s = ${st.s} blocks`, "k"],
      ["reports", `min ${st.min_reports}, max ${st.max_reports}`, "min_reports"],
      ["row bound B", fmt(st.row_bound), "row_bound"],
      ["client noise σ", fmt(st.sigma), "sigma"],
      ["server noise σ (each)", fmt(st.server_sigma), "server_sigma"],
      ["tolerated corrupt clients t", String(st.t), "t"],
      ["servers", st.servers.join(", "), "servers"],
      ["population", st.population ? h("a", { href: `#/ledger/${st.population}` }, st.population) : "none (charged to no ledger)", "population"],
    ]),
  ];
}

function bounds(view) {
  const st = view.study;
  if (!st.bounds) {
    return [h("h2", {}, "Bounds"),
      h("p", { "data-bounds": "none" }, "No bounds: each client takes its row as already scaled into the ball of radius B (a longer row is clipped), and analyses answer in that scale.")];
  }
  return [
    h("h2", {}, "Bounds"),
    table("Each client clamps every value to its column's public range; analyses answer in these units.",
      ["Column", h("th", { scope: "col", class: "num" }, "Lower"), h("th", { scope: "col", class: "num" }, "Upper")],
      st.columns.map((c, i) => h("tr", { "data-bound": c }, h("th", { scope: "row" }, c), numCell(st.bounds[i][0]), numCell(st.bounds[i][1]))),
      { id: "bounds" }),
  ];
}

function bins(view) {
  const spec = view.study.histogram;
  if (!spec) return null;
  return [h("h2", {}, "Bins"),
    table("The histogram's axes (underflow, overflow and other bins are added)", ["Column", "Edges or categories"],
      spec.axes.map((a) => h("tr", {}, h("th", { scope: "row" }, a.column), h("td", {}, (a.edges || a.categories).join(", ")))))];
}

function explanation(view) {
  return [h("details", {}, h("summary", {}, "How the analyzer designed this study"),
    h("ul", {}, view.explanation.map((line) => h("li", {}, line))))];
}

function finalizeDialog(view, onDone) {
  const understood = h("input", { id: "finalize-understood" });
  const confirm = h("button", { type: "button", class: "danger", id: "finalize-confirm", disabled: true }, "Finalize for ever");
  const cancel = h("button", { type: "button", class: "secondary", id: "finalize-cancel" }, "Cancel");
  const status = h("div", { role: "status" });
  const dialog = h("dialog", { id: "finalize-dialog", "aria-labelledby": "finalize-title", "aria-describedby": "finalize-what" },
    h("h2", { id: "finalize-title" }, `Finalize “${view.study.name}”?`),
    h("div", { id: "finalize-what" },
      h("p", {}, "Finalizing asks every share server to commit to ", h("strong", {}, "one inclusion set"),
        ": the reports that all servers hold now. ", h("strong", {}, "This cannot be undone.")),
      h("ul", {},
        h("li", {}, "Each server accepts one inclusion set per study, for ever: the study can never be released again over another set, with more or fewer reports."),
        h("li", {}, "Reports that arrive after this will never count in this study."),
        h("li", {}, "The release is then kept by the analyzer and anyone with its API token can analyse it any number of times."))),
    check("I understand that this cannot be undone", understood),
    h("div", { class: "actions" }, confirm, cancel),
    status);
  understood.addEventListener("change", () => { confirm.disabled = !understood.checked; });
  cancel.addEventListener("click", () => dialog.close());
  dialog.addEventListener("close", () => dialog.remove());
  confirm.addEventListener("click", async () => {
    confirm.disabled = true;
    cancel.disabled = true;
    clear(status).append(h("p", {}, "Finalizing: collecting report ids, committing, adding the aggregates…"));
    try {
      const released = await api.finalize(view.study_id);
      announce(`Study released over ${released.n_reports} reports.`);
      dialog.close();
      onDone();
    } catch (error) {
      clear(status).append(errorBox(error));
      cancel.disabled = false;
    }
  });
  return dialog;
}

export async function renderStudy(ctx, id) {
  const { main } = ctx;
  const view = await api.study(id);
  let progressPart;
  try {
    progressPart = serverProgress(await api.progress(id));
  } catch (error) {
    progressPart = errorBox(error);
  }
  const progressBox = h("div", { id: "progress" }, progressPart);
  const open = view.state !== "released";
  const finalize = open
    ? h("button", { type: "button", class: "danger", id: "finalize", onclick: () => {
      const dialog = finalizeDialog(view, () => ctx.reload());
      document.body.append(dialog);
      dialog.showModal();
    } }, view.state === "finalizing" ? "Finish finalizing…" : "Finalize…")
    : null;
  const results = h("section", { id: "results", "aria-labelledby": "results-title" });
  clear(main);
  main.append(
    h("h1", {}, view.study.name, " ", stateBadge(view.state)),
    h("p", { class: "note" }, "Study id ", h("code", { id: "study-id" }, view.study_id)),
    ...guarantees(view),
    ...(certificate(view) || []),
    h("h2", {}, "Progress"),
    h("p", { class: "note" }, `Reports held by each server against min_reports = ${view.study.min_reports}; a report counts only if every server holds it.`),
    progressBox,
    h("div", { class: "actions" },
      h("button", { type: "button", class: "secondary", id: "refresh", onclick: () => ctx.reload() }, "Refresh"),
      finalize),
    ...design(view),
    ...bounds(view),
    ...(bins(view) || []),
    ...explanation(view),
    results);
  if (open) {
    ctx.every(5_000, async () => {
      try {
        clear(progressBox).append(serverProgress(await api.progress(id)));
      } catch { /* the next tick tries again */ }
    });
  } else {
    renderResults(results, view);
  }
}
