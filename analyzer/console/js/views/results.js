// The analyses of a released study, each a small form that calls one analysis route and draws
// the answer: regression (ridge, least squares) as a forest plot, PCA as a scree plot and a
// loadings map, logistic regression (coefficients, and a ROC curve on a held-out CSV read in
// this browser only), histograms with their intervals and quantiles, LAD. Every figure downloads
// as SVG, PNG and CSV. The numbers drawn are the API's, unrounded (data-* attributes).

import { api } from "../api.js";
import { barChart } from "../charts/bars.js";
import { chartFigure } from "../charts/export.js";
import { forestPlot } from "../charts/forest.js";
import { heatmap } from "../charts/heatmap.js";
import { cdfChart, rocChart } from "../charts/lines.js";
import { clear, errorBox, field, fmt, h, numCell, table } from "../dom.js";
import { parseCsv, roc } from "../roc.js";

function panel(id, title, intro, controls, run) {
  const output = h("div", { class: "output", id: `${id}-output`, "aria-live": "polite" });
  const button = h("button", { type: "submit", id: `${id}-run` }, title.run);
  const form = h("form", { id: `${id}-form`, novalidate: true }, h("div", { class: "row" }, controls), h("div", { class: "actions" }, button));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    button.disabled = true;
    clear(output).append(h("p", { class: "status" }, "Computing…"));
    try {
      const parts = await run();
      clear(output).append(...parts);
    } catch (error) {
      clear(output).append(errorBox(error));
    } finally {
      button.disabled = false;
    }
  });
  return h("section", { class: "analysis", id, "aria-labelledby": `${id}-title` },
    h("h3", { id: `${id}-title` }, title.heading), h("p", { class: "note" }, intro), form, output);
}

function select(id, options, selected) {
  const el = h("select", { id }, options.map((o) => h("option", { value: o }, o)));
  if (selected !== undefined) el.value = selected;
  return el;
}

function numberInput(id, value, attrs = {}) {
  return h("input", { id, type: "number", value, step: "any", ...attrs });
}

function optionalNumber(input) {
  const text = input.value.trim();
  return text === "" ? undefined : Number(text);
}

function unitsNote(result) {
  return result.in_units ? "in the data's units" : "in the study's scale (no bounds: rows were taken as already inside the ball)";
}

// --- regression ---------------------------------------------------------------------------

function coefficientTable(result, caption, withIntervals) {
  const stderr = result.stderr || null;
  const headers = ["Term", h("th", { scope: "col", class: "num" }, "Coefficient")];
  if (stderr) headers.push(h("th", { scope: "col", class: "num" }, "Std. error"));
  if (withIntervals) headers.push(h("th", { scope: "col", class: "num" }, "CI low"), h("th", { scope: "col", class: "num" }, "CI high"));
  const rows = result.features.map((f, i) => h("tr", { "data-term": f },
    h("th", { scope: "row" }, f), numCell(result.coef[i]),
    stderr ? numCell(stderr[i]) : null,
    withIntervals ? [numCell(result.conf_int[i][0]), numCell(result.conf_int[i][1])] : null));
  const ici = result.intercept_conf_int || null;
  rows.push(h("tr", { "data-term": "(intercept)" }, h("th", { scope: "row" }, "(intercept)"), numCell(result.intercept),
    stderr ? numCell(result.intercept_stderr ?? null) : null,
    withIntervals ? [numCell(ici ? ici[0] : null), numCell(ici ? ici[1] : null)] : null));
  return table(caption, headers, rows, { "data-table": "coefficients" });
}

function coefficientCsv(result, withIntervals) {
  const header = ["term", "coef", "stderr", "ci_low", "ci_high"];
  const rows = result.features.map((f, i) => [f, result.coef[i], result.stderr ? result.stderr[i] : null,
    withIntervals ? result.conf_int[i][0] : null, withIntervals ? result.conf_int[i][1] : null]);
  const ici = result.intercept_conf_int || null;
  rows.push(["(intercept)", result.intercept, result.intercept_stderr ?? null, ici ? ici[0] : null, ici ? ici[1] : null]);
  return { header, rows };
}

