// A population's privacy ledger at every share server (GET /v1/populations/{p}/ledger): the
// budget, what the studies charged to it have spent (composed with dp-accounting by each
// server), what is left, and the studies charged. Each server keeps and enforces its own.

import { api } from "../api.js";
import { clear, errorBox, field, fmt, h, numCell, table } from "../dom.js";

const POPULATION = /^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,63}$/;

function populationForm(ctx, current, known) {
  const input = h("input", { type: "text", id: "population-id", value: current || "", spellcheck: "false", required: true });
  const form = h("form", { id: "ledger-form", novalidate: true },
    h("div", { class: "row" }, field("Population id", input), h("div", { class: "actions" }, h("button", { type: "submit" }, "Show ledger"))));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (input.value.trim()) ctx.navigate(`/ledger/${encodeURIComponent(input.value.trim())}`);
  });
  return [form, known.length
    ? h("p", {}, "Populations of this analyzer's studies: ", known.flatMap((p, i) => [i ? ", " : "", h("a", { href: `#/ledger/${p}` }, p)]))
    : h("p", { class: "note" }, "None of this analyzer's studies names a population.")];
}

function serverLedger(server) {
  const l = server.ledger;
  if (!l) return h("section", { "data-ledger-server": server.server_id }, h("h2", {}, server.server_id), errorBox({ message: server.error || "no ledger" }));
  const used = l.epsilon;
  const budget = l.budget_epsilon;
  let meter = null;
  if (budget !== null && used !== null) {
    meter = h("meter", { min: "0", max: String(budget), value: String(Math.min(used, budget)), high: String(budget * 0.8), optimum: "0",
      "aria-label": `${server.server_id}: ε ${fmt(used)} used of ${fmt(budget)}` });
  }
  const extra = Object.entries(l).filter(([k, v]) => !["population", "server_id", "neighbouring", "delta", "epsilon", "naive_epsilon", "naive_delta",
    "budget_epsilon", "budget_delta", "remaining_epsilon", "studies"].includes(k) && (typeof v === "number" || v === null));
  return h("section", { "data-ledger-server": server.server_id },
    h("h2", {}, `${server.server_id}`),
    table(`Budget at ${server.server_id} (${l.neighbouring}, read at δ = ${fmt(l.delta)})`,
      ["Guarantee", h("th", { scope: "col", class: "num" }, "Used ε"), h("th", { scope: "col", class: "num" }, "Budget ε"), h("th", { scope: "col", class: "num" }, "Left ε"), "Used of budget", h("th", { scope: "col", class: "num" }, "Naive sum ε")],
      [h("tr", { "data-guarantee": "epsilon" }, h("th", { scope: "row" }, "ε (composed, PLD)"), numCell(used), numCell(budget), numCell(l.remaining_epsilon),
        h("td", {}, meter || h("span", { class: "note" }, budget === null ? "no budget: nothing is refused" : "unbounded")), numCell(l.naive_epsilon))],
      { "data-table": "budget" }),
    extra.length ? table("Other figures of this server's ledger", ["Member", h("th", { scope: "col", class: "num" }, "Value")],
      extra.map(([k, v]) => h("tr", {}, h("th", { scope: "row" }, k), numCell(v)))) : null,
    l.studies.length
      ? table(`Studies charged at ${server.server_id}`, ["Study", "Kind", h("th", { scope: "col", class: "num" }, "ε charged"), h("th", { scope: "col", class: "num" }, "Study's δ"), "Charged at"],
        l.studies.map((e) => h("tr", { "data-charge": e.charge.study_id },
          h("td", {}, h("a", { href: `#/study/${e.charge.study_id}` }, e.charge.name)), h("td", {}, e.charge.kind),
          numCell(e.charged_epsilon), numCell(e.charge.delta), h("td", {}, new Date(e.charged_at * 1000).toISOString().replace("T", " ").slice(0, 19)))),
        { "data-table": "charges" })
      : h("p", { class: "note" }, "No study is charged to this population here yet."));
}

export async function renderLedger(ctx, population) {
  const { main } = ctx;
  const studies = await api.studies();
  const known = [...new Set(studies.map((v) => v.study.population).filter(Boolean))].sort();
  const parts = [h("h1", {}, population ? `Ledger of ${population}` : "Population ledger"),
    h("p", { class: "lede" }, "Every share server keeps each population's ledger and refuses a study that would pass its budget (docs/ledger.md)."),
    ...populationForm(ctx, population, known)];
  if (population) {
    if (!POPULATION.test(population)) {
      parts.push(h("p", { class: "error", role: "alert" }, "That is not a population id (letters, digits and _ . : -, starting with a letter or digit)."));
    } else {
      const ledger = await api.populationLedger(population);
      parts.push(...ledger.servers.map(serverLedger));
    }
  }
  clear(main).append(...parts);
}
