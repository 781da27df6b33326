/**
 * NTTs over F_p on power-of-two domains (docs/validity.md section 1): w_n = ROOT^(2^32 / n),
 * ROOT = 7^((p-1)/2^32); A_i = sum_j a_j w_n^(ij), natural order.
 */
import { inv, mul, P, pow, add, sub, type Fp } from "./field.js";

const ROOT = pow(7n, (P - 1n) >> 32n);

export function rootOfUnity(n: number): Fp {
  const k = Math.log2(n);
  if (!Number.isInteger(k) || k > 32) throw new Error(`no NTT domain of size ${n}`);
  return pow(ROOT, 1n << BigInt(32 - k));
}

export const nextPow2 = (n: number): number => {
  let p = 1;
  while (p < n) p *= 2;
  return p;
};

/** Per stage twiddles of a size-n transform with root w (cached: a proof runs the same sizes). */
const twiddleCache = new Map<string, Fp[][]>();
function twiddles(n: number, w: Fp): Fp[][] {
  const key = `${n}/${w}`;
  const hit = twiddleCache.get(key);
  if (hit) return hit;
  const stages: Fp[][] = [];
  for (let len = 2; len <= n; len <<= 1) {
    const wl = pow(w, BigInt(n / len));
    const half = len >> 1;
    const tw: Fp[] = new Array(half);
    tw[0] = 1n;
    for (let k = 1; k < half; k++) tw[k] = mul(tw[k - 1], wl);
    stages.push(tw);
  }
  twiddleCache.set(key, stages);
  return stages;
}

const rootCache = new Map<number, { w: Fp; wInv: Fp; nInv: Fp }>();
/** w_n, its inverse and 1/n (cached). */
export function roots(n: number): { w: Fp; wInv: Fp; nInv: Fp } {
  let r = rootCache.get(n);
  if (!r) {
    const w = rootOfUnity(n);
    r = { w, wInv: inv(w), nInv: inv(BigInt(n)) };
    rootCache.set(n, r);
  }
  return r;
}

function transform(a: Fp[], w: Fp): Fp[] {
  const n = a.length;
  const stages = twiddles(n, w);
  const out = a.slice();
  // bit-reversal permutation, then iterative butterflies
  for (let i = 1, j = 0; i < n; i++) {
    let bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) [out[i], out[j]] = [out[j], out[i]];
  }
  for (let len = 2, st = 0; len <= n; len <<= 1, st++) {
    const half = len >> 1;
    const tw = stages[st];
    for (let i = 0; i < n; i += len) {
      for (let k = 0; k < half; k++) {
        const u = out[i + k], v = mul(out[i + k + half], tw[k]);
        out[i + k] = add(u, v);
        out[i + k + half] = sub(u, v);
      }
    }
  }
  return out;
}

/** Evaluations at w_n^i of the polynomial with these coefficients (padded to n). */
export function ntt(coeffs: Fp[], n: number): Fp[] {
  const a = coeffs.slice(0, n);
  while (a.length < n) a.push(0n);
  return transform(a, roots(n).w);
}

/** Coefficients of the polynomial of degree < n with these values at w_n^i. */
export function intt(values: Fp[]): Fp[] {
  const n = values.length;
  const r = roots(n);
  const out = transform(values, r.wInv);
  const ninv = r.nInv;
  return out.map((x) => mul(x, ninv));
}
