// Bar chart over named categories (histogram cells, principal components), with optional
// interval whiskers and a text above each bar. A noisy count or a debiased variance can be
// negative: the value axis always includes zero and a negative bar hangs below it.

import { COLORS, extent, linear, root, s, scaleAttrs, textWidth, yAxis } from "./svg.js";

export function barChart({ title, description, labels, values, lows = null, highs = null, yLabel, xLabel, annotations = null, mark = "bar" }) {
  const n = labels.length;
  const left = 78;
  const band = Math.max(26, Math.min(70, 560 / Math.max(n, 1)));
  const longest = Math.max(...labels.map((l) => textWidth(l)));
  const rotate = longest > band - 6;
  const labelSpace = rotate ? Math.min(140, longest * 0.75 + 14) : 22;
  const plotHeight = 240;
  const top = 24;
  const width = left + n * band + 24;
  const height = top + plotHeight + labelSpace + (xLabel ? 34 : 14);
  const all = [...values];
  if (lows) all.push(...lows.filter(Number.isFinite));
  if (highs) all.push(...highs.filter(Number.isFinite));
  const [lo, hi] = extent(all, 0.08, [0]);
  const y = linear([Math.min(0, lo), hi], [top + plotHeight, top]);
  const svg = root(width, height, title, description);
  const plot = s("g", { "data-plot": "bars", ...scaleAttrs(null, y) });
  plot.append(yAxis(y, left, yLabel, { grid: left + n * band }));
  const zero = y(0);
  plot.append(s("line", { x1: left, x2: left + n * band, y1: zero, y2: zero, stroke: COLORS.muted }));
  labels.forEach((label, i) => {
    const v = values[i];
    const x0 = left + i * band;
    const cx = x0 + band / 2;
    const hasInterval = lows && highs && Number.isFinite(lows[i]) && Number.isFinite(highs[i]);
    const g = s("g", {
      "data-mark": mark, "data-name": label, "data-value": String(v),
      "data-low": hasInterval ? String(lows[i]) : null, "data-high": hasInterval ? String(highs[i]) : null,
    });
    const yv = Number.isFinite(v) ? y(v) : zero;
    g.append(s("rect", {
      x: x0 + band * 0.15, width: band * 0.7, y: Math.min(yv, zero), height: Math.abs(zero - yv),
      fill: v < 0 ? COLORS.negative : COLORS.fill, stroke: COLORS.mark, "data-part": "bar",
    }));
    if (hasInterval) {
      g.append(s("line", { x1: cx, x2: cx, y1: y(lows[i]), y2: y(highs[i]), stroke: COLORS.ink, "stroke-width": 1.5, "data-part": "interval" }));
      for (const end of [lows[i], highs[i]]) {
        g.append(s("line", { x1: cx - 5, x2: cx + 5, y1: y(end), y2: y(end), stroke: COLORS.ink, "stroke-width": 1.5 }));
      }
    }
    if (annotations) {
      const above = hasInterval ? y(Math.max(highs[i], v, 0)) : Math.min(yv, zero);
      g.append(s("text", { x: cx, y: above - 5, "text-anchor": "middle", fill: COLORS.muted, "font-size": 11 }, annotations[i]));
    }
    const ly = top + plotHeight + 16;
    g.append(rotate
      ? s("text", { x: cx, y: ly, "text-anchor": "end", transform: `rotate(-40 ${cx} ${ly})` }, label)
      : s("text", { x: cx, y: ly, "text-anchor": "middle" }, label));
    plot.append(g);
  });
  if (xLabel) plot.append(s("text", { x: left + (n * band) / 2, y: height - 8, "text-anchor": "middle" }, xLabel));
  svg.append(plot);
  return svg;
}
