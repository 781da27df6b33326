/**
 * The exact discrete Gaussian sampler of docs/protocol.md section 5a: X ~ N_Z(t) conditioned on
 * |X| <= L, from the batch keystream, draw for draw as the draw order states (so a batch's noise
 * is a function of its key and comparable with the reference's). Only comparisons of exact
 * uniform integers with exact integers: the cumulative table is computed in BigInt fixed point
 * with an error bound, at a precision raised until every floor is certain.
 */
import { Keystream } from "./keystream.js";

const TWO64 = 1n << 64n;

/** exp(-a/b) * 2^P, truncated, for 0 <= a/b <= 1 (Taylor series; error below 2^8 ulps). */
function expNegFixed(a: bigint, b: bigint, P: number): bigint {
  const one = 1n << BigInt(P);
  let term = one;
  let sum = one;
  for (let n = 1n; term !== 0n; n++) {
    term = (term * a) / (b * n);
    sum = n % 2n === 1n ? sum - term : sum + term;
  }
  return sum;
}

export interface BlockTable {
  t: number;
  limit: number;
  /** m: the block size */
  block: number;
  /** floor(L/m): the number of table entries */
  entries: number;
  /** bound_j = floor(2^64 F_j), j = 0 .. entries-1 */
  bounds: bigint[];
  hi: Uint32Array;
  lo: Uint32Array;
  /** floor(2^bits F_j), for the tie path */
  floorF(j: number, bits: number): bigint;
}

interface Tails {
  P: number;
  tails: bigint[]; // T_j = sum_{i > j} rho(m i) * 2^P, j = 0 .. E-1
  total: bigint;
  err: bigint; // absolute error bound on every T_j and on the total, in ulps
}

function computeTails(t: number, m: number, E: number, P: number): Tails {
  const a = BigInt(m) * BigInt(m);
  const b = 2n * BigInt(t) * BigInt(t);
  const one = 1n << BigInt(P);
  const q = expNegFixed(a, b, P); // q = exp(-m^2/(2t^2)); rho(m i) = q^(i^2)
  const q2 = (q * q) >> BigInt(P);
  const rho: bigint[] = new Array(E + 1);
  rho[0] = one;
  let step = q; // q^(2i+1)
  for (let i = 0; i < E; i++) {
    rho[i + 1] = (rho[i] * step) >> BigInt(P);
    step = (step * q2) >> BigInt(P);
  }
  const tails: bigint[] = new Array(E);
  let acc = 0n;
  for (let j = E - 1; j >= 0; j--) {
    acc += rho[j + 1];
    tails[j] = acc;
  }
  const total = acc + rho[0];
  // every rho_i is within 600 (i+1)^2 ulps; a sum of E+1 of them within 600 (E+1)^3 + E + 1
  const n = BigInt(E + 2);
  return { P, tails, total, err: 600n * n * n * n };
}

/** ceil(2^bits * T / Total) if the error bound decides it, else null. */
function ceilRatio(T: bigint, tot: bigint, err: bigint, bits: number): bigint | null {
  const s = 1n << BigInt(bits);
  const ceilDiv = (x: bigint, y: bigint) => (x + y - 1n) / y;
  if (T - err <= 0n || tot - err <= 0n) return null;
  const lo = ceilDiv(s * (T - err), tot + err);
  const hi = ceilDiv(s * (T + err), tot - err);
  return lo === hi ? lo : null;
}

const tableCache = new Map<string, BlockTable>();

export function blockTable(t: number, limit: number): BlockTable {
  const key = `${t}/${limit}`;
  const cached = tableCache.get(key);
  if (cached) return cached;
  if (!(Number.isInteger(t) && t >= 1 && t <= 2 ** 24)) throw new Error(`sampler parameter t=${t} out of range`);
  const m = Math.max(1, Math.ceil((limit + 1) / 2048));
  const E = Math.floor(limit / m);
  // the smallest term is exp(-(m E)^2 / (2 t^2)); enough bits to hold it with room to spare
  const nats = (m * E) ** 2 / (2 * t * t);
  let tails: Tails | null = null;
  const precisionFor = (bits: number) => Math.max(256, Math.ceil(nats * 1.4426950408889634) + bits + 160);
  const at = (bits: number): Tails => {
    const P = precisionFor(bits);
    if (tails === null || tails.P < P) tails = computeTails(t, m, E, P);
    return tails;
  };
  const floorF = (j: number, bits: number): bigint => {
    for (let extra = 0; extra < 6; extra++) {
      const tl = at(bits + 64 * extra);
      if (extra > 0 && tl.P < precisionFor(bits + 64 * extra)) continue;
      const c = ceilRatio(tl.tails[j], tl.total, tl.err, bits);
      if (c !== null) return (1n << BigInt(bits)) - c;
      tails = computeTails(t, m, E, tl.P * 2);
    }
    throw new Error("block table: precision exhausted");
  };
  const bounds: bigint[] = new Array(E);
  const hi = new Uint32Array(E), lo = new Uint32Array(E);
  for (let j = 0; j < E; j++) {
    const v = floorF(j, 64);
    bounds[j] = v;
    hi[j] = Number(v >> 32n);
    lo[j] = Number(v & 0xffffffffn);
  }
  const table: BlockTable = { t, limit, block: m, entries: E, bounds, hi, lo, floorF };
  tableCache.set(key, table);
  return table;
}