function regressionPanel(view) {
  const st = view.study;
  const label = select("regression-label", st.columns, st.label || st.columns[st.columns.length - 1]);
  const method = select("regression-method", ["ridge", "least-squares"], "ridge");
  const confidence = numberInput("regression-confidence", "0.95", { min: "0.5", max: "0.999" });
  const alpha = numberInput("regression-alpha", "", { min: "0", placeholder: "default (AdaSSP)" });
  return panel("regression", { heading: "Regression (ridge, least squares)", run: "Fit" },
    "Coefficients with confidence intervals from the release's public noise law, as a forest plot.",
    [field("Label", label), field("Method", method), field("Confidence level", confidence), field("Ridge penalty α", alpha, "blank: the default from the noise level")],
    async () => {
      const body = { label: label.value, confidence: Number(confidence.value) };
      const a = optionalNumber(alpha);
      if (method.value === "ridge" && a !== undefined) body.alpha = a;
      const result = await api.analysis(view.study_id, method.value, body);
      const withIntervals = Array.isArray(result.conf_int) && result.conf_int.length === result.features.length;
      const level = result.confidence ?? body.confidence;
      const rows = result.features.map((f, i) => ({ name: f, value: result.coef[i],
        low: withIntervals ? result.conf_int[i][0] : null, high: withIntervals ? result.conf_int[i][1] : null }));
      const what = `${method.value} of ${result.label}`;
      const note = withIntervals
        ? `Dots: coefficients; lines: ${fmt(level * 100, 3)}% confidence intervals from the noise law.`
        : "This analyzer answered no confidence intervals (its RegressionResult has no conf_int): the plot shows the point estimates only.";
      const svg = forestPlot({
        title: `Forest plot: ${what}`,
        description: `${result.features.length} coefficients ${unitsNote(result)}. ${note}`,
        rows, xLabel: `coefficient (${result.label} per unit of the feature)`,
      });
      return [
        h("p", { class: withIntervals ? "note" : "note panel warning", "data-intervals": withIntervals ? "yes" : "none" }, note),
        chartFigure({ svg, name: `${method.value}-${result.label}`, label: `the forest plot of ${what}`,
          caption: `${what} over ${result.n_reports} reports, ${unitsNote(result)}; α = ${fmt(result.alpha)}${result.n_floored ? `, ${result.n_floored} eigenvalue(s) raised to the noise floor τ = ${fmt(result.tau)}` : ""}. Intercept ${fmt(result.intercept)} (not drawn).`,
          csv: coefficientCsv(result, withIntervals) }),
        coefficientTable(result, `Coefficients of ${what}`, withIntervals),
      ];
    });
}

// --- PCA ----------------------------------------------------------------------------------

function pcaPanel(view) {
  const st = view.study;
  const n = numberInput("pca-components", String(Math.min(st.columns.length, 3)), { min: "1", max: String(st.columns.length), step: "1" });
  return panel("pca", { heading: "Principal components (PCA)", run: "Run PCA" },
    "The scree plot (variance along each component) and the loadings of the columns on each component.",
    [field("Components", n)],
    async () => {
      const result = await api.analysis(view.study_id, "pca", { n_components: Number(n.value) });
      const names = result.explained_variance.map((_, j) => `PC${j + 1}`);
      const ratio = result.explained_variance_ratio;
      const scree = barChart({
        title: "Scree plot", description: `Variance along each of ${names.length} principal components${result.centered ? " (centred)" : ""}.`,
        labels: names, values: result.explained_variance, yLabel: "explained variance", xLabel: "component",
        annotations: ratio.length ? ratio.map((r) => `${fmt(r * 100, 3)}%`) : null, mark: "component",
      });
      const loadings = heatmap({
        title: "Loadings", description: "Each component's unit-norm weights on the columns.",
        rowLabels: names, columnLabels: result.columns, values: result.components,
      });
      return [
        chartFigure({ svg: scree, name: "pca-scree", label: "the scree plot",
          caption: `Explained variance per component over ${result.n_reports} reports${result.centered ? ", centred on the column means" : ""} (percentages: share of the total). A debiased variance may be negative where the noise swamps the data.`,
          csv: { header: ["component", "explained_variance", "explained_variance_ratio"], rows: names.map((c, j) => [c, result.explained_variance[j], ratio[j] ?? null]) } }),
        chartFigure({ svg: loadings, name: "pca-loadings", label: "the loadings",
          caption: "Loadings (blue negative, red positive).",
          csv: { header: ["component", ...result.columns], rows: names.map((c, j) => [c, ...result.components[j]]) } }),
        result.centered
          ? table("Column means the rows were centred on", ["Column", h("th", { scope: "col", class: "num" }, "Mean")],
            result.columns.map((c, j) => h("tr", {}, h("th", { scope: "row" }, c), numCell(result.mean[j]))), { "data-table": "pca-mean" })
          : null,
      ];
    });
}

