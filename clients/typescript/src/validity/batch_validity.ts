/**
 * Batch proofs of a sketch or l1 study's rows, the client's side (docs/protocol.md section 4d,
 * docs/validity.md section 15; the reference is dpsketch/protocol/batch_validity.py): the batch
 * plan (circuit, grid shift, N) and its 36-byte header, the helpers' seeds and the leader's blind
 * from the keystream, the leader's shares, every server's part, the wrap seed, the projections and
 * their digits, the digits part, the batch id, the proof, and the rows' ids.
 */
import { sha256 } from "../primitives.js";
import { ascii, concat, u64sToBytes } from "../bytes.js";
import type { Keystream } from "../keystream.js";
import { gridShift, width, type Study } from "../study.js";
import { BatchNorm } from "./batch_circuit.js";
import { type Fp } from "./field.js";
import { expandVec, fromInts, sampleVec, subVec, addVec, vec, vecBytes, type FpVec } from "./fieldvec.js";
import { jointRand, proveVec } from "./flp.js";
import { validityPlan } from "./study.js";
import { project, REPETITIONS } from "./wraparound.js";

export const PART_DOMAIN = ascii("dpsketch/batch-part/1");
export const WRAPDOMAIN = ascii("dpsketch/wrap-seed/1");
export const BATCH_ID_DOMAIN = ascii("dpsketch/batch-id/1");
export const ROW_DOMAIN = ascii("dpsketch/batch-row/1");
export const BATCH_SHARE_NONCE = sha256(ascii("dpsketch/batch-share/1")).subarray(0, 12);
export const SEED_BYTES = 32;
export const BLIND_BYTES = 32;

export interface BatchPlan {
  circuit: BatchNorm;
  shift: number;
  nServers: number;
  /** m u32 | w u32 | R^2 u64 | r u32 | T u64 | N u32 | shift u32: what the parts and the wrap seed hash */
  header: Uint8Array;
}

const planCache = new Map<string, BatchPlan>();

export function batchPlan(m: number, w: number, r2: bigint, shift: number, nServers: number, reps = REPETITIONS): BatchPlan {
  if (nServers < 2) throw new Error("need at least two servers");
  const key = `${m}/${w}/${r2}/${shift}/${nServers}/${reps}`;
  const hit = planCache.get(key);
  if (hit) return hit;
  const c = new BatchNorm(m, w, r2, reps);
  const header = new Uint8Array(36);
  const dv = new DataView(header.buffer);
  dv.setUint32(0, c.m, true);
  dv.setUint32(4, c.w, true);
  dv.setBigUint64(8, c.r2, true);
  dv.setUint32(16, c.reps, true);
  dv.setBigUint64(20, c.threshold, true);
  dv.setUint32(28, nServers, true);
  dv.setUint32(32, shift, true);
  const plan = { circuit: c, shift, nServers, header };
  if (planCache.size >= 4) planCache.delete(planCache.keys().next().value!);
  planCache.set(key, plan);
  return plan;
}

/** A sketch or l1 validity study's plan for batches of m rows: its width, R^2 in grid units and grid shift. */
export function studyBatchPlan(study: Study, m: number): BatchPlan {
  if (!study.batch_proofs) throw new Error("this study does not take batch proofs (its batch_proofs is false)");
  if ((study.kind !== "sketch" && study.kind !== "l1") || study.parties) throw new Error("batch proofs exist for sketch and l1 studies without parties");
  const p = validityPlan(study);
  return batchPlan(m, width(study), p.r2, gridShift(study), study.servers.length);
}

export interface ProvedBatch {
  leader: number;
  /** the rows' prefix (x, roots) as integers (doubles: exact) */
  prefix: Float64Array;
  /** the leader's input and proof shares (fieldvec.ts vectors) */
  leaderInputs: FpVec;
  leaderProof: FpVec;
  seeds: (Uint8Array | null)[];
  parts: Uint8Array[];
  digitsPart: Uint8Array;
  blind: Uint8Array;
  wrapSeed: Uint8Array;
  projections: bigint[];
  batchId: Uint8Array;
  proof: FpVec;
}