/** #{j : bound_j <= w} for w = hi*2^32 + lo, and whether some bound equals w (a tie). */
function countBelow(tb: BlockTable, hi: number, lo: number): { J: number; tie: boolean } {
  let a = 0, b = tb.entries; // first index with bound > w
  while (a < b) {
    const mid = (a + b) >>> 1;
    const bh = tb.hi[mid];
    if (bh < hi || (bh === hi && tb.lo[mid] <= lo)) a = mid + 1;
    else b = mid;
  }
  const tie = a > 0 && tb.hi[a - 1] === hi && tb.lo[a - 1] === lo;
  return { J: a, tie };
}

/** BernoulliExp(gamma, den) of section 5a: all entries together; 1 = keep. */
export function bernoulliExp(ks: Keystream, gammas: bigint[], den: bigint): Uint8Array {
  const P = gammas.length;
  const result = new Uint8Array(P);
  let running: number[] = [];
  for (let i = 0; i < P; i++) running.push(i);
  let K = 1n;
  for (; K <= 128n && running.length > 0; K++) {
    const M = K * den;
    const n = running.length;
    const next: number[] = [];
    if (den < 1n << 24n && M < 1n << 28n) {
      const Mn = Number(M);
      const q = Math.floor(4294967295 / Mn);
      const w = ks.below32(n, q * Mn);
      for (let k = 0; k < n; k++) {
        const i = running[k];
        if (w[k] < q * Number(gammas[i])) next.push(i);
        else result[i] = K % 2n === 1n ? 1 : 0;
      }
    } else {
      const q = (TWO64 - 1n) / M;
      const w = ks.below64(n, q * M);
      for (let k = 0; k < n; k++) {
        const i = running[k];
        if (w[k] < q * gammas[i]) next.push(i);
        else result[i] = K % 2n === 1n ? 1 : 0;
      }
    }
    running = next;
  }
  for (const i of running) {
    let k = 129n;
    while (ks.uniform(k * den) < gammas[i]) k++;
    result[i] = k % 2n === 1n ? 1 : 0;
  }
  return result;
}

/** Draw(count, t, L): count values of N_Z(t) conditioned on |X| <= L, in the reference's order. */
export function draw(ks: Keystream, count: number, t: number, limit: number): Int32Array | Float64Array {
  const tb = blockTable(t, limit);
  const m = tb.block;
  const out = limit < 2 ** 31 ? new Int32Array(count) : new Float64Array(count);
  let kept = 0;
  const den = 2n * BigInt(t) * BigInt(t);
  while (kept < count) {
    const need = count - kept;
    const P = need + Math.floor(need / 16) + 16;
    const { hi, lo } = ks.words64Split(P);
    const J = new Float64Array(P);
    const ties: number[] = [];
    for (let i = 0; i < P; i++) {
      const r = countBelow(tb, hi[i], lo[i]);
      J[i] = r.J;
      if (r.tie) ties.push(i);
    }
    for (const i of ties) J[i] = resolveTie(ks, tb, (BigInt(hi[i]) << 32n) | BigInt(lo[i]));
    let X: number[];
    if (m > 1) {
      const q = Math.floor(4294967295 / m);
      const w = ks.below32(P, q * m);
      const gammas: bigint[] = new Array(P);
      const xs = new Float64Array(P);
      for (let i = 0; i < P; i++) {
        const R = Math.floor(w[i] / q);
        xs[i] = m * J[i] + R;
        const bR = BigInt(R);
        gammas[i] = (2n * BigInt(m) * BigInt(J[i]) + bR) * bR;
      }
      const keep = bernoulliExp(ks, gammas, den);
      X = [];
      for (let i = 0; i < P; i++) if (keep[i] === 1 && xs[i] <= limit) X.push(xs[i]);
    } else {
      X = Array.from(J);
    }
    const signs = ks.bits(X.length);
    for (let i = 0; i < X.length && kept < count; i++) {
      if (signs[i] === 1) {
        if (X[i] === 0) continue;
        out[kept++] = -X[i];
      } else out[kept++] = X[i];
    }
  }
  return out;
}

/** The tie path of step b: w equals one or more bounds; more words of U decide. */
function resolveTie(ks: Keystream, tb: BlockTable, w: bigint): number {
  let T: number[] = [];
  for (let j = 0; j < tb.entries; j++) if (tb.bounds[j] === w) T.push(j);
  let J = T[0];
  let u = w;
  let bits = 64;
  while (T.length > 0) {
    u = (u << 64n) | ks.words64(1)[0];
    bits += 64;
    const rest: number[] = [];
    for (const j of T) {
      const f = tb.floorF(j, bits);
      if (f < u) J = j + 1;
      else if (f === u) rest.push(j);
    }
    T = rest;
  }
  return J;
}

/** The sampler's cut and parameter for a noise of standard deviation sd on grid h (section 5). */
export function noiseParameters(sd: number, h: number): { t: number; limit: number } {
  return { t: Math.max(1, Math.ceil(sd / h)), limit: Math.max(0, Math.floor((20 * sd) / h) - 1) };
}
