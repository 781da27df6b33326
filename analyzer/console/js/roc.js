// The ROC curve of a fitted logistic model on held-out rows the analyst loads from a CSV file.
// Everything happens in the browser: the file is read with File.text() and never sent.

/** Parse CSV text (RFC 4180 quotes; comma separated; first row the header). */
export function parseCsv(text) {
  const rows = [];
  let row = [];
  let cell = "";
  let quoted = false;
  for (let i = 0; i < text.length; i += 1) {
    const c = text[i];
    if (quoted) {
      if (c === '"' && text[i + 1] === '"') { cell += '"'; i += 1; }
      else if (c === '"') quoted = false;
      else cell += c;
    } else if (c === '"') quoted = true;
    else if (c === ",") { row.push(cell); cell = ""; }
    else if (c === "\n" || c === "\r") {
      if (c === "\r" && text[i + 1] === "\n") i += 1;
      row.push(cell); cell = "";
      if (row.some((x) => x !== "")) rows.push(row);
      row = [];
    } else cell += c;
  }
  row.push(cell);
  if (row.some((x) => x !== "")) rows.push(row);
  if (rows.length < 2) throw new Error("the file needs a header row and at least one data row");
  return { header: rows[0].map((x) => x.trim()), rows: rows.slice(1) };
}

/**
 * Score every row with intercept + coef . x, and sweep the threshold from high to low.
 * Rows with equal scores move together (a diagonal step), so the area is the Mann-Whitney
 * probability P(score+ > score-) + P(tie) / 2, as scikit-learn's roc_auc_score computes it.
 */
export function roc(model, data) {
  const index = (name) => {
    const j = data.header.indexOf(name);
    if (j < 0) throw new Error(`the file has no column ${name} (its header: ${data.header.join(", ")})`);
    return j;
  };
  const features = model.features.map(index);
  const labelAt = index(model.label);
  const [negClass, posClass] = model.classes;
  const scored = [];
  let skipped = 0;
  for (const row of data.rows) {
    const y = Number(row[labelAt]);
    const xs = features.map((j) => (row[j] === undefined || row[j].trim() === "" ? NaN : Number(row[j])));
    if (xs.some((v) => !Number.isFinite(v)) || (y !== posClass && y !== negClass)) {
      skipped += 1;
      continue;
    }
    let score = model.intercept;
    xs.forEach((v, i) => { score += model.coef[i] * v; });
    scored.push([score, y === posClass]);
  }
  const positives = scored.filter(([, p]) => p).length;
  const negatives = scored.length - positives;
  if (!positives || !negatives) throw new Error(`need rows of both classes (found ${positives} positive, ${negatives} negative)`);
  scored.sort((a, b) => b[0] - a[0]);
  const points = [[0, 0]];
  const thresholds = [Infinity];
  let tp = 0;
  let fp = 0;
  let auc = 0;
  for (let i = 0; i < scored.length;) {
    const threshold = scored[i][0];
    let dtp = 0;
    let dfp = 0;
    while (i < scored.length && scored[i][0] === threshold) {
      if (scored[i][1]) dtp += 1; else dfp += 1;
      i += 1;
    }
    auc += (dfp / negatives) * ((tp + dtp / 2) / positives);
    tp += dtp;
    fp += dfp;
    points.push([fp / negatives, tp / positives]);
    thresholds.push(threshold);
  }
  return { points, thresholds, auc, positives, negatives, skipped };
}