const part = (kind: string, position: number, data: Uint8Array): Uint8Array =>
  sha256(concat(PART_DOMAIN, ascii(kind), Uint8Array.of(position), data));

export const seedPart = (position: number, seed: Uint8Array): Uint8Array => part("seed", position, seed);

/** The leader's part: its share of v = (x, roots), blinded. */
export const sharePart = (plan: BatchPlan, position: number, leaderInputs: Fp[] | FpVec, blind: Uint8Array): Uint8Array =>
  part("share", position, concat(blind, plan.header, elementBytes(leaderInputs, 0, plan.circuit.vLen)));

/** Elements [from, to) of a list or vector as u64 LE bytes. */
const elementBytes = (v: Fp[] | FpVec, from: number, to?: number): Uint8Array =>
  Array.isArray(v) ? u64sToBytes(v.slice(from, to)) : vecBytes(v.subarray(2 * from, to === undefined ? undefined : 2 * to));

/** The leader's digits part: its share of the wrap digits, blinded. */
export const digitsPart = (plan: BatchPlan, position: number, leaderInputs: Fp[] | FpVec, blind: Uint8Array): Uint8Array =>
  part("digits", position, concat(blind, elementBytes(leaderInputs, plan.circuit.vLen)));

export const wrapSeed = (header36: Uint8Array, parts: Uint8Array[]): Uint8Array => sha256(concat(WRAPDOMAIN, header36, ...parts));

export const batchId = (seed: Uint8Array, digits: Uint8Array): Uint8Array => sha256(concat(BATCH_ID_DOMAIN, seed, digits)).subarray(0, 16);

const dv0 = (b: Uint8Array) => new DataView(b.buffer, b.byteOffset, b.byteLength);

/** Row i's id: SHA-256("dpsketch/batch-row/1" || batch id || u32le(i))[0:16]. */
export function rowIds(bid: Uint8Array, m: number): Uint8Array[] {
  if (bid.length !== 16) throw new Error("a batch id is 16 bytes");
  const out: Uint8Array[] = [];
  // the 40-byte message is one padded SHA-256 block: only its word 9 (i) changes from row to row
  const block = new Uint8Array(64);
  block.set(ROW_DOMAIN);
  block.set(bid, ROW_DOMAIN.length);
  block[ROW_DOMAIN.length + 20] = 0x80;
  dv0(block).setUint16(62, 8 * (ROW_DOMAIN.length + 20), false);
  const dv = new DataView(block.buffer);
  const words = new Uint32Array(16);
  for (let t = 0; t < 16; t++) words[t] = dv.getUint32(4 * t, false);
  const state = new Uint32Array(8);
  for (let i = 0; i < m; i++) {
    // u32le(i) as the big-endian word SHA-256 reads
    words[9] = ((i & 255) << 24 | ((i >>> 8) & 255) << 16 | ((i >>> 16) & 255) << 8 | (i >>> 24)) >>> 0;
    sha256Block(words, state);
    const id = new Uint8Array(16);
    const iv = new DataView(id.buffer);
    for (let t = 0; t < 4; t++) iv.setUint32(4 * t, state[t], false);
    out.push(id);
  }
  return out;
}

const K = Uint32Array.from([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
  0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
  0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
  0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2]);
const H0 = Uint32Array.from([0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19]);
const W = new Uint32Array(64);

