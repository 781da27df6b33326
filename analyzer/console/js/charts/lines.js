// Line charts on two linear axes: the histogram's estimated CDF with its quantiles marked, and
// the ROC curve of a logistic model on held-out rows.

import { fmt } from "../dom.js";
import { COLORS, extent, linear, root, s, scaleAttrs, xAxis, yAxis } from "./svg.js";

function frame(title, description, xDomain, yDomain, xLabel, yLabel, { width = 560, height = 360 } = {}) {
  const left = 72;
  const top = 18;
  const right = 24;
  const bottom = 56;
  const x = linear(xDomain, [left, width - right]);
  const y = linear(yDomain, [height - bottom, top]);
  const svg = root(width, height, title, description);
  const plot = s("g", { "data-plot": "lines", ...scaleAttrs(x, y) });
  plot.append(xAxis(x, height - bottom, xLabel, { grid: top }), yAxis(y, left, yLabel, { grid: width - right }));
  svg.append(plot);
  return { svg, plot, x, y };
}

function path(points, x, y) {
  return points.map(([px, py], i) => `${i ? "L" : "M"}${x(px).toFixed(2)},${y(py).toFixed(2)}`).join(" ");
}

/** edges[j] and cdf[j] = P(X < edges[j]); quantiles [{p, q, clipped}]. */
export function cdfChart({ title, description, column, edges, cdf, quantiles }) {
  const xs = [...edges, ...quantiles.map((q) => q.q).filter(Number.isFinite)];
  const { svg, plot, x, y } = frame(title, description, extent(xs, 0.04), [0, 1], column, "P(X < x)");
  const points = edges.map((e, j) => [e, cdf[j]]).filter(([, c]) => Number.isFinite(c));
  plot.append(s("path", { d: path(points, x, y), fill: "none", stroke: COLORS.mark, "stroke-width": 2, "data-mark": "cdf" }));
  for (const [e, c] of points) {
    plot.append(s("circle", { cx: x(e), cy: y(c), r: 3, fill: COLORS.mark, "data-mark": "cdf-point", "data-x": String(e), "data-value": String(c) }));
  }
  for (const q of quantiles) {
    if (!Number.isFinite(q.q)) continue;
    const g = s("g", { "data-mark": "quantile", "data-p": String(q.p), "data-value": String(q.q) });
    g.append(s("line", { x1: x.range[0], x2: x(q.q), y1: y(q.p), y2: y(q.p), stroke: COLORS.second, "stroke-dasharray": "4 3" }));
    g.append(s("line", { x1: x(q.q), x2: x(q.q), y1: y(q.p), y2: y.range[0], stroke: COLORS.second, "stroke-dasharray": "4 3" }));
    g.append(s("circle", { cx: x(q.q), cy: y(q.p), r: 5, fill: COLORS.second }));
    g.append(s("text", { x: x(q.q) + 7, y: y(q.p) - 6, fill: COLORS.second }, `q${fmt(q.p, 3)} = ${fmt(q.q)}${q.clipped ? " (edge)" : ""}`));
    plot.append(g);
  }
  return svg;
}

/** points [[fpr, tpr], ...] from (0,0) to (1,1). */
export function rocChart({ title, description, points, auc }) {
  const { svg, plot, x, y } = frame(title, description, [0, 1], [0, 1], "false positive rate", "true positive rate", { width: 440, height: 420 });
  plot.append(s("line", { x1: x(0), y1: y(0), x2: x(1), y2: y(1), stroke: COLORS.muted, "stroke-dasharray": "4 3" }));
  plot.append(s("path", { d: path(points, x, y), fill: "none", stroke: COLORS.mark, "stroke-width": 2, "data-mark": "roc", "data-auc": String(auc) }));
  plot.append(s("text", { x: x(0.55), y: y(0.1), fill: COLORS.ink }, `AUC = ${fmt(auc)}`));
  return svg;
}
