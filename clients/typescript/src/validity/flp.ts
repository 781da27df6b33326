/**
 * The fully linear proof of docs/validity.md section 3 for the NormBound circuit (section 2; the
 * gram circuit GramNorm of section 12 is gram.ts), the client's side: the circuit's shape (group
 * sizes minimising proof plus verifier length), the digits of a vector, joint randomness from the
 * report id, prove, and the helpers' seeded shares (section 4).
 */
import { sha256 } from "../primitives.js";
import { ascii, concat } from "../bytes.js";
import { add, encodeInt, expand, mul, mul2, P, type Fp, type Fp2 } from "./field.js";
import { nextPow2, roots } from "./ntt.js";
import { addScalarVec, extendVec, fromVec, mulAddVec, mulVec, scaleAddVec, scaleVec, setBig, subVec, toVec, transformVec, vec, type FpVec } from "./fieldvec.js";

export const JOINT_DOMAIN = ascii("dpsketch/joint/1");
export const JOINT_NONCE = sha256(JOINT_DOMAIN).subarray(0, 12);
export const SHARE_NONCE = sha256(ascii("dpsketch/flp-share/1")).subarray(0, 12);
export const QUERY_NONCE = sha256(ascii("dpsketch/query/1")).subarray(0, 12);

/** F_p elements of proof plus verifier message that a ParallelSum of `count` groups costs. */
export function parallelCost(items: number, count: number, innerArity: number, degree: number, weighted: boolean): number {
  const calls = Math.ceil(items / count);
  const arity = innerArity * count;
  const polyLen = degree * (nextPow2(calls + 2) - 1) + 1;
  return 2 * arity + (weighted ? 2 : 1) * polyLen + 2 * (arity + 1);
}

/** The group size with the smallest cost, the first of equals. */
export function bestCount(items: number, innerArity: number, degree: number, weighted: boolean): number {
  let best = 1, bestCost = Infinity;
  for (let c = 1; c <= items; c++) {
    const cost = parallelCost(items, c, innerArity, degree, weighted);
    if (cost < bestCost) {
      best = c;
      bestCost = cost;
    }
  }
  return best;
}

export interface Gadget {
  /**
   * range: ParallelSum(Range(beta)); mul: ParallelSum(Mul) of (a, b) pairs; mulsub: ParallelSum(MulSub) of (a, b, c);
   * rownorm: ParallelSum(RowNorm(K, R^2), weighted) of a batch proof's rows (batch_circuit.ts), RowNorm(a) = sum_j a_j^2 - R^2
   */
  kind: "range" | "mul" | "mulsub" | "rownorm";
  /** a rownorm gadget's R^2 (mod p) */
  r2?: bigint;
  weighted: boolean;
  /** the range gadget's beta (2 for bits) */
  beta: number;
  /** the input columns a range gadget reads, call k slot j reading columns[k count + j] */
  columns: number[];
  /** groups per call (L), wires per call (arity), calls (M), degree (D) */
  count: number;
  arity: number;
  calls: number;
  degree: number;
  /** P = next_pow2(M + 2) */
  wireLen: number;
  /** D (P - 1) + 1 coefficients */
  polyLen: number;
}

export function rangeGadget(columns: number[], beta: number): Gadget {
  const count = bestCount(columns.length, 1, beta, true);
  const calls = Math.ceil(columns.length / count);
  const wireLen = nextPow2(calls + 2);
  return { kind: "range", weighted: true, beta, columns, count, arity: count, calls, degree: beta, wireLen, polyLen: beta * (wireLen - 1) + 1 };
}

/** A ParallelSum of a degree-2 gadget over `items` inner calls: Mul (plain) or MulSub (weighted). */
function productGadget(kind: "mul" | "mulsub", items: number): Gadget {
  const inner = kind === "mul" ? 2 : 3;
  const weighted = kind === "mulsub";
  const count = bestCount(items, inner, 2, weighted);
  const calls = Math.ceil(items / count);
  const wireLen = nextPow2(calls + 2);
  return { kind, weighted, beta: 0, columns: [], count, arity: inner * count, calls, degree: 2, wireLen, polyLen: 2 * (wireLen - 1) + 1 };
}

export function squaresGadget(w: number): Gadget {
  return productGadget("mul", w);
}

/** ParallelSum(MulSub, count, weighted) over `items` products: slot (a, b, c) states c = a b. */
export function mulSubGadget(items: number): Gadget {
  return productGadget("mulsub", items);
}

