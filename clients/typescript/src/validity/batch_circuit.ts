/**
 * The circuit of a batch proof, BatchNorm (docs/validity.md section 15; the reference is
 * dpsketch/protocol/batch_circuit.py): m rows of w coordinates as field elements, each row's slack
 * R^2 - ||x||^2 written as the squares of g greedy roots and an exact four-square decomposition
 * (a fixed table), and the base-4 digits of the r wrap-around projections. Gadgets:
 * ParallelSum(Range(4), weighted) over the wrap digits, ParallelSum(RowNorm(K, R^2), L, weighted)
 * over the rows. The client proves only: the checks (with the batch's projections) are the servers'.
 */
import { encodeInt, P, type Fp } from "./field.js";
import { GadgetCircuit, rangeGadget, rangeWires, span, type Gadget } from "./flp.js";
import { nextPow2 } from "./ntt.js";
import { isqrt } from "./field.js";
import { REPETITIONS, threshold, wrapDigitsFor } from "./wraparound.js";

export const TABLE_LIMIT = 8191;
export const EXACT = 4;
export const BASE = 4;

/** How many greedy squares every slack in [0, R^2] needs before the table takes the rest. */
export function greedySteps(r2: bigint): number {
  let bound = r2, steps = 0;
  while (bound > BigInt(TABLE_LIMIT)) {
    bound = 2n * isqrt(bound);
    steps++;
  }
  return steps;
}

let table: Int32Array | null = null;
/**
 * (TABLE_LIMIT + 1) x 4: n = a^2 + b^2 + c^2 + d^2 with (a, b) the least pair (a, then b) of the
 * first sum of two squares u (ascending) whose rest n - u is a sum of two squares, (c, d) the
 * least pair of the rest: the reference's table, entry for entry.
 */
export function fourSquareTable(): Int32Array {
  if (table) return table;
  const top = Math.floor(Math.sqrt(TABLE_LIMIT));
  const two = new Int32Array(2 * (TABLE_LIMIT + 1)).fill(-1);
  for (let a = 0; a <= top; a++) {
    for (let b = 0; b <= top; b++) {
      const n = a * a + b * b;
      if (n <= TABLE_LIMIT && two[2 * n] < 0) {
        two[2 * n] = a;
        two[2 * n + 1] = b;
      }
    }
  }
  const sums: number[] = [];
  for (let n = 0; n <= TABLE_LIMIT; n++) if (two[2 * n] >= 0) sums.push(n);
  const out = new Int32Array(4 * (TABLE_LIMIT + 1)).fill(-1);
  for (let n = 0; n <= TABLE_LIMIT; n++) {
    for (const u of sums) {
      if (u > n) break;
      if (two[2 * (n - u)] >= 0) {
        out.set([two[2 * u], two[2 * u + 1], two[2 * (n - u)], two[2 * (n - u) + 1]], 4 * n);
        break;
      }
    }
    const [a, b, c, d] = out.subarray(4 * n, 4 * n + 4);
    if (a < 0 || a * a + b * b + c * c + d * d !== n) throw new Error("four-square table");
  }
  table = out;
  return out;
}

/** The roots of a slack s in [0, 2^62]: `greedy` greedy squares, then the table's four. */
export function slackRoots(s: bigint, greedy: number): bigint[] {
  if (s < 0n || s > 1n << 62n) throw new Error("a slack is negative or above 2^62");
  const out: bigint[] = [];
  for (let k = 0; k < greedy; k++) {
    const a = isqrt(s);
    out.push(a);
    s -= a * a;
  }
  if (s > BigInt(TABLE_LIMIT)) throw new Error("too few greedy squares for this slack");
  const t = fourSquareTable();
  const n = Number(s);
  for (let j = 0; j < EXACT; j++) out.push(BigInt(t[4 * n + j]));
  return out;
}

/** L with the smallest proof plus verifier length: 4 L K + 2 (2 (P - 1) + 1) + 2, P = next_pow2(ceil(m / L) + 2); the smallest among equals. */
export function bestRowsPerCall(m: number, k: number): number {
  let best = 1, bestCost = Infinity;
  for (let rows = 1; rows <= m; rows++) {
    const cost = 4 * rows * k + 2 * (2 * (nextPow2(Math.ceil(m / rows) + 2) - 1) + 1) + 2;
    if (cost < bestCost) {
      best = rows;
      bestCost = cost;
    }
  }
  return best;
}

