/**
 * A gram or moments study's validity circuit, GramNorm (docs/validity.md section 12,
 * docs/protocol.md section 4b "Gram and moments studies"): the client proves that what it shares
 * is psi(r) + e, psi the quadratic features of a witness row r of bounded norm (every product
 * stated by a MulSub gadget) and e noise of bounded weighted norm. Also the plan's numbers (R_r^2,
 * R^2) and the witness, computed as the reference computes them, double for double.
 */
import { encodeInt, isqrt, mul, add, P, type Fp } from "./field.js";
import { GadgetCircuit, mulSubGadget, slackDigitsFor, productWires, rangeGadget, rangeWires, span, squaresGadget, type Gadget } from "./flp.js";
import { roundHalfEven } from "../ring.js";

/** The q little-endian base-beta digits of a non-negative integer v < beta^q. */
function digits(v: bigint, beta: number, q: number, out: Fp[]): void {
  const b = BigInt(beta);
  for (let m = 0; m < q; m++) {
    out.push(v % b);
    v /= b;
  }
}

/**
 * GramNorm(d, linear, lin, count, beta, q_r, R_r^2, q, R^2): x = psi(r) + e with psi(r) =
 * [lin r_i (gram only), r_i r_j for i <= j (the diagonal, then the strict upper triangle row by
 * row), count (gram only)], |r_i| < H_r, sum r_i^2 <= R_r^2, |e_i| < H, sum c_i e_i^2 <= R^2 (c_i = 2
 * on the strict upper triangle, 1 elsewhere). Input: the digits of r_i + H_r, the products, the
 * digits of e_i + H, of the row slack and of the noise slack. Gadgets: Range(beta) over every
 * digit (weighted), MulSub over the products (weighted), Mul over (c_i e_i, e_i) (plain).
 */
export class GramNorm extends GadgetCircuit {
  readonly half: bigint;
  readonly halfRow: bigint;
  readonly w: number;
  /** (i, j) of each product, in the features' order */
  readonly pairs: [number, number][];
  /** c_i: 2 on the strict upper triangle, 1 elsewhere */
  readonly normWeights: bigint[];
  readonly rowSlackDigits: number;
  readonly slackDigits: number;
  readonly atProducts: number;
  readonly atNoise: number;
  readonly atRowSlack: number;
  readonly atSlack: number;
  readonly inputLen: number;
  readonly gadgets: Gadget[];
  constructor(readonly d: number, readonly linear: boolean, readonly lin: bigint, readonly countUnit: bigint, readonly beta: number,
    readonly qRow: number, readonly r2Row: bigint, readonly q: number, readonly r2: bigint) {
    super();
    if (d < 1 || qRow < 1 || q < 1 || r2Row < 0n || r2 < 0n || lin < 1n || countUnit < 1n) throw new Error("need d >= 1, digits >= 1, bounds >= 0 and units >= 1");
    this.halfRow = BigInt(beta) ** BigInt(qRow) / 2n;
    this.half = BigInt(beta) ** BigInt(q) / 2n;
    this.pairs = [];
    for (let i = 0; i < d; i++) this.pairs.push([i, i]);
    for (let i = 0; i < d; i++) for (let j = i + 1; j < d; j++) this.pairs.push([i, j]);
    const nProd = this.pairs.length;
    this.w = nProd + (linear ? d + 1 : 0);
    const off = d + (linear ? d : 0); // the first strict-upper coordinate of x
    this.normWeights = Array.from({ length: this.w }, (_, i) => (i >= off && i < off + nProd - d ? 2n : 1n));
    this.rowSlackDigits = slackDigitsFor(r2Row, beta);
    this.slackDigits = slackDigitsFor(r2, beta);
    const b = BigInt(beta);
    if (BigInt(d) * this.halfRow ** 2n + b ** BigInt(this.rowSlackDigits) > P) throw new Error("d H_r^2 + beta^q_rs exceeds p: the row's norm could wrap around p");
    const sumC = this.normWeights.reduce((a, c) => a + c, 0n);
    if (sumC * this.half ** 2n + b ** BigInt(this.slackDigits) > P) throw new Error("sum c_i H^2 + beta^q_s exceeds p: the noise's norm could wrap around p");
    this.atProducts = d * qRow;
    this.atNoise = this.atProducts + nProd;
    this.atRowSlack = this.atNoise + this.w * q;
    this.atSlack = this.atRowSlack + this.rowSlackDigits;
    this.inputLen = this.atSlack + this.slackDigits;
    const digitColumns = [...span(0, this.atProducts), ...span(this.atNoise, this.inputLen)];
    this.gadgets = [rangeGadget(digitColumns, beta), mulSubGadget(nProd), squaresGadget(this.w)];
  }

  /** psi(r) in grid units: what an honest x is before noise. */
  features(r: bigint[]): bigint[] {
    const prods = this.pairs.map(([i, j]) => r[i] * r[j]);
    return this.linear ? [...r.map((x) => this.lin * x), ...prods, this.countUnit] : prods;
  }

  /** Whether a report (witness row, noise) satisfies both ranges and both norm bounds. */
  within(r: bigint[], e: bigint[]): boolean {
    if (r.some((x) => x < -this.halfRow || x >= this.halfRow) || e.some((x) => x < -this.half || x >= this.half)) return false;
    return r.reduce((a, x) => a + x * x, 0n) <= this.r2Row && e.reduce((a, x, i) => a + this.normWeights[i] * x * x, 0n) <= this.r2;
  }

