// SVG primitives shared by the charts. Charts are plain SVG with presentation attributes only
// (no CSS classes, no style attributes), so the same element renders on the page, downloads as a
// standalone .svg file and draws onto a canvas for the PNG, identically.
//
// Every mark that stands for a number carries that number in a data-* attribute (the exact
// JavaScript value the API answered), and the plot area carries its scale (data-domain,
// data-range): a test can check that what is drawn is the API's answer.

import { fmt, newId } from "../dom.js";

export const NS = "http://www.w3.org/2000/svg";
export const COLORS = {
  ink: "#1b1f24",
  muted: "#4a5360",
  grid: "#d5dbe1",
  mark: "#1a4f8b",
  interval: "#1a4f8b",
  second: "#c2410c",
  fill: "#6f9ccf",
  negative: "#b4443c",
};
export const FONT = "DejaVu Sans, Verdana, Arial, sans-serif";

export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined) continue;
    el.setAttribute(key, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** A chart's root: an accessible image with a title and a description, white background. */
export function root(w, h, title, description) {
  const width = Math.ceil(w);
  const height = Math.ceil(h);
  const titleId = newId("svg-title");
  const descId = newId("svg-desc");
  const svg = s("svg", {
    xmlns: NS, width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-labelledby": `${titleId} ${descId}`, "font-family": FONT, "font-size": 12, fill: COLORS.ink,
  });
  svg.append(s("title", { id: titleId }, title), s("desc", { id: descId }, description),
    s("rect", { x: 0, y: 0, width, height, fill: "#ffffff" }));
  return svg;
}

/** A linear map from domain [d0, d1] to range [r0, r1]. */
export function linear(domain, range) {
  const [d0, d1] = domain;
  const [r0, r1] = range;
  const span = d1 - d0 || 1;
  const f = (x) => r0 + ((x - d0) / span) * (r1 - r0);
  f.domain = domain;
  f.range = range;
  return f;
}

/** The data extent padded by `pad` of its width (a single value gets a unit window). */
export function extent(values, pad = 0.06, include = []) {
  const finite = [...values, ...include].filter((v) => Number.isFinite(v));
  if (finite.length === 0) return [0, 1];
  let lo = Math.min(...finite);
  let hi = Math.max(...finite);
  if (lo === hi) {
    const w = Math.abs(lo) || 1;
    return [lo - w / 2, hi + w / 2];
  }
  const w = hi - lo;
  return [lo - pad * w, hi + pad * w];
}

/** About n round tick values inside [lo, hi]. */
export function ticks(lo, hi, n = 6) {
  const span = hi - lo;
  if (!(span > 0) || !Number.isFinite(span)) return [lo];
  const raw = span / n;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((x) => x >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  }
  return out;
}

/** A horizontal axis at y with ticks and a label; returns a <g>. */
export function xAxis(scale, y, label, { grid = 0 } = {}) {
  const g = s("g", { "data-axis": "x" });
  const [r0, r1] = scale.range;
  g.append(s("line", { x1: r0, x2: r1, y1: y, y2: y, stroke: COLORS.muted }));
  for (const t of ticks(...scale.domain)) {
    const x = scale(t);
    if (grid) g.append(s("line", { x1: x, x2: x, y1: grid, y2: y, stroke: COLORS.grid }));
    g.append(s("line", { x1: x, x2: x, y1: y, y2: y + 5, stroke: COLORS.muted }));
    g.append(s("text", { x, y: y + 18, "text-anchor": "middle", fill: COLORS.muted }, fmt(t, 3)));
  }
  if (label) g.append(s("text", { x: (r0 + r1) / 2, y: y + 36, "text-anchor": "middle" }, label));
  return g;
}

/** A vertical axis at x with ticks and a (rotated) label. */
export function yAxis(scale, x, label, { grid = 0 } = {}) {
  const g = s("g", { "data-axis": "y" });
  const [r0, r1] = scale.range;
  g.append(s("line", { x1: x, x2: x, y1: r0, y2: r1, stroke: COLORS.muted }));
  for (const t of ticks(...scale.domain, 5)) {
    const y = scale(t);
    if (grid) g.append(s("line", { x1: x, x2: grid, y1: y, y2: y, stroke: COLORS.grid }));
    g.append(s("line", { x1: x - 5, x2: x, y1: y, y2: y, stroke: COLORS.muted }));
    g.append(s("text", { x: x - 8, y: y + 4, "text-anchor": "end", fill: COLORS.muted }, fmt(t, 3)));
  }
  if (label) {
    const cy = (r0 + r1) / 2;
    g.append(s("text", { x: 14, y: cy, "text-anchor": "middle", transform: `rotate(-90 14 ${cy})` }, label));
  }
  return g;
}

/** The plot area's scales as attributes, for tests and for anyone reading the SVG. */
export function scaleAttrs(xs, ys) {
  const attrs = {};
  if (xs) Object.assign(attrs, { "data-x-domain": xs.domain.join(","), "data-x-range": xs.range.join(",") });
  if (ys) Object.assign(attrs, { "data-y-domain": ys.domain.join(","), "data-y-range": ys.range.join(",") });
  return attrs;
}

/** Rough width of a label in px at 12 px (for margins; DejaVu Sans averages ~7 px a glyph). */
export function textWidth(text, size = 12) {
  return String(text).length * size * 0.6;
}
