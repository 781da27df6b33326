/**
 * Vectors of F_p elements (p = 2^64 - 2^32 + 1) in typed arrays, the prover's hot kernels: an
 * element i of a vector is the pair (lo, hi) = (v[2 i], v[2 i + 1]) of a Uint32Array, so the
 * buffer is the elements' little-endian u64 bytes on a little-endian machine (every browser and
 * Node platform). Arithmetic runs on doubles (every intermediate an exact integer below 2^53):
 * 32 x 32-bit products from Math.imul (low half) and a rounded double (high half), and the
 * Goldilocks reduction 2^64 = 2^32 - 1, 2^96 = -1 (mod p). No BigInt and no allocation per
 * element: field.ts's BigInt functions stay the reference and the cold paths' API.
 */
import { chacha20 } from "../primitives.js";
import type { Keystream } from "../keystream.js";
import { P, type Fp } from "./field.js";

export type FpVec = Uint32Array;

const TWO32 = 4294967296;
const INV32 = 1 / TWO32;
const MAX32 = 4294967295;

/**
 * a product's (lo, hi) on its way to a destination: a typed array, as a double kept in a module
 * variable would be a heap number allocated per store
 */
const T = new Float64Array(2);

/** L + 2^32 H (|L|, |H| < 2^50) reduced to canonical (out[o], out[o + 1]). */
function norm(L: number, H: number): void {
  let c = Math.floor(L * INV32);
  L -= c * TWO32;
  H += c;
  c = Math.floor(H * INV32);
  H -= c * TWO32;
  while (c !== 0) {
    // c 2^64 = c (2^32 - 1) mod p
    L -= c;
    H += c;
    const d = Math.floor(L * INV32);
    L -= d * TWO32;
    H += d;
    c = Math.floor(H * INV32);
    H -= c * TWO32;
  }
  if (H === MAX32 && L >= 1) {
    // v - p = v - 2^64 + 2^32 - 1
    H = 0;
    L -= 1;
  }
  T[0] = L;
  T[1] = H;
}

/** (a0 + 2^32 a1)(b0 + 2^32 b1) mod p into (out[o], out[o + 1]); every input a canonical 32-bit half. */
function mulParts(a0: number, a1: number, b0: number, b1: number): void {
  // x y = lo + 2^32 hi: lo exact from imul, hi = round((fl(x y) - lo) / 2^32) (error < 2^13)
  const l00 = Math.imul(a0, b0) >>> 0, h00 = Math.round((a0 * b0 - l00) * INV32);
  const l01 = Math.imul(a0, b1) >>> 0, h01 = Math.round((a0 * b1 - l01) * INV32);
  const l10 = Math.imul(a1, b0) >>> 0, h10 = Math.round((a1 * b0 - l10) * INV32);
  const l11 = Math.imul(a1, b1) >>> 0, h11 = Math.round((a1 * b1 - l11) * INV32);
  const r2 = h01 + h10 + l11;
  // R0 + 2^32 R1 + 2^64 R2 + 2^96 R3 = R0 - R2 - R3 + 2^32 (R1 + R2) mod p: L + 2^32 H, L in (-2^35, 2^32), H in [0, 2^35)
  let L = l00 - r2 - h11, H = h00 + l01 + l10 + r2;
  // H's bits above 32 (c < 8): c 2^64 = c (2^32 - 1)
  let c = Math.floor(H * INV32);
  H = H - c * TWO32 + c;
  L -= c;
  // L's borrow into H: then H in [-6, 2^32 + 7)
  c = Math.floor(L * INV32);
  L -= c * TWO32;
  H += c;
  if (H >= TWO32) {
    // 2^64 = 2^32 - 1
    H = H - TWO32 + 1;
    L -= 1;
    if (L < 0) {
      L += TWO32;
      H -= 1;
    }
  } else if (H < 0) {
    // + p = + 1 + 2^32 (2^32 - 1)
    H += MAX32;
    L += 1;
    if (L === TWO32) {
      L = 0;
      H += 1;
    }
  }
  if (H === MAX32 && L >= 1) {
    H = 0;
    L -= 1;
  }
  T[0] = L;
  T[1] = H;
}