/** What prove() needs of a circuit: its gadgets and the wire values of their calls. */
export interface Circuit {
  readonly inputLen: number;
  readonly gadgets: Gadget[];
  readonly jointRandLen: number;
  readonly proveRandLen: number;
  readonly proofLen: number;
  readonly verifierLen: number;
  /** The wire values of every call of gadget g: [call][wire]. */
  wires(g: number, input: Fp[]): Fp[][];
}

/** Joint randomness, prove randomness, proof and verifier lengths of a list of gadgets. */
export function gadgetLengths(gadgets: Gadget[]): { jointRandLen: number; proveRandLen: number; proofLen: number; verifierLen: number } {
  return {
    jointRandLen: gadgets.filter((g) => g.weighted).length + 1,
    proveRandLen: gadgets.reduce((a, g) => a + 2 * g.arity, 0),
    proofLen: gadgets.reduce((a, g) => a + 2 * g.arity + (g.weighted ? 2 : 1) * g.polyLen, 0),
    verifierLen: 1 + gadgets.reduce((a, g) => a + g.arity + 1, 0),
  };
}

/** A circuit as its gadgets: the lengths every message takes follow from them (gadgetLengths). */
export abstract class GadgetCircuit implements Circuit {
  abstract readonly inputLen: number;
  abstract readonly gadgets: Gadget[];
  abstract wires(g: number, input: Fp[]): Fp[][];
  get jointRandLen(): number {
    return gadgetLengths(this.gadgets).jointRandLen;
  }
  get proveRandLen(): number {
    return gadgetLengths(this.gadgets).proveRandLen;
  }
  get proofLen(): number {
    return gadgetLengths(this.gadgets).proofLen;
  }
  get verifierLen(): number {
    return gadgetLengths(this.gadgets).verifierLen;
  }
}

/** A range gadget's calls: call k, slot j reads input column columns[k count + j] (0 past the end). */
export function rangeWires(gd: Gadget, input: Fp[]): Fp[][] {
  const out: Fp[][] = [];
  for (let k = 0; k < gd.calls; k++) {
    const row: Fp[] = [];
    for (let j = 0; j < gd.count; j++) {
      const i = k * gd.count + j;
      row.push(i < gd.columns.length ? input[gd.columns[i]] : 0n);
    }
    out.push(row);
  }
  return out;
}

/** A product gadget's calls from its items' wire groups (each `inner` values; zeros past the end). */
export function productWires(gd: Gadget, items: Fp[][]): Fp[][] {
  const inner = gd.arity / gd.count;
  const out: Fp[][] = [];
  for (let k = 0; k < gd.calls; k++) {
    const row: Fp[] = [];
    for (let j = 0; j < gd.count; j++) {
      const i = k * gd.count + j;
      if (i < items.length) row.push(...items[i]);
      else for (let x = 0; x < inner; x++) row.push(0n);
    }
    out.push(row);
  }
  return out;
}

/** The least q with (beta^q / 2)^2 > r2: the digits of a value bounded by sqrt(r2). */
export function digitsFor(r2: bigint, beta: number): number {
  let q = 1;
  while ((BigInt(beta) ** BigInt(q) / 2n) ** 2n <= r2) q++;
  return q;
}

/** The least q with beta^q > r2: the digits of a slack in [0, r2]. */
export function slackDigitsFor(r2: bigint, beta: number): number {
  let q = 1;
  while (BigInt(beta) ** BigInt(q) <= r2) q++;
  return q;
}

export const span = (a: number, b: number) => Array.from({ length: b - a }, (_, i) => a + i);

/**
 * NormBound(w, beta, q, R^2) of docs/validity.md section 2, or with `oneHot` the histogram
 * circuit OneHotNorm of section 9: x_i = unit b_i + e_i, b one-hot in each block, the noise e
 * bounded as NormBound bounds x; its input is the w bits, then e's digits, then the slack's.
 */
