// Loadings as a heat map: one row per principal component, one column per data column, each
// cell coloured on a diverging scale (blue negative, white zero, red positive; |loading| <= 1
// for unit-norm components) and labelled with its value.

import { COLORS, root, s, textWidth } from "./svg.js";

function mix(a, b, t) {
  return a.map((v, i) => Math.round(v + (b[i] - v) * t));
}

/** The fill of a value in [-1, 1] and a text colour readable on it. */
export function diverging(v) {
  const t = Math.max(-1, Math.min(1, v));
  const white = [255, 255, 255];
  const rgb = t < 0 ? mix(white, [33, 102, 172], -t) : mix(white, [178, 24, 43], t);
  const light = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 150;
  return { fill: `rgb(${rgb.join(",")})`, text: light ? COLORS.ink : "#ffffff" };
}

export function heatmap({ title, description, rowLabels, columnLabels, values }) {
  const cellW = Math.max(58, Math.min(90, ...columnLabels.map((c) => textWidth(c) + 14)));
  const cellH = 30;
  const left = Math.max(50, ...rowLabels.map((r) => textWidth(r))) + 16;
  const top = 28;
  const width = left + columnLabels.length * cellW + 16;
  const height = top + rowLabels.length * cellH + 16;
  const svg = root(width, height, title, description);
  const plot = s("g", { "data-plot": "heatmap" });
  columnLabels.forEach((c, j) => {
    plot.append(s("text", { x: left + j * cellW + cellW / 2, y: top - 10, "text-anchor": "middle" }, c));
  });
  rowLabels.forEach((r, i) => {
    plot.append(s("text", { x: left - 8, y: top + i * cellH + cellH / 2 + 4, "text-anchor": "end" }, r));
    columnLabels.forEach((c, j) => {
      const v = values[i][j];
      const { fill, text } = diverging(v);
      const g = s("g", { "data-mark": "loading", "data-row": r, "data-column": c, "data-value": String(v) });
      g.append(s("rect", { x: left + j * cellW, y: top + i * cellH, width: cellW - 2, height: cellH - 2, fill, stroke: COLORS.grid }));
      g.append(s("text", { x: left + j * cellW + cellW / 2 - 1, y: top + i * cellH + cellH / 2 + 3, "text-anchor": "middle", fill: text }, v.toFixed(2)));
      plot.append(g);
    });
  });
  svg.append(plot);
  return svg;
}