export const vec = (n: number): FpVec => new Uint32Array(2 * n);
export const vecLen = (v: FpVec): number => v.length >> 1;

/** BigInt elements (each in [0, p)) as a vector. */
export function toVec(a: ArrayLike<Fp>): FpVec {
  const b = new BigUint64Array(a.length);
  for (let i = 0; i < a.length; i++) b[i] = a[i];
  return fromU64(b);
}

/** A BigUint64Array's words as a vector (copied, the halves in lo, hi order whatever the platform). */
function fromU64(b: BigUint64Array): FpVec {
  const out = vec(b.length);
  if (LITTLE) out.set(new Uint32Array(b.buffer, b.byteOffset, 2 * b.length));
  else for (let i = 0; i < b.length; i++) {
    out[2 * i] = Number(b[i] & 0xffffffffn);
    out[2 * i + 1] = Number(b[i] >> 32n);
  }
  return out;
}

const LITTLE = new Uint8Array(Uint32Array.of(1).buffer)[0] === 1;

/** Integers (|x| < 2^50) mod p as a vector: the encoding of signed values. */
export function fromInts(a: ArrayLike<number>): FpVec {
  const out = vec(a.length);
  for (let i = 0; i < a.length; i++) {
    norm(a[i], 0);
    out[2 * i] = T[0];
    out[2 * i + 1] = T[1];
  }
  return out;
}

/** A vector's elements as BigInt. */
export function fromVec(v: FpVec): Fp[] {
  const n = v.length >> 1;
  const out: Fp[] = new Array(n);
  if (LITTLE) {
    const b = new BigUint64Array(v.buffer, v.byteOffset, n);
    for (let i = 0; i < n; i++) out[i] = b[i];
  } else for (let i = 0; i < n; i++) out[i] = (BigInt(v[2 * i + 1]) << 32n) | BigInt(v[2 * i]);
  return out;
}

/** Element i as BigInt. */
export const getBig = (v: FpVec, i: number): Fp => (BigInt(v[2 * i + 1]) << 32n) | BigInt(v[2 * i]);

/** Element i := x (x in [0, p)). */
export function setBig(v: FpVec, i: number, x: Fp): void {
  v[2 * i] = Number(x & 0xffffffffn);
  v[2 * i + 1] = Number(x >> 32n);
}

/** The elements' u64 little-endian bytes (the wire's encoding). */
export function vecBytes(v: FpVec): Uint8Array {
  if (LITTLE) return new Uint8Array(v.buffer.slice(v.byteOffset, v.byteOffset + 4 * v.length));
  const out = new Uint8Array(4 * v.length);
  const dv = new DataView(out.buffer);
  for (let i = 0; i < v.length; i++) dv.setUint32(4 * i, v[i], true);
  return out;
}

/** out[i] = a[i] + b[i] (out may be a or b). */
export function addVec(out: FpVec, a: FpVec, b: FpVec): FpVec {
  for (let i = 0; i < out.length; i += 2) {
    norm(a[i] + b[i], a[i + 1] + b[i + 1]);
    out[i] = T[0];
    out[i + 1] = T[1];
  }
  return out;
}

/** out[i] = a[i] - b[i] (out may be a or b). */
export function subVec(out: FpVec, a: FpVec, b: FpVec): FpVec {
  for (let i = 0; i < out.length; i += 2) {
    norm(a[i] - b[i], a[i + 1] - b[i + 1]);
    out[i] = T[0];
    out[i + 1] = T[1];
  }
  return out;
}

/** out[i] = a[i] b[i] (out may be a or b). */
export function mulVec(out: FpVec, a: FpVec, b: FpVec): FpVec {
  for (let i = 0; i < out.length; i += 2) {
    mulParts(a[i], a[i + 1], b[i], b[i + 1]);
    out[i] = T[0];
    out[i + 1] = T[1];
  }
  return out;
}