export class NormBound extends GadgetCircuit {
  readonly half: bigint;
  readonly slackDigits: number;
  readonly inputLen: number;
  readonly gadgets: Gadget[];
  /** where the digits start: 0, or w after a one-hot circuit's bits */
  readonly digitsAt: number;
  constructor(readonly w: number, readonly beta: number, readonly q: number, readonly r2: bigint,
    readonly oneHot: { blocks: [number, number][]; unit: bigint } | null = null) {
    super();
    this.half = BigInt(beta) ** BigInt(q) / 2n;
    const qs = slackDigitsFor(r2, beta);
    this.slackDigits = qs;
    if (BigInt(w) * this.half * this.half + BigInt(beta) ** BigInt(qs) > P) throw new Error("the norm could wrap around p");
    this.digitsAt = oneHot ? w : 0;
    this.inputLen = this.digitsAt + w * q + qs;
    this.gadgets = oneHot
      ? [rangeGadget(span(0, w), 2), rangeGadget(span(w, this.inputLen), beta), squaresGadget(w)]
      : [rangeGadget(span(0, this.inputLen), beta), squaresGadget(w)];
  }

  /**
   * Integers u (grid units) -> the input (throws outside the predicate). With oneHot, `bits`
   * are the row's one-hot cells and the noise u - unit b is what the digits carry.
   */
  encode(u: bigint[], bits: number[] | null = null): Fp[] {
    if (u.length !== this.w) throw new Error(`a vector has ${this.w} coordinates`);
    const out: Fp[] = [];
    let e = u;
    if (this.oneHot) {
      const oh = this.oneHot;
      if (!bits || bits.length !== this.w || bits.some((b) => b !== 0 && b !== 1)) throw new Error("a one-hot row of 0/1 is needed");
      for (const [start, len] of oh.blocks) {
        if (bits.slice(start, start + len).reduce((a, b) => a + b, 0) !== 1) throw new Error("every block of a row holds exactly one 1");
      }
      out.push(...bits.map((b) => BigInt(b)));
      e = u.map((x, i) => x - oh.unit * BigInt(bits[i]));
    }
    let norm2 = 0n;
    const b = BigInt(this.beta);
    for (const x of e) {
      if (x < -this.half || x >= this.half) throw new Error("a coordinate is outside the validity range: redraw its noise");
      norm2 += x * x;
      let v = x + this.half;
      for (let m = 0; m < this.q; m++) {
        out.push(v % b);
        v /= b;
      }
    }
    if (norm2 > this.r2) throw new Error("a vector's squared norm exceeds the validity bound: redraw its noise");
    let s = this.r2 - norm2;
    for (let m = 0; m < this.slackDigits; m++) {
      out.push(s % b);
      s /= b;
    }
    return out;
  }

  /** The bounded coordinates sum_m beta^m d_(i,m) - H (x for NormBound, the noise e for OneHotNorm). */
  noise(input: Fp[]): Fp[] {
    const out: Fp[] = [];
    const c = encodeInt(-this.half);
    for (let i = 0; i < this.w; i++) {
      let x = 0n, weight = 1n;
      for (let m = 0; m < this.q; m++) {
        x = add(x, mul(input[this.digitsAt + i * this.q + m], weight));
        weight *= BigInt(this.beta);
      }
      out.push(add(x, c));
    }
    return out;
  }

  /** The wire values of every call of gadget g: [call][wire]. */
  wires(g: number, input: Fp[]): Fp[][] {
    const gd = this.gadgets[g];
    if (gd.kind === "range") return rangeWires(gd, input);
    return productWires(gd, this.noise(input).map((v) => [v, v]));
  }
}

/** J pairs of F_(p^2) from the report id: the weighted gadgets' r, then rho. */
export function jointRand(c: Circuit, reportId: Uint8Array): Fp2[] {
  const key = sha256(concat(JOINT_DOMAIN, reportId));
  const e = expand(key, 2 * c.jointRandLen, JOINT_NONCE);
  const out: Fp2[] = [];
  for (let i = 0; i < c.jointRandLen; i++) out.push([e[2 * i], e[2 * i + 1]]);
  return out;
}

/** The proof of one report: per gadget its wire seeds (a_1, b_1, ...), then q_g's coefficients. */
export function prove(c: Circuit, input: Fp[], joint: Fp2[], proveRand: Fp[]): Fp[] {
  return fromVec(proveVec(c, toVec(input), joint, toVec(proveRand)));
}

/**
 * prove on typed-array vectors (fieldvec.ts), the prover's hot path: a wire's values, its
 * interpolation and evaluation on the gadget's domain, and the gadget's polynomial, each a
 * vector kernel over all points at once.
 */