// --- logistic regression and ROC ------------------------------------------------------------

function logisticPanel(view) {
  const st = view.study;
  const label = select("logistic-label", st.columns, st.label || st.columns[st.columns.length - 1]);
  const negative = numberInput("logistic-negative", "0");
  const positive = numberInput("logistic-positive", "1");
  let fitted = null;
  const rocOutput = h("div", { id: "roc-output", "aria-live": "polite" });
  const file = h("input", { id: "roc-file", type: "file", accept: ".csv,text/csv" });
  file.addEventListener("change", async () => {
    clear(rocOutput);
    if (!fitted || !file.files.length) return;
    try {
      const text = await file.files[0].text();  // read here; never sent anywhere
      rocOutput.append(...rocParts(fitted, parseCsv(text), file.files[0].name));
    } catch (error) {
      rocOutput.append(errorBox(error));
    }
  });
  const rocBox = h("div", { id: "roc", hidden: true },
    h("h4", {}, "ROC on held-out data"),
    field("Held-out rows (CSV with a header naming the columns; read in this browser, never uploaded)", file),
    rocOutput);
  const section = panel("logistic", { heading: "Logistic regression", run: "Fit" },
    "Coefficients on the log-odds scale; then load a held-out CSV to draw the ROC curve in this browser.",
    [field("Label (two classes)", label), field("Negative class value", negative), field("Positive class value", positive)],
    async () => {
      const result = await api.analysis(view.study_id, "logistic", { label: label.value, classes: [Number(negative.value), Number(positive.value)] });
      fitted = result;
      rocBox.hidden = false;
      clear(rocOutput);
      file.value = "";
      const svg = forestPlot({
        title: `Logistic regression of ${result.label}`, description: `${result.features.length} coefficients on the log-odds scale.`,
        rows: result.features.map((f, i) => ({ name: f, value: result.coef[i] })), xLabel: "log-odds per unit of the feature",
      });
      return [
        chartFigure({ svg, name: `logistic-${result.label}`, label: "the logistic coefficients",
          caption: `Logistic regression of ${result.label} (positive class ${fmt(result.classes[1])}) over ${result.n_reports} reports, ${unitsNote(result)}; intercept ${fmt(result.intercept)}; calibration ${result.calibration}. The API answers point estimates only.`,
          csv: { header: ["term", "coef"], rows: [...result.features.map((f, i) => [f, result.coef[i]]), ["(intercept)", result.intercept]] } }),
        coefficientTable(result, `Coefficients of the logistic regression of ${result.label}`, false),
      ];
    });
  section.append(rocBox);
  return section;
}