/** out[i] = a[i] s. */
export function scaleVec(out: FpVec, a: FpVec, s: Fp): FpVec {
  const s0 = Number(s & 0xffffffffn), s1 = Number(s >> 32n);
  for (let i = 0; i < out.length; i += 2) {
    mulParts(a[i], a[i + 1], s0, s1);
    out[i] = T[0];
    out[i + 1] = T[1];
  }
  return out;
}

/** out[o] += a[i] b[j] (element indices). */
export function mulAddAt(out: FpVec, o: number, a: FpVec, i: number, b: FpVec, j: number): void {
  mulParts(a[2 * i], a[2 * i + 1], b[2 * j], b[2 * j + 1]);
  norm(out[2 * o] + T[0], out[2 * o + 1] + T[1]);
  out[2 * o] = T[0];
  out[2 * o + 1] = T[1];
}

/** acc[i] += a[i] b[i]. */
export function mulAddVec(acc: FpVec, a: FpVec, b: FpVec): FpVec {
  for (let i = 0; i < acc.length; i += 2) {
    mulParts(a[i], a[i + 1], b[i], b[i + 1]);
    norm(acc[i] + T[0], acc[i + 1] + T[1]);
    acc[i] = T[0];
    acc[i + 1] = T[1];
  }
  return acc;
}

/** acc[i] += a[i] s. */
export function scaleAddVec(acc: FpVec, a: FpVec, s: Fp): FpVec {
  const s0 = Number(s & 0xffffffffn), s1 = Number(s >> 32n);
  for (let i = 0; i < acc.length; i += 2) {
    mulParts(a[i], a[i + 1], s0, s1);
    norm(acc[i] + T[0], acc[i + 1] + T[1]);
    acc[i] = T[0];
    acc[i + 1] = T[1];
  }
  return acc;
}

/** out[i] = a[i] + s. */
export function addScalarVec(out: FpVec, a: FpVec, s: Fp): FpVec {
  const s0 = Number(s & 0xffffffffn), s1 = Number(s >> 32n);
  for (let i = 0; i < out.length; i += 2) {
    norm(a[i] + s0, a[i + 1] + s1);
    out[i] = T[0];
    out[i + 1] = T[1];
  }
  return out;
}

/** The scalar kernels on BigInt (for tests and cold paths that want them): a b, a + b, a - b mod p. */
export function mulScalar(a: Fp, b: Fp): Fp {
  mulParts(Number(a & 0xffffffffn), Number(a >> 32n), Number(b & 0xffffffffn), Number(b >> 32n));
  return (BigInt(T[1]) << 32n) | BigInt(T[0]);
}

// ---- NTTs (docs/validity.md section 1: A_i = sum_j a_j w^(ij), natural order) ----

/** Per stage twiddles of a size-n transform with root w, as vectors (cached: a proof runs the same sizes). */
const twiddleCache = new Map<string, FpVec[]>();
function twiddles(n: number, w: Fp): FpVec[] {
  const key = `${n}/${w}`;
  const hit = twiddleCache.get(key);
  if (hit) return hit;
  const stages: FpVec[] = [];
  for (let len = 2; len <= n; len <<= 1) {
    const half = len >> 1;
    const tw = vec(half);
    tw[0] = 1;
    if (half > 1) {
      // wl = w^(n / len)
      let e = BigInt(n / len), b = w, r = 1n;
      while (e > 0n) {
        if (e & 1n) r = (r * b) % P;
        b = (b * b) % P;
        e >>= 1n;
      }
      const w0 = Number(r & 0xffffffffn), w1 = Number(r >> 32n);
      for (let k = 1; k < half; k++) {
        mulParts(tw[2 * k - 2], tw[2 * k - 1], w0, w1);
        tw[2 * k] = T[0];
        tw[2 * k + 1] = T[1];
      }
    }
    stages.push(tw);
  }
  twiddleCache.set(key, stages);
  return stages;
}

