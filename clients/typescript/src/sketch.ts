/**
 * The sketch hashes (docs/protocol.md sections 3 and 2c). A client does not need them to
 * submit (servers sketch); they are here so that the package can check the conformance vectors
 * and let a data owner see where its report lands.
 */
import { blake2b } from "@noble/hashes/blake2.js";
import { ascii, concat, readU64s, unhex } from "./bytes.js";

const OSNAP = ascii("dpsketch/osnap/1");
const L1 = ascii("dpsketch/l1/1");

export function osnap(seedHex: string, k: number, s: number, reportId: Uint8Array): { digest: Uint8Array; buckets: number[]; signs: number[]; rows: number[] } {
  const digest = blake2b(concat(OSNAP, reportId), { key: unhex(seedHex), dkLen: 8 * s });
  const u = readU64s(digest, s);
  const b = BigInt(k / s);
  const buckets = Array.from(u, (x) => Number((x * b) >> 64n));
  const signs = Array.from(u, (x) => (k === 1 ? 1 : x % 2n === 0n ? 1 : -1));
  return { digest, buckets, signs, rows: buckets.map((h, l) => l * (k / s) + h) };
}

export interface L1Shape {
  s: number;
  level0_buckets: number;
  levels: number;
  buckets: number;
  branching: number;
}

export function l1Rows(seedHex: string, shape: L1Shape, reportId: Uint8Array): number[] {
  const { s, level0_buckets: b0, levels, buckets, branching } = shape;
  const digest = blake2b(concat(L1, reportId), { key: unhex(seedHex), dkLen: 8 * (s + 2) });
  const u = readU64s(digest, s + 2);
  const rows: number[] = [];
  for (let l = 0; l < s; l++) rows.push(l * b0 + Number((u[l] * BigInt(b0)) >> 64n));
  let h = 0;
  const two64 = 1n << 64n;
  let pow = 1n;
  for (let j = 1; j <= levels + 1; j++) {
    pow *= BigInt(branching);
    const c = (two64 + pow - 1n) / pow;
    if (u[s] < c) h++;
  }
  if (h >= 1 && h <= levels) rows.push(s * b0 + (h - 1) * buckets + Number((u[s + 1] * BigInt(buckets)) >> 64n));
  return rows;
}
