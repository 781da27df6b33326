// A figure with its downloads: the SVG as drawn, a PNG drawn from that SVG on a canvas, and the
// numbers behind it as CSV (each number as JavaScript writes it: the shortest text that reads
// back to the same double the API answered, so the CSV holds the API's numbers exactly).

import { h } from "../dom.js";

function save(blob, filename) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = filename;
  link.hidden = true;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

export function svgText(svg) {
  return `<?xml version="1.0" encoding="UTF-8"?>\n${new XMLSerializer().serializeToString(svg)}\n`;
}

function csvCell(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "number") return Number.isFinite(value) ? String(value) : "";
  let text = String(value);
  // a spreadsheet would run a cell that starts with one of these as a formula
  if (/^[=+\-@\t\r]/.test(text)) text = `'${text}`;
  return /[",\n\r]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
}

export function csvText(header, rows) {
  return [header, ...rows].map((row) => row.map(csvCell).join(",")).join("\r\n") + "\r\n";
}

export function downloadSvg(svg, name) {
  save(new Blob([svgText(svg)], { type: "image/svg+xml" }), `${name}.svg`);
}

export function downloadCsv(header, rows, name) {
  save(new Blob([csvText(header, rows)], { type: "text/csv" }), `${name}.csv`);
}

/** Draw the SVG onto a canvas at twice its size (via a blob: URL image: CSP img-src blob:). */
export function downloadPng(svg, name) {
  const width = Number(svg.getAttribute("width"));
  const height = Number(svg.getAttribute("height"));
  const url = URL.createObjectURL(new Blob([svgText(svg)], { type: "image/svg+xml" }));
  const image = new Image();
  image.onload = () => {
    const canvas = document.createElement("canvas");
    canvas.width = width * 2;
    canvas.height = height * 2;
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    ctx.drawImage(image, 0, 0, canvas.width, canvas.height);
    URL.revokeObjectURL(url);
    canvas.toBlob((blob) => save(blob, `${name}.png`), "image/png");
  };
  image.onerror = () => URL.revokeObjectURL(url);
  image.src = url;
}

/**
 * A <figure> holding the chart, its caption and three download buttons.
 * csv: {header: [...], rows: [[...], ...]}; name: the files' base name.
 */
export function chartFigure({ svg, caption, name, csv, label }) {
  const what = label || name;
  return h("figure", { class: "chart", "data-figure": name },
    svg,
    h("figcaption", {}, caption),
    h("div", { class: "downloads" },
      h("button", { type: "button", class: "secondary", "aria-label": `Download ${what} as SVG`, "data-download": "svg", onclick: () => downloadSvg(svg, name) }, "SVG"),
      h("button", { type: "button", class: "secondary", "aria-label": `Download ${what} as PNG`, "data-download": "png", onclick: () => downloadPng(svg, name) }, "PNG"),
      h("button", { type: "button", class: "secondary", "aria-label": `Download the numbers of ${what} as CSV`, "data-download": "csv", onclick: () => downloadCsv(csv.header, csv.rows, name) }, "CSV")));
}
