/**
 * F_p, p = 2^64 - 2^32 + 1 (Goldilocks), and F_(p^2) = F_p[X]/(X^2 - 7), with BigInt
 * (docs/validity.md section 1), and the seeded expansions of section 4: ChaCha20 keystream
 * words, a word >= p skipped.
 */
import { chacha20 } from "../primitives.js";
import type { Keystream } from "../keystream.js";

export const P = (1n << 64n) - (1n << 32n) + 1n;
export type Fp = bigint;
export type Fp2 = [bigint, bigint];

export const add = (a: Fp, b: Fp): Fp => {
  const s = a + b;
  return s >= P ? s - P : s;
};
export const sub = (a: Fp, b: Fp): Fp => (a >= b ? a - b : a + P - b);
export const mul = (a: Fp, b: Fp): Fp => (a * b) % P;
export const neg = (a: Fp): Fp => (a === 0n ? 0n : P - a);

export function pow(a: Fp, e: bigint): Fp {
  let r = 1n, b = a % P;
  while (e > 0n) {
    if (e & 1n) r = (r * b) % P;
    b = (b * b) % P;
    e >>= 1n;
  }
  return r;
}

export const inv = (a: Fp): Fp => pow(a, P - 2n);

/** floor(sqrt(s)) for a non-negative BigInt (Newton's iteration from above). */
export function isqrt(s: bigint): bigint {
  if (s < 2n) return s;
  let x = 1n << BigInt(Math.ceil(s.toString(2).length / 2));
  for (;;) {
    const y = (x + s / x) >> 1n;
    if (y >= x) return x;
    x = y;
  }
}

/** x mod p for a signed integer |x| <= (p-1)/2. */
export const encodeInt = (x: bigint): Fp => ((x % P) + P) % P;

export const add2 = (a: Fp2, b: Fp2): Fp2 => [add(a[0], b[0]), add(a[1], b[1])];
export const mul2 = (a: Fp2, b: Fp2): Fp2 => [(a[0] * b[0] + 7n * a[1] * b[1]) % P, (a[0] * b[1] + a[1] * b[0]) % P];
export const scale2 = (a: Fp2, s: Fp): Fp2 => [(a[0] * s) % P, (a[1] * s) % P];

/** Words of a ChaCha20 keystream (key, nonce, counter 0), each >= p skipped: the first count. */
export function expand(key: Uint8Array, count: number, nonce: Uint8Array): Fp[] {
  const out: Fp[] = [];
  let blocks = Math.ceil((8 * count) / 64) + 1;
  let counter = 0;
  while (out.length < count) {
    const bytes = chacha20(key, nonce, new Uint8Array(64 * blocks), counter);
    counter += blocks;
    const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
    for (let o = 0; o < bytes.length && out.length < count; o += 8) {
      const w = dv.getBigUint64(o, true);
      if (w < P) out.push(w);
    }
    blocks = 1;
  }
  return out;
}

/** count uniform elements from the client keystream (8-byte words, a word >= p skipped). */
export function sample(ks: Keystream, count: number): Fp[] {
  const out: Fp[] = [];
  let need = count;
  while (need > 0) {
    for (const w of ks.words64(need)) if (w < P) out.push(w);
    need = count - out.length;
  }
  return out;
}
