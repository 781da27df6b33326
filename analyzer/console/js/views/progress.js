// Progress of a study at every share server: reports held against min_reports, and the server's
// health as the analyzer saw it just now. An add/remove study's servers hide their exact count
// (a count that moves by one tells whether someone took part): the API answers null and the
// console shows "private", never a number of its own.

import { h } from "../dom.js";

/** Whether every server holds min_reports (a report counts only if every server holds it, so
 * this is necessary, not sufficient); null when a count is hidden or a server is unreachable. */
function readiness(progress) {
  const counts = progress.servers.map((s) => (s.reachable ? s.report_count : null));
  if (progress.state === "released" || counts.some((c) => c === null || c === undefined)) return null;
  const fewest = Math.min(...counts);
  return fewest >= progress.min_reports
    ? h("p", { class: "note", "data-ready": "yes" }, `Every server holds at least min_reports = ${progress.min_reports} reports: ready to finalize (only reports that every server holds count).`)
    : h("p", { class: "note", "data-ready": "no" }, `Not ready: the fewest any server holds is ${fewest} of min_reports = ${progress.min_reports}.`);
}

export function serverProgress(progress) {
  const min = progress.min_reports;
  return h("div", {}, serverList(progress, min), readiness(progress));
}

function serverList(progress, min) {
  return h("ul", { class: "servers", "data-progress": progress.study_id },
    progress.servers.map((server) => {
      const count = server.report_count;
      const healthy = server.reachable;
      const health = healthy
        ? h("span", { class: "badge health-ok", "data-health": "ok" }, `reachable · ${server.status}`)
        : h("span", { class: "badge health-bad", "data-health": "unreachable", title: server.error || "" }, "unreachable");
      let bar;
      let text;
      if (!healthy) {
        bar = null;
        text = h("span", { class: "error" }, server.error ? `error: ${server.error}` : "no answer");
      } else if (count === null || count === undefined) {
        bar = null;
        text = h("span", { class: "private", "data-count": "private" }, "private (the server hides an add/remove study's count)");
      } else {
        const label = `${server.server_id}: ${count} of ${min} reports`;
        bar = h("progress", { max: min, value: Math.min(count, min), "aria-label": label });
        text = h("span", { "data-count": String(count) }, `${count} / ${min}`);
      }
      return h("li", { "data-server": server.server_id },
        h("strong", {}, server.server_id), bar, text, health);
    }));
}
