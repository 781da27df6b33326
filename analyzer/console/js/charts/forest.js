// Forest plot: one row per coefficient, its point estimate as a dot and, when the API answers
// one, its confidence interval as a line; a vertical line at zero. Without intervals it is a dot
// plot of the point estimates (the caller says so in the caption).

import { fmt } from "../dom.js";
import { COLORS, extent, linear, root, s, scaleAttrs, textWidth, xAxis } from "./svg.js";

/**
 * rows: [{name, value, low, high}] (low/high null or absent: no interval)
 * returns the <svg>
 */
export function forestPlot({ title, description, rows, xLabel }) {
  const labelWidth = Math.min(220, Math.max(60, ...rows.map((r) => textWidth(r.name)))) + 16;
  const valueWidth = 150;
  const plotWidth = 460;
  const rowHeight = 30;
  const top = 16;
  const width = labelWidth + plotWidth + valueWidth + 16;
  const height = top + rows.length * rowHeight + 56;
  const lows = rows.map((r) => (Number.isFinite(r.low) ? r.low : r.value));
  const highs = rows.map((r) => (Number.isFinite(r.high) ? r.high : r.value));
  const x = linear(extent([...lows, ...highs], 0.08, [0]), [labelWidth, labelWidth + plotWidth]);
  const svg = root(width, height, title, description);
  const bottom = top + rows.length * rowHeight;
  const plot = s("g", { "data-plot": "forest", ...scaleAttrs(x, null) });
  plot.append(xAxis(x, bottom + 4, xLabel, { grid: top }));
  plot.append(s("line", { x1: x(0), x2: x(0), y1: top, y2: bottom, stroke: COLORS.muted, "stroke-dasharray": "4 3" }));
  rows.forEach((r, i) => {
    const cy = top + i * rowHeight + rowHeight / 2;
    const hasInterval = Number.isFinite(r.low) && Number.isFinite(r.high);
    const g = s("g", {
      "data-mark": "coefficient", "data-name": r.name, "data-value": String(r.value),
      "data-low": hasInterval ? String(r.low) : null, "data-high": hasInterval ? String(r.high) : null,
    });
    g.append(s("text", { x: labelWidth - 10, y: cy + 4, "text-anchor": "end" }, r.name));
    if (hasInterval) {
      g.append(s("line", { x1: x(r.low), x2: x(r.high), y1: cy, y2: cy, stroke: COLORS.interval, "stroke-width": 2, "data-part": "interval" }));
      for (const end of [r.low, r.high]) {
        g.append(s("line", { x1: x(end), x2: x(end), y1: cy - 6, y2: cy + 6, stroke: COLORS.interval, "stroke-width": 2 }));
      }
    }
    g.append(s("circle", { cx: x(r.value), cy, r: 5, fill: COLORS.mark, "data-part": "point" }));
    const text = hasInterval ? `${fmt(r.value)} [${fmt(r.low)}, ${fmt(r.high)}]` : fmt(r.value);
    g.append(s("text", { x: labelWidth + plotWidth + 12, y: cy + 4, fill: COLORS.muted }, text));
    plot.append(g);
  });
  svg.append(plot);
  return svg;
}
