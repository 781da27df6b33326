/**
 * Bounds (docs/protocol.md section 2e): each raw row is clamped to the study's public ranges and
 * mapped affinely into the row ball, with IEEE operations in exactly the document's order, so
 * every client computes the same doubles.
 */

export interface ColumnMap {
  mid: number[];
  half: number[];
  lo: number[];
  hi: number[];
  constant: boolean;
  scale: number;
}

export function columnMap(bounds: [number, number][], clipBound: number, constant: boolean): ColumnMap {
  const lo = bounds.map((b) => b[0]);
  const hi = bounds.map((b) => b[1]);
  const mid = bounds.map(([l, h]) => l / 2 + h / 2);
  const half = bounds.map(([l, h]) => h / 2 - l / 2);
  const w = bounds.length + (constant ? 1 : 0);
  return { lo, hi, mid, half, constant, scale: clipBound / Math.sqrt(w) };
}

/** The mapped row a and, per column, whether its value was clamped. */
export function toBall(map: ColumnMap, x: number[]): { row: number[]; clamped: boolean[] } {
  if (x.length !== map.mid.length) throw new Error(`row has ${x.length} values, the study ${map.mid.length} columns`);
  const row: number[] = [];
  const clamped: boolean[] = [];
  for (let c = 0; c < x.length; c++) {
    const v = x[c];
    if (typeof v !== "number" || !Number.isFinite(v)) throw new Error(`column ${c}: not a finite number`);
    const xc = Math.min(Math.max(v, map.lo[c]), map.hi[c]);
    clamped.push(xc !== v);
    const z = Math.min(Math.max((xc - map.mid[c]) / map.half[c], -1), 1);
    row.push(z * map.scale);
  }
  if (map.constant) row.push(1 * map.scale);
  return { row, clamped };
}
