/**
 * Wrap-around checks of a batch proof (docs/validity.md section 15, the client's side): the
 * threshold T and digits q_w of the r projections, the wrap bits from a batch's wrap seed, and
 * the projections <z_k, v> (z_k = b_k - b_0) of the batch's prefix v = (x, roots).
 */
import { chacha20, sha256 } from "../primitives.js";
import { ascii } from "../bytes.js";
import { isqrt } from "./field.js";

export const BITS_NONCE = sha256(ascii("dpsketch/wrap-bits/1")).subarray(0, 12);
export const BASE = 4;
export const REFUSAL_LOG2 = -96;
export const REPETITIONS = 128;

/** T = isqrt(ceil(2 m R^2 (ln(2 r) + 96 ln 2) (1 + 1e-12))) + 1, doubles left to right as the reference. */
export function threshold(m: number, r2: bigint, reps = REPETITIONS, refusalLog2 = REFUSAL_LOG2): bigint {
  const t2 = 2.0 * m * Number(r2) * (Math.log(2.0 * reps) - refusalLog2 * Math.log(2.0));
  return isqrt(BigInt(Math.ceil(t2 * (1.0 + 1e-12)))) + 1n;
}

/** The least q with 4^q > 2 T. */
export function wrapDigitsFor(t: bigint): number {
  let q = 1;
  while (4n ** BigInt(q) <= 2n * t) q++;
  return q;
}

/** The bits table, (ceil(n / 8), r + 1) bytes row-major: the ChaCha20 keystream under the wrap seed. */
export function bits(seed: Uint8Array, reps: number, n: number): Uint8Array {
  return chacha20(seed, BITS_NONCE, new Uint8Array(Math.ceil(n / 8) * (reps + 1)));
}

/**
 * <z_k, v> for k = 1..r, v the prefix as integers (|v_j| small: the sums stay exact doubles,
 * |sum| <= n max|v| < 2^53 checked), the bits drawn a piece of 4096 value blocks at a time.
 */
export function project(values: ArrayLike<number>, seed: Uint8Array, reps: number): bigint[] {
  const n = values.length;
  const blocks = Math.ceil(n / 8);
  const row = reps + 1;
  let most = 0;
  for (let j = 0; j < n; j++) most = Math.max(most, Math.abs(values[j]));
  if (most * n >= 2 ** 53) throw new Error("projected values too large for exact sums");
  const sums = new Float64Array(row);
  const lowSums = new Float64Array(16), highSums = new Float64Array(16);
  const piece = 4096; // 4096 (r + 1) bytes: whole 64-byte ChaCha20 blocks
  const zeros = new Uint8Array(piece * row);
  const v = new Float64Array(blocks * 8);
  for (let j = 0; j < n; j++) v[j] = values[j];
  for (let start = 0; start < blocks; start += piece) {
    const count = Math.min(piece, blocks - start);
    const part = chacha20(seed, BITS_NONCE, zeros.subarray(0, count * row), (start * row) / 64);
    for (let b = 0; b < count; b++) {
      const at = 8 * (start + b);
      const off = b * row;
      // the block's subset sums by nibble (exact integers: any order gives the same sums)
      for (let x = 1; x < 16; x++) {
        const low = x & -x, bit = 31 - Math.clz32(low);
        lowSums[x] = lowSums[x ^ low] + v[at + bit];
        highSums[x] = highSums[x ^ low] + v[at + 4 + bit];
      }
      for (let k = 0; k < row; k++) {
        const byte = part[off + k];
        sums[k] += lowSums[byte & 15] + highSums[byte >> 4];
      }
    }
  }
  const out: bigint[] = [];
  for (let k = 1; k < row; k++) out.push(BigInt(sums[k] - sums[0]));
  return out;
}