  /** A witness row and its noise (integers) -> the input (throws outside the predicate). */
  encode(r: bigint[], e: bigint[]): Fp[] {
    if (r.length !== this.d || e.length !== this.w) throw new Error(`a report is a row of ${this.d} and noise of ${this.w} integers`);
    if (!this.within(r, e)) throw new Error("a report is outside the study's validity bound (a range or a norm): redraw its noise");
    const out: Fp[] = [];
    for (const x of r) digits(x + this.halfRow, this.beta, this.qRow, out);
    for (const [i, j] of this.pairs) out.push(encodeInt(r[i] * r[j]));
    for (const x of e) digits(x + this.half, this.beta, this.q, out);
    digits(this.r2Row - r.reduce((a, x) => a + x * x, 0n), this.beta, this.rowSlackDigits, out);
    digits(this.r2 - e.reduce((a, x, i) => a + this.normWeights[i] * x * x, 0n), this.beta, this.slackDigits, out);
    return out;
  }

  /** sum_m beta^m digit_m - half over the digits at `at` (mod p). */
  private value(input: Fp[], at: number, q: number, half: bigint): Fp {
    let x = 0n, weight = 1n;
    for (let m = 0; m < q; m++) {
      x = add(x, mul(input[at + m], weight));
      weight *= BigInt(this.beta);
    }
    return add(x, encodeInt(-half));
  }

  wires(g: number, input: Fp[]): Fp[][] {
    const gd = this.gadgets[g];
    if (gd.kind === "range") return rangeWires(gd, input);
    if (gd.kind === "mulsub") {
      const r = Array.from({ length: this.d }, (_, i) => this.value(input, i * this.qRow, this.qRow, this.halfRow));
      return productWires(gd, this.pairs.map(([i, j], k) => [r[i], r[j], input[this.atProducts + k]]));
    }
    const e = Array.from({ length: this.w }, (_, i) => this.value(input, this.atNoise + i * this.q, this.q, this.half));
    return productWires(gd, e.map((x, i) => [mul(x, this.normWeights[i]), x]));
  }
}


/**
 * The IEEE double nearest to sqrt(x^2 + y^2) (ties to even), computed exactly: Python's
 * math.hypot, which the reference's R^2 uses, agrees with it where V8's Math.hypot may be an ulp
 * off (tests: validity.test.ts).
 */
export function hypot(x: number, y: number): number {
  const parts = (v: number): [bigint, number] => {
    // v = mant 2^exp with an integer mantissa
    v = Math.abs(v);
    if (v === 0) return [0n, 0];
    let exp = 0;
    while (!Number.isInteger(v)) {
      v *= 2;
      exp--;
    }
    while (v >= 2 ** 53) {
      v /= 2;
      exp++;
    }
    return [BigInt(v), exp];
  };
  const [mx, ex] = parts(x), [my, ey] = parts(y);
  if (mx === 0n && my === 0n) return 0;
  const e0 = Math.min(mx === 0n ? Infinity : ex, my === 0n ? Infinity : ey);
  // x^2 + y^2 = n 4^e0
  const n = (mx << BigInt(2 * (ex - e0))) * mx + (my << BigInt(2 * (ey - e0))) * my;
  // sqrt(n 4^k) to at least 55 bits: floor and whether exact
  const k = Math.max(0, Math.ceil((112 - n.toString(2).length) / 2));
  const s = n << BigInt(2 * k);
  const r = isqrt(s);
  const exact = r * r === s;
  const drop = Math.max(0, r.toString(2).length - 53);
  let m = r >> BigInt(drop);
  if (drop > 0) {
    const rem = r & ((1n << BigInt(drop)) - 1n);
    const half = 1n << BigInt(drop - 1);
    if (rem > half || (rem === half && (!exact || (m & 1n) === 1n))) m += 1n;
  } else if (!exact) throw new Error("hypot: not enough bits");
  return Number(m) * 2 ** (e0 - k + drop);
}

/** The norm allowance t sqrt(w + 2 sqrt(w a) + 2 a), a = 96 ln 2: an honest report is outside
 * with probability <= 2^-96 (section 4b). Every validity circuit's bound uses it. */
export function normAllowance(t: number, w: number): number {
  const a = 96 * Math.log(2);
  return t * Math.sqrt(w + 2 * Math.sqrt(w * a) + 2 * a);
}

/**
 * (R_r^2, R^2) of a gram or moments study (validity.gram_bounds): R_r = B / g + sqrt(d) / 2,
 * R = the noise allowance of t_e + the residual of rounding (the row to g, the features to h) / h +
 * sqrt(sum c_i) / 2, doubles left to right as the reference.
 */
export function gramBounds(gram: boolean, d: number, w: number, rowBound: number, h: number, tEff: number): { r2Row: bigint; r2: bigint } {
  const g = Math.sqrt(h);
  const upper = (d * (d - 1)) / 2;
  const sumC = w + upper;
  const delta = (g * Math.sqrt(d)) / 2;
  const residual = hypot(gram ? delta : 0, delta * (2 * rowBound + delta));
  const r = normAllowance(tEff, w) + residual / h + Math.sqrt(sumC) / 2;
  const rRow = rowBound / g + Math.sqrt(d) / 2;
  return { r2Row: BigInt(Math.ceil(rRow * rRow)), r2: BigInt(Math.ceil(r * r)) };
}

/** The witness of a clipped row: rint(a_i 2^m), ties to even, in units of the witness grid 2^-m. */
export function witnessRow(a: number[], m: number): bigint[] {
  return a.map((x) => BigInt(roundHalfEven(x * 2 ** m)));
}