function rocParts(result, data, filename) {
  const r = roc(result, data);
  const svg = rocChart({ title: `ROC: ${result.label} on ${filename}`, description: `ROC curve of the fitted model on ${r.positives} positive and ${r.negatives} negative held-out rows.`, points: r.points, auc: r.auc });
  return [
    h("p", {}, "AUC on the held-out rows: ", h("strong", { id: "roc-auc", "data-value": String(r.auc) }, fmt(r.auc)),
      ` (${r.positives} positive, ${r.negatives} negative rows${r.skipped ? `; ${r.skipped} skipped: a missing or non-numeric value, or a label that is neither class` : ""}).`),
    chartFigure({ svg, name: `roc-${result.label}`, label: "the ROC curve",
      caption: `Scores intercept + coef · x of the released model on ${filename}, computed in this browser; nothing was sent to the analyzer.`,
      csv: { header: ["threshold", "fpr", "tpr"], rows: r.thresholds.map((t, i) => [t, r.points[i][0], r.points[i][1]]) } }),
  ];
}

// --- histogram ----------------------------------------------------------------------------

/** The cells of a one- or two-axis grid in row-major order (an interval stays a [low, high] pair). */
function cellsOf(grid, axes) {
  return axes.length === 2 ? grid.flat(1) : grid;
}

function cellLabels(axes) {
  if (axes.length === 1) return axes[0].labels;
  const out = [];
  for (const a of axes[0].labels) for (const b of axes[1].labels) out.push(`${a} × ${b}`);
  return out;
}

function histogramPanel(view) {
  const spec = view.study.histogram;
  const confidence = numberInput("histogram-confidence", "0.95", { min: "0.5", max: "0.999" });
  const numeric = spec.axes.filter((a) => a.edges);
  const column = select("quantile-column", numeric.map((a) => a.column), numeric.length ? numeric[0].column : undefined);
  const probabilities = h("input", { id: "quantile-probabilities", type: "text", value: "0.1, 0.25, 0.5, 0.75, 0.9" });
  const controls = [field("Confidence level", confidence)];
  if (numeric.length) controls.push(field("Quantiles of", column), field("Probabilities", probabilities, "comma-separated, in [0, 1]"));
  return panel("histogram", { heading: "Histogram", run: "Show" },
    "Noisy counts of every cell with their confidence intervals, and quantiles of a numeric axis from the estimated CDF.",
    controls,
    async () => {
      const level = Number(confidence.value);
      const hist = await api.histogram(view.study_id, level);
      const labels = cellLabels(hist.axes);
      const counts = cellsOf(hist.counts, hist.axes);
      const ci = cellsOf(hist.counts_ci, hist.axes);
      const proportions = cellsOf(hist.proportions, hist.axes);
      const pci = cellsOf(hist.proportions_ci, hist.axes);
      const columns = hist.axes.map((a) => a.column).join(" × ");
      const svg = barChart({
        title: `Histogram of ${columns}`, description: `Noisy counts of ${labels.length} cells with ${fmt(level * 100, 3)}% intervals.`,
        labels, values: counts, lows: ci.map((c) => c[0]), highs: ci.map((c) => c[1]), yLabel: "reports (noisy count)", xLabel: columns, mark: "cell",
      });
      const parts = [
        chartFigure({ svg, name: `histogram-${columns.replaceAll(" × ", "-")}`, label: "the histogram",
          caption: `Noisy counts over ${hist.n_reports} reports with ${fmt(level * 100, 3)}% confidence intervals from the noise law (noise variance ${fmt(hist.noise_variance)} per cell). A noisy count may be negative.`,
          csv: { header: ["cell", "count", "count_ci_low", "count_ci_high", "proportion", "proportion_ci_low", "proportion_ci_high"],
            rows: labels.map((l, i) => [l, counts[i], ci[i][0], ci[i][1], proportions[i], pci[i][0], pci[i][1]]) } }),
      ];
      if (numeric.length) {
        const probs = probabilities.value.split(",").map((p) => p.trim()).filter(Boolean).map(Number);
        const [q, moments] = await Promise.all([
          api.analysis(view.study_id, "quantiles", { column: column.value, probabilities: probs }),
          api.analysis(view.study_id, "moments", { column: column.value, confidence: level }),
        ]);
        const quantiles = q.probabilities.map((p, i) => ({ p, q: q.quantiles[i], clipped: q.clipped[i] }));
        const cdf = cdfChart({ title: `Quantiles of ${q.column}`, description: `Estimated CDF at the bin edges and ${quantiles.length} quantiles.`, column: q.column, edges: q.edges, cdf: q.cdf, quantiles });
        parts.push(
          chartFigure({ svg: cdf, name: `quantiles-${q.column}`, label: "the quantiles",
            caption: `Estimated CDF of ${q.column} at the bin edges (monotone fit of the noisy cumulative counts) and its quantiles; a quantile in an outer bin is that bin's edge (marked "edge").`,
            csv: { header: ["series", "x", "p", "clipped"], rows: [...q.edges.map((e, j) => ["cdf", e, q.cdf[j], null]), ...quantiles.map((x) => ["quantile", x.q, x.p, x.clipped])] } }),
          table(`Quantiles of ${q.column}`, [h("th", { scope: "col", class: "num" }, "Probability"), h("th", { scope: "col", class: "num" }, "Quantile"), "In an outer bin"],
            quantiles.map((x) => h("tr", { "data-p": String(x.p) }, numCell(x.p), numCell(x.q), h("td", {}, x.clipped ? "yes (the edge)" : "no"))), { "data-table": "quantiles" }),
          table(`Mean and variance of ${q.column} (binned)`, ["Statistic", h("th", { scope: "col", class: "num" }, "Value"), h("th", { scope: "col", class: "num" }, "CI low"), h("th", { scope: "col", class: "num" }, "CI high")],
            [h("tr", { "data-stat": "mean" }, h("th", { scope: "row" }, "mean"), numCell(moments.value), numCell(moments.ci[0]), numCell(moments.ci[1])),
              h("tr", { "data-stat": "variance" }, h("th", { scope: "row" }, "variance"), numCell(moments.details.variance), h("td"), h("td"))], { "data-table": "moments" }));
      }
      return parts;
    });
}