/** BatchNorm(m, w, R^2, r): the batch's input is the rows (coordinates, then roots; padding rows to a whole call), then the wrap digits. */
export class BatchNorm extends GadgetCircuit {
  readonly squares: number;
  readonly k: number;
  readonly rowsPerCall: number;
  readonly rows: number;
  readonly threshold: bigint;
  readonly wrapDigits: number;
  readonly wrapBound: bigint;
  readonly vLen: number;
  readonly atWrap: number;
  readonly inputLen: number;
  readonly gadgets: Gadget[];
  constructor(readonly m: number, readonly w: number, readonly r2: bigint, readonly reps = REPETITIONS) {
    super();
    if (m < 1 || w < 1 || r2 < 0n || reps < 1) throw new Error("need m >= 1, w >= 1, R^2 >= 0 and reps >= 1");
    if (r2 > 1n << 62n) throw new Error("R^2 above 2^62");
    this.squares = greedySteps(r2) + EXACT;
    const k = (this.k = w + this.squares);
    const L = (this.rowsPerCall = bestRowsPerCall(m, k));
    const calls = Math.ceil(m / L);
    this.rows = calls * L;
    this.threshold = threshold(this.rows, r2, reps);
    this.wrapDigits = wrapDigitsFor(this.threshold);
    this.wrapBound = BigInt(BASE) ** BigInt(this.wrapDigits);
    if (BigInt(k) * (this.wrapBound - 1n) ** 2n >= P) throw new Error("(w + roots) (4^q_w - 1)^2 exceeds p: a row's norm could wrap around (fewer rows per batch)");
    this.vLen = this.rows * k;
    this.atWrap = this.vLen;
    this.inputLen = this.atWrap + reps * this.wrapDigits;
    const wireLen = nextPow2(calls + 2);
    const rowsGadget: Gadget = { kind: "rownorm", weighted: true, beta: 0, columns: [], count: L, arity: L * k, calls, degree: 2, wireLen,
      polyLen: 2 * (wireLen - 1) + 1, r2: r2 % P };
    this.gadgets = [rangeGadget(span(this.atWrap, this.inputLen), BASE), rowsGadget];
  }

  /**
   * Rows (m x w integers, grid units) -> the input's first v_len elements as integers: each row's
   * coordinates then its slack's roots, then the padding rows (0, the roots of R^2). Throws for a
   * row outside the bound.
   */
  prefix(x: bigint[][]): bigint[] {
    if (x.length !== this.m || x.some((r) => r.length !== this.w)) throw new Error(`x is ${this.m} rows of ${this.w} integers`);
    const greedy = this.squares - EXACT;
    const out: bigint[] = [];
    for (const row of x) {
      let norm2 = 0n;
      for (const v of row) norm2 += v * v;
      if (norm2 > this.r2) throw new Error("a row's squared norm exceeds R^2");
      out.push(...row, ...slackRoots(this.r2 - norm2, greedy));
    }
    const pad = slackRoots(this.r2, greedy);
    for (let i = this.m; i < this.rows; i++) {
      for (let j = 0; j < this.w; j++) out.push(0n);
      out.push(...pad);
    }
    return out;
  }

  /**
   * prefix's values as doubles (every one is at most sqrt(R^2) <= 2^31 in size: exact), computed
   * in doubles when R^2 < 2^52 (the norms and slacks exact too), else from prefix: the prover's
   * path, without a BigInt per value.
   */
  prefixNumbers(x: bigint[][]): Float64Array {
    if (this.r2 >= 1n << 52n) return Float64Array.from(this.prefix(x), Number);
    if (x.length !== this.m || x.some((r) => r.length !== this.w)) throw new Error(`x is ${this.m} rows of ${this.w} integers`);
    const greedy = this.squares - EXACT, k = this.k, r2 = Number(this.r2);
    const out = new Float64Array(this.vLen);
    const t = fourSquareTable();
    const roots = (s: number, at: number): void => {
      for (let g = 0; g < greedy; g++) {
        let a = Math.floor(Math.sqrt(s));
        while (a * a > s) a--;
        while ((a + 1) * (a + 1) <= s) a++;
        out[at++] = a;
        s -= a * a;
      }
      if (s > TABLE_LIMIT) throw new Error("too few greedy squares for this slack");
      for (let j = 0; j < EXACT; j++) out[at++] = t[4 * s + j];
    };
    for (let i = 0; i < this.m; i++) {
      const row = x[i];
      let norm2 = 0;
      for (let j = 0; j < this.w; j++) {
        const v = Number(row[j]);
        out[i * k + j] = v;
        norm2 += v * v;
      }
      // a sum above 2^53 is inexact but far above R^2 < 2^52 either way
      if (norm2 > r2) throw new Error("a row's squared norm exceeds R^2");
      roots(r2 - norm2, i * k + this.w);
    }
    for (let i = this.m; i < this.rows; i++) roots(r2, i * k + this.w);
    return out;
  }

  /** The r projections' digits of <z_k, v> + T, little-endian, rep by rep (throws outside [-T, 4^q_w - T)). */
  wrapInput(projections: bigint[]): Fp[] {
    const out: Fp[] = [];
    for (const p of projections) {
      let v = p + this.threshold;
      if (v < 0n || v >= this.wrapBound) throw new Error("a wrap-around projection is outside its range");
      for (let q = 0; q < this.wrapDigits; q++) {
        out.push(v & 3n);
        v >>= 2n;
      }
    }
    return out;
  }

  wires(g: number, input: Fp[]): Fp[][] {
    const gd = this.gadgets[g];
    if (gd.kind === "range") return rangeWires(gd, input);
    // call c, slot l, wire j = element j of row c L + l: the input's first rows K elements in order
    const out: Fp[][] = [];
    for (let c = 0; c < gd.calls; c++) out.push(input.slice(c * gd.arity, (c + 1) * gd.arity));
    return out;
  }
}

/** Integers as F_p elements (centred). */
export const asField = (v: bigint[]): Fp[] => v.map((x) => encodeInt(x));
