/**
 * From a data owner's row to the vector a client shares (docs/protocol.md sections 2a, 2b, 2e
 * and 5): bounds mapping, clipping to B', the kind's vector (the row, phi, psi, one-hot cells).
 */
import { columnMap, toBall, type ColumnMap } from "./bounds.js";
import { clipBound, type Study } from "./study.js";

export type RawValue = number | string;

/** a <- a * min(1, B'/||a||), nudged down until the computed norm is at most B'. */
export function clip(a: number[], bound: number): number[] {
  const norm = (v: number[]) => {
    let big = 0;
    for (const x of v) big = Math.max(big, Math.abs(x));
    if (big === 0) return 0;
    let s = 0;
    for (const x of v) s += (x / big) * (x / big);
    return big * Math.sqrt(s);
  };
  const n = norm(a);
  if (n <= bound) return a.slice();
  let scale = bound / n;
  let out = a.map((x) => x * scale);
  while (norm(out) > bound) {
    scale *= 1 - 4 * Number.EPSILON;
    out = a.map((x) => x * scale);
  }
  return out;
}

/** phi(a) of a gram study: [a, a_i^2, (sqrt(2) a_i) a_j for i < j, 1]. */
export function phi(a: number[]): number[] {
  const out = a.slice();
  for (const x of a) out.push(x * x);
  for (let i = 0; i < a.length; i++) for (let j = i + 1; j < a.length; j++) out.push(Math.SQRT2 * a[i] * a[j]);
  out.push(1);
  return out;
}

/** psi(u) of a moments study: [u_i^2, (sqrt(2) u_i) u_j for i < j]. */
export function psi(u: number[]): number[] {
  const out: number[] = [];
  for (const x of u) out.push(x * x);
  for (let i = 0; i < u.length; i++) for (let j = i + 1; j < u.length; j++) out.push(Math.SQRT2 * u[i] * u[j]);
  return out;
}

/** numpy's searchsorted(edges, x, side="right"). */
function cellOfNumber(edges: number[], x: number): number {
  let lo = 0, hi = edges.length;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (edges[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

export function histogramVector(study: Study, row: RawValue[]): number[] {
  const h = study.histogram!;
  const index = (axisIdx: number): number => {
    const axis = h.axes[axisIdx];
    const value = row[study.columns.indexOf(axis.column)];
    if (axis.edges) {
      if (typeof value !== "number" || Number.isNaN(value)) throw new Error(`column ${axis.column}: not a number`);
      return cellOfNumber(axis.edges, value);
    }
    const text = String(value).trim();
    const j = axis.categories!.indexOf(text);
    return j >= 0 ? j : axis.categories!.length;
  };
  const sizes = h.axes.map((a) => (a.edges ?? a.categories ?? []).length + 1);
  if (h.marginal) {
    const out = new Array(sizes.reduce((x, y) => x + y, 0)).fill(0);
    let o = 0;
    h.axes.forEach((_, j) => {
      out[o + index(j)] = 1;
      o += sizes[j];
    });
    return out;
  }
  const out = new Array(sizes.reduce((x, y) => x * y, 1)).fill(0);
  let cell = 0;
  h.axes.forEach((_, j) => (cell = cell * sizes[j] + index(j)));
  out[cell] = 1;
  return out;
}

export interface Mapper {
  map: ColumnMap | null;
  clipBound: number;
  /** clamped values per column, summed over the rows mapped */
  clamped: number[];
  vector(row: RawValue[]): number[];
  /** the row mapped by the bounds and clipped to B' (not for a histogram): what the features are made of */
  clipped(row: RawValue[]): number[];
  /** the kind's vector of a clipped row: the row, phi or psi */
  features(a: number[]): number[];
}

/** The clipped, mapped vector of each row (before the secret sign and the grid). */
export function mapper(study: Study): Mapper {
  const Bp = clipBound(study);
  const constant = study.kind !== "gram" && study.kind !== "histogram";
  const map = study.bounds ? columnMap(study.bounds, Bp, constant) : null;
  const clamped = new Array(study.columns.length).fill(0);
  const clipped = (row: RawValue[]): number[] => {
    if (row.length !== study.columns.length) throw new Error(`a row has ${row.length} values, the study ${study.columns.length} columns`);
    let a: number[];
    if (map) {
      const r = toBall(map, row as number[]);
      r.clamped.forEach((c, i) => (clamped[i] += c ? 1 : 0));
      a = r.row;
    } else {
      for (const v of row) if (typeof v !== "number" || !Number.isFinite(v)) throw new Error("a row value is not a finite number");
      a = row as number[];
    }
    return clip(a, Bp);
  };
  const features = (a: number[]): number[] => {
    if (study.kind === "gram") return phi(a);
    if (study.kind === "moments") return psi(a);
    return a;
  };
  const vector = (row: RawValue[]): number[] => (study.kind === "histogram" ? histogramVector(study, row) : features(clipped(row)));
  return { map, clipBound: Bp, clamped, vector, clipped, features };
}