/** In place: the size-n transform with root w of v (n = vecLen(v), a power of two). */
export function transformVec(v: FpVec, w: Fp): FpVec {
  const n = v.length >> 1;
  const stages = twiddles(n, w);
  for (let i = 1, j = 0; i < n; i++) {
    let bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) {
      let t = v[2 * i];
      v[2 * i] = v[2 * j];
      v[2 * j] = t;
      t = v[2 * i + 1];
      v[2 * i + 1] = v[2 * j + 1];
      v[2 * j + 1] = t;
    }
  }
  for (let len = 2, st = 0; len <= n; len <<= 1, st++) {
    const half = len >> 1;
    const tw = stages[st];
    for (let i = 0; i < n; i += len) {
      for (let k = 0; k < half; k++) {
        const x = 2 * (i + k), y = x + 2 * half;
        let m0 = v[y], m1 = v[y + 1];
        if (k !== 0) {
          // m = v[y] tw[k], mulParts inlined (the prover's hottest loop)
          const b0 = tw[2 * k], b1 = tw[2 * k + 1];
          const l00 = Math.imul(m0, b0) >>> 0, h00 = Math.round((m0 * b0 - l00) * INV32);
          const l01 = Math.imul(m0, b1) >>> 0, h01 = Math.round((m0 * b1 - l01) * INV32);
          const l10 = Math.imul(m1, b0) >>> 0, h10 = Math.round((m1 * b0 - l10) * INV32);
          const l11 = Math.imul(m1, b1) >>> 0, h11 = Math.round((m1 * b1 - l11) * INV32);
          const r2 = h01 + h10 + l11;
          // R0 + 2^32 R1 + 2^64 R2 + 2^96 R3 = R0 - R2 - R3 + 2^32 (R1 + R2) mod p: L + 2^32 H, L in (-2^35, 2^32), H in [0, 2^35)
          let L = l00 - r2 - h11, H = h00 + l01 + l10 + r2;
          // H's bits above 32 (c < 8): c 2^64 = c (2^32 - 1)
          let c = Math.floor(H * INV32);
          H = H - c * TWO32 + c;
          L -= c;
          // L's borrow into H: then H in [-6, 2^32 + 7)
          c = Math.floor(L * INV32);
          L -= c * TWO32;
          H += c;
          if (H >= TWO32) {
            // 2^64 = 2^32 - 1
            H = H - TWO32 + 1;
            L -= 1;
            if (L < 0) {
              L += TWO32;
              H -= 1;
            }
          } else if (H < 0) {
            // + p = + 1 + 2^32 (2^32 - 1)
            H += MAX32;
            L += 1;
            if (L === TWO32) {
              L = 0;
              H += 1;
            }
          }
          if (H === MAX32 && L >= 1) {
            H = 0;
            L -= 1;
          }
          m0 = L;
          m1 = H;
        }
        const u0 = v[x], u1 = v[x + 1];
        // u + m, both canonical: subtract p once if the sum reaches it
        let s0 = u0 + m0, s1 = u1 + m1;
        if (s0 >= TWO32) {
          s0 -= TWO32;
          s1 += 1;
        }
        if (s1 > MAX32 || (s1 === MAX32 && s0 >= 1)) {
          // s - p = s - 2^64 + 2^32 - 1
          s1 -= MAX32;
          s0 -= 1;
          if (s0 < 0) {
            s0 += TWO32;
            s1 -= 1;
          }
        }
        // u - m: add p if negative
        let d0 = u0 - m0, d1 = u1 - m1;
        if (d0 < 0) {
          d0 += TWO32;
          d1 -= 1;
        }
        if (d1 < 0) {
          // d + p = d + 2^64 - 2^32 + 1
          d1 += MAX32;
          d0 += 1;
          if (d0 === TWO32) {
            d0 = 0;
            d1 += 1;
          }
        }
        v[x] = s0;
        v[x + 1] = s1;
        v[y] = d0;
        v[y + 1] = d1;
      }
    }
  }
  return v;
}