export function proveVec(c: Circuit, input: FpVec, joint: Fp2[], proveRand: FpVec): FpVec {
  const proof = vec(c.proofLen);
  let at = 0;
  const push = (v: FpVec, i: number) => {
    proof[2 * at] = v[2 * i];
    proof[2 * at + 1] = v[2 * i + 1];
    at++;
  };
  let rp = 0;
  let weightedIdx = 0;
  let bigInput: Fp[] | null = null;
  for (let g = 0; g < c.gadgets.length; g++) {
    const gd = c.gadgets[g];
    // where wire j of call k sits in the input (range, rownorm), else the circuit's BigInt wires
    let calls: Fp[][] | null = null;
    let index: (k: number, j: number) => number = () => -1;
    if (gd.kind === "range") index = (k, j) => (k * gd.count + j < gd.columns.length ? gd.columns[k * gd.count + j] : -1);
    else if (gd.kind === "rownorm") index = (k, j) => k * gd.arity + j;
    else calls = c.wires(g, (bigInput ??= fromVec(input)));
    const evalSize = nextPow2(gd.polyLen);
    const small = roots(gd.wireLen), big = roots(evalSize);
    const wireEvals: FpVec[] = [];
    for (let j = 0; j < gd.arity; j++) {
      const vals = vec(gd.wireLen);
      push(proveRand, rp);
      vals[0] = proveRand[2 * rp];
      vals[1] = proveRand[2 * rp++ + 1];
      push(proveRand, rp);
      vals[2 * gd.calls + 2] = proveRand[2 * rp];
      vals[2 * gd.calls + 3] = proveRand[2 * rp++ + 1];
      for (let k = 0; k < gd.calls; k++) {
        if (calls) setBig(vals, k + 1, calls[k][j]);
        else {
          const i = index(k, j);
          if (i >= 0) {
            vals[2 * k + 2] = input[2 * i];
            vals[2 * k + 3] = input[2 * i + 1];
          }
        }
      }
      // the wire polynomial's values on the evaluation domain
      wireEvals.push(extendVec(vals, evalSize, small.w, small.wInv, big.w, small.nInv));
    }
    const poly = (vals: FpVec): void => {
      scaleVec(vals, transformVec(vals, big.wInv), big.nInv);
      for (let i = 0; i < gd.polyLen; i++) push(vals, i);
    };
    if (gd.weighted) {
      const r = joint[weightedIdx++];
      const c0 = vec(evalSize), c1 = vec(evalSize);
      let weight: Fp2 = [1n, 0n];
      const prod = vec(evalSize), tmp = vec(evalSize);
      for (let l = 0; l < gd.count; l++) {
        if (l > 0) weight = mul2(weight, r);
        if (gd.kind === "mulsub") {
          // MulSub(a, b, c) = a b - c
          prod.set(wireEvals[3 * l]);
          mulVec(prod, prod, wireEvals[3 * l + 1]);
          subVec(prod, prod, wireEvals[3 * l + 2]);
        } else if (gd.kind === "rownorm") {
          // RowNorm(a_1..a_K) = sum_j a_j^2 - R^2
          const k = gd.arity / gd.count;
          prod.fill(0);
          addScalarVec(prod, prod, (P - gd.r2!) % P);
          for (let j = k * l; j < k * l + k; j++) mulAddVec(prod, wireEvals[j], wireEvals[j]);
        } else {
          // Range(beta)(x) = prod_v (x - v)
          const x = wireEvals[l];
          prod.set(x);
          for (let v = 1; v < gd.beta; v++) mulVec(prod, prod, addScalarVec(tmp, x, P - BigInt(v)));
        }
        scaleAddVec(c0, prod, weight[0]);
        scaleAddVec(c1, prod, weight[1]);
      }
      scaleVec(c0, transformVec(c0, big.wInv), big.nInv);
      scaleVec(c1, transformVec(c1, big.wInv), big.nInv);
      for (let i = 0; i < gd.polyLen; i++) {
        push(c0, i);
        push(c1, i);
      }
    } else {
      const vals = vec(evalSize);
      for (let l = 0; l < gd.count; l++) mulAddVec(vals, wireEvals[2 * l], wireEvals[2 * l + 1]);
      poly(vals);
    }
  }
  return proof;
}

/** A helper's input share then proof share, from its 32-byte seed. */
export function expandShare(c: Circuit, seed: Uint8Array): { input: Fp[]; proof: Fp[] } {
  const e = expand(seed, c.inputLen + c.proofLen, SHARE_NONCE);
  return { input: e.slice(0, c.inputLen), proof: e.slice(c.inputLen) };
}