// --- least absolute deviations -----------------------------------------------------------

function ladPanel(view) {
  const st = view.study;
  const label = select("lad-label", st.columns, st.label || st.columns[st.columns.length - 1]);
  const alpha = numberInput("lad-alpha", "0", { min: "0" });
  return panel("lad", { heading: "Least absolute deviations (LAD)", run: "Fit" },
    "Median regression on the l1 sketch; coefficients as point estimates.",
    [field("Label", label), field("l1 penalty α", alpha)],
    async () => {
      const result = await api.analysis(view.study_id, "lad", { label: label.value, alpha: Number(alpha.value) });
      const svg = forestPlot({ title: `LAD of ${result.label}`, description: `${result.features.length} coefficients, ${unitsNote(result)}.`,
        rows: result.features.map((f, i) => ({ name: f, value: result.coef[i] })), xLabel: `coefficient (${result.label} per unit of the feature)` });
      return [
        chartFigure({ svg, name: `lad-${result.label}`, label: "the LAD coefficients",
          caption: `Least absolute deviations of ${result.label} over ${result.n_reports} reports, ${unitsNote(result)}; intercept ${fmt(result.intercept)}, objective ${fmt(result.objective)}. The API answers point estimates only.`,
          csv: { header: ["term", "coef"], rows: [...result.features.map((f, i) => [f, result.coef[i]]), ["(intercept)", result.intercept]] } }),
        coefficientTable(result, `Coefficients of the LAD fit of ${result.label}`, false),
      ];
    });
}

export function renderResults(container, view) {
  const kind = view.study.kind;
  const panels = [];
  if (kind === "histogram") panels.push(histogramPanel(view));
  else if (kind === "l1") panels.push(ladPanel(view));
  else panels.push(regressionPanel(view), pcaPanel(view), logisticPanel(view));
  clear(container).append(
    h("h2", { id: "results-title" }, "Results"),
    h("p", { class: "note" }, "The release is differentially private: analyse it as often as you like; each answer is a deterministic function of the release."),
    ...panels);
}

