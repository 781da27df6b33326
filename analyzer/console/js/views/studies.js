// The studies this analyzer holds: kind, state, and per server the reports held against
// min_reports with the server's health (GET /v1/studies, GET /v1/studies/{id}/progress).

import { api } from "../api.js";
import { append, clear, errorBox, fmt, h, table } from "../dom.js";
import { serverProgress } from "./progress.js";

export function stateBadge(state) {
  return h("span", { class: `badge state-${state}`, "data-state": state }, state);
}

async function progressOf(view) {
  if (view.state === "released") {
    return h("span", { "data-released": String(view.n_reports) }, `released over ${view.n_reports} reports`);
  }
  try {
    return serverProgress(await api.progress(view.study_id));
  } catch (error) {
    return errorBox(error);
  }
}

export async function renderStudies(ctx) {
  const { main } = ctx;
  const studies = await api.studies();
  const cells = studies.map(() => h("td", { "data-cell": "progress" }));
  await Promise.all(studies.map(async (view, i) => append(cells[i], [await progressOf(view)])));
  const rows = studies.map((view, i) => {
    const g = view.guarantees;
    return h("tr", { "data-study": view.study_id },
      h("td", {}, h("a", { href: `#/study/${view.study_id}` }, view.study.name),
        h("div", { class: "note mono" }, `${view.study_id.slice(0, 12)}…`)),
      h("td", { "data-kind": view.study.kind }, view.study.kind),
      h("td", {}, stateBadge(view.state)),
      cells[i],
      h("td", { class: "num" }, `ε = ${fmt(g.epsilon)}`, h("br"), `floor ε = ${g.floor_epsilon === null ? "none" : fmt(g.floor_epsilon)}`),
      h("td", {}, view.study.population
        ? h("a", { href: `#/ledger/${view.study.population}` }, view.study.population)
        : h("span", { class: "note" }, "none")));
  });
  clear(main);
  const refresh = h("button", { type: "button", class: "secondary", id: "refresh", onclick: () => ctx.reload() }, "Refresh");
  main.append(
    h("h1", {}, "Studies"),
    h("div", { class: "actions" }, h("a", { class: "button", href: "#/new" }, "New study"), refresh,
      h("span", { class: "note" }, `${studies.length} ${studies.length === 1 ? "study" : "studies"}; the progress of open studies refreshes every 10 s`)),
    studies.length === 0
      ? h("p", {}, "No studies yet. ", h("a", { href: "#/new" }, "Create one"), ".")
      : table("Studies held by this analyzer", ["Study", "Kind", "State", "Reports held per server (of min_reports) and health", "Guarantee", "Population"], rows, { id: "studies" }));
  // refresh the open studies' progress in place (no focus or scroll lost)
  const open = studies.map((view, i) => [view, cells[i]]).filter(([view]) => view.state !== "released");
  if (open.length) {
    ctx.every(10_000, () => open.forEach(async ([view, cell]) => {
      const fresh = await progressOf(view);
      clear(cell).append(fresh);
    }));
  }
}