/** nInv w_N^(r j), j < n: the twist of coset r of a size-n domain inside the size-N one (cached). */
const twistCache = new Map<string, FpVec>();
function twist(n: number, N: number, r: number, wN: Fp, nInv: Fp): FpVec {
  const key = `${n}/${N}/${r}`;
  let t = twistCache.get(key);
  if (!t) {
    let e = BigInt(r), b = wN, step = 1n;
    while (e > 0n) {
      if (e & 1n) step = (step * b) % P;
      b = (b * b) % P;
      e >>= 1n;
    }
    const out: Fp[] = new Array(n);
    let x = nInv;
    for (let j = 0; j < n; j++) {
      out[j] = x;
      x = (x * step) % P;
    }
    t = toVec(out);
    twistCache.set(key, t);
  }
  return t;
}

/**
 * The values on the size-N domain (N = f n, f a power of two) of the polynomial of degree < n
 * with values `vals` at w_n^i: point f i + r is coset r's transform of the coefficients twisted
 * by w_N^(r j), and coset 0 is vals itself: one inverse and f - 1 forward size-n transforms
 * instead of a size-n inverse and a size-N forward one.
 */
export function extendVec(vals: FpVec, N: number, wn: Fp, wnInv: Fp, wN: Fp, nInv: Fp): FpVec {
  const n = vals.length >> 1, f = N / n;
  const out = vec(N);
  for (let i = 0; i < n; i++) {
    out[2 * f * i] = vals[2 * i];
    out[2 * f * i + 1] = vals[2 * i + 1];
  }
  if (f === 1) return out;
  const coeffs = transformVec(vals.slice(), wnInv);
  const t = vec(n);
  for (let r = 1; r < f; r++) {
    transformVec(mulVec(t, coeffs, twist(n, N, r, wN, nInv)), wn);
    for (let i = 0; i < n; i++) {
      out[2 * (f * i + r)] = t[2 * i];
      out[2 * (f * i + r) + 1] = t[2 * i + 1];
    }
  }
  return out;
}

// ---- seeded expansions (docs/validity.md section 4) ----

/** field.ts's expand as a vector: words of a ChaCha20 keystream (key, nonce, counter 0), each >= p skipped. */
export function expandVec(key: Uint8Array, count: number, nonce: Uint8Array): FpVec {
  const out = vec(count);
  let got = 0;
  let blocks = Math.ceil((8 * count) / 64) + 1;
  let counter = 0;
  while (got < count) {
    const bytes = chacha20(key, nonce, new Uint8Array(64 * blocks), counter);
    counter += blocks;
    got = acceptWords(bytes, out, got);
    blocks = 1;
  }
  return out;
}

/** Appends the u64 LE words of `bytes` that are < p to out (from element `got`, until full); the new count. */
function acceptWords(bytes: Uint8Array, out: FpVec, got: number): number {
  const count = out.length >> 1;
  const words = LITTLE && bytes.byteOffset % 4 === 0
    ? new Uint32Array(bytes.buffer, bytes.byteOffset, bytes.length >> 2)
    : new Uint32Array(new Uint8Array(bytes).buffer);
  if (!LITTLE) {
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    for (let i = 0; i < words.length; i++) words[i] = dv.getUint32(4 * i, true);
  }
  for (let o = 0; o + 1 < words.length && got < count; o += 2) {
    const lo = words[o], hi = words[o + 1];
    if (hi === MAX32 && lo !== 0) continue; // a word >= p
    out[2 * got] = lo;
    out[2 * got + 1] = hi;
    got++;
  }
  return got;
}

/** field.ts's sample as a vector: count uniform elements from the client keystream. */
export function sampleVec(ks: Keystream, count: number): FpVec {
  const out = vec(count);
  let got = 0;
  while (got < count) got = acceptWords(ks.bytes(8 * (count - got)), out, got);
  return out;
}
