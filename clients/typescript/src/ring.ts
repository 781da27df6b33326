/**
 * Ring encoding and additive sharing mod 2^64 (docs/protocol.md section 4), and the seed
 * expansion of seed-compressed sharing: ChaCha20 under the seed, counter 0, nonce the first 12
 * bytes of SHA-256("dpsketch/seed-share/1").
 */
import { chacha20 } from "@noble/ciphers/chacha.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, MASK64, readU64s } from "./bytes.js";

export const SEED_NONCE = sha256(ascii("dpsketch/seed-share/1")).subarray(0, 12);

/** round(x 2^f) mod 2^64 (half to even); refuses |x| > bound (never wraps). */
export function encode(x: number, fracBits: number, bound: number): bigint {
  if (!Number.isFinite(x) || Math.abs(x) > bound) throw new RangeError(`value ${x} outside the encodable range +-${bound}`);
  return BigInt(roundHalfEven(x * 2 ** fracBits)) & MASK64;
}

/** A two's-complement int64 divided by 2^f. */
export function decode(r: bigint, fracBits: number): number {
  return Number(BigInt.asIntN(64, r)) / 2 ** fracBits;
}

export function roundHalfEven(v: number): number {
  const f = Math.floor(v);
  const d = v - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

/** A seed's width ring elements: the first 8 width bytes of its ChaCha20 keystream. */
export function expandSeed(seed: Uint8Array, width: number): BigUint64Array {
  return readU64s(expandSeedBytes(seed, width), width);
}

/** The same expansion as its 8 width little-endian bytes. */
export function expandSeedBytes(seed: Uint8Array, width: number): Uint8Array {
  return chacha20(seed, SEED_NONCE, new Uint8Array(8 * width));
}

/** The last share: x minus the other shares, mod 2^64. */
export function lastShare(x: ArrayLike<bigint>, others: ArrayLike<bigint>[]): BigUint64Array {
  const out = new BigUint64Array(x.length);
  for (let i = 0; i < x.length; i++) {
    let v = x[i];
    for (const o of others) v -= o[i];
    out[i] = v & MASK64;
  }
  return out;
}