/** SHA-256 of a message that is the one padded block `words` (big-endian): the digest's words into out. */
function sha256Block(words: Uint32Array, out: Uint32Array): void {
  for (let t = 0; t < 16; t++) W[t] = words[t];
  for (let t = 16; t < 64; t++) {
    const a = W[t - 15], b = W[t - 2];
    const s0 = ((a >>> 7) | (a << 25)) ^ ((a >>> 18) | (a << 14)) ^ (a >>> 3);
    const s1 = ((b >>> 17) | (b << 15)) ^ ((b >>> 19) | (b << 13)) ^ (b >>> 10);
    W[t] = (W[t - 16] + s0 + W[t - 7] + s1) | 0;
  }
  let a = H0[0], b = H0[1], c = H0[2], d = H0[3], e = H0[4], f = H0[5], g = H0[6], h = H0[7];
  for (let t = 0; t < 64; t++) {
    const S1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
    const t1 = (h + S1 + ((e & f) ^ (~e & g)) + K[t] + W[t]) | 0;
    const S0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
    const t2 = (S0 + ((a & b) ^ (a & c) ^ (b & c))) | 0;
    h = g;
    g = f;
    f = e;
    e = (d + t1) | 0;
    d = c;
    c = b;
    b = a;
    a = (t1 + t2) | 0;
  }
  out[0] = H0[0] + a;
  out[1] = H0[1] + b;
  out[2] = H0[2] + c;
  out[3] = H0[3] + d;
  out[4] = H0[4] + e;
  out[5] = H0[5] + f;
  out[6] = H0[6] + g;
  out[7] = H0[7] + h;
}

/** A helper's input share then proof share of the whole batch, from its seed. */
export const helperShares = (plan: BatchPlan, seed: Uint8Array): FpVec =>
  expandVec(seed, plan.circuit.inputLen + plan.circuit.proofLen, BATCH_SHARE_NONCE);

/**
 * A batch of m rows in grid units, proved (throws for a row outside the bound or a projection
 * outside its range: redraw the noise). Keystream draws: each helper's 32-byte seed (position
 * order), the leader's 32-byte blind, then the prove randomness.
 */
export function proveBatchRows(plan: BatchPlan, units: bigint[][], ks: Keystream, leader: number): ProvedBatch {
  const c = plan.circuit;
  const N = plan.nServers;
  if (!(Number.isInteger(leader) && leader >= 0 && leader < N)) throw new Error("the leader is a server position");
  let prefix: Float64Array;
  try {
    prefix = c.prefixNumbers(units);
  } catch (e) {
    throw new Error(`${(e as Error).message}: redraw its noise`);
  }
  const seeds: (Uint8Array | null)[] = [];
  for (let j = 0; j < N; j++) seeds.push(j === leader ? null : ks.bytes(SEED_BYTES).slice());
  const blind = ks.bytes(BLIND_BYTES).slice();
  const total = c.inputLen + c.proofLen;
  const helpers = vec(total);
  for (const s of seeds) if (s !== null) addVec(helpers, helpers, helperShares(plan, s));
  const inputs = vec(c.inputLen);
  inputs.set(fromInts(prefix));
  const leaderInputs = subVec(vec(c.inputLen), inputs, helpers.subarray(0, 2 * c.inputLen));
  const parts = seeds.map((s, j) => (s === null ? sharePart(plan, j, leaderInputs, blind) : seedPart(j, s)));
  const seed = wrapSeed(plan.header, parts);
  const projections = project(prefix, seed, c.reps);
  let digits: Fp[];
  try {
    digits = c.wrapInput(projections);
  } catch (e) {
    throw new Error(`${(e as Error).message}: redraw the batch's noise`);
  }
  const at = 2 * c.vLen;
  inputs.set(fromInts(digits.map(Number)), at);
  subVec(leaderInputs.subarray(at), inputs.subarray(at), helpers.subarray(at, 2 * c.inputLen));
  const dPart = digitsPart(plan, leader, leaderInputs, blind);
  const bid = batchId(seed, dPart);
  const proof = proveVec(c, inputs, jointRand(c, bid), sampleVec(ks, c.proveRandLen));
  const leaderProof = subVec(vec(c.proofLen), proof, helpers.subarray(2 * c.inputLen));
  return { leader, prefix, leaderInputs, leaderProof, seeds, parts, digitsPart: dPart, blind, wrapSeed: seed, projections, batchId: bid, proof };
}

