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
  /** the rows' prefix (x, roots) as integers */
  prefix: bigint[];
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

/** Row i's id: SHA-256("dpsketch/batch-row/1" || batch id || u32le(i))[0:16]. */
export function rowIds(bid: Uint8Array, m: number): Uint8Array[] {
  if (bid.length !== 16) throw new Error("a batch id is 16 bytes");
  const out: Uint8Array[] = [];
  const buf = new Uint8Array(ROW_DOMAIN.length + 20);
  buf.set(ROW_DOMAIN);
  buf.set(bid, ROW_DOMAIN.length);
  const dv = new DataView(buf.buffer);
  for (let i = 0; i < m; i++) {
    dv.setUint32(ROW_DOMAIN.length + 16, i, true);
    out.push(sha256(buf).slice(0, 16));
  }
  return out;
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
  let prefix: bigint[];
  try {
    prefix = c.prefix(units);
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
  const prefixInts = prefix.map(Number);
  inputs.set(fromInts(prefixInts));
  const leaderInputs = subVec(vec(c.inputLen), inputs, helpers.subarray(0, 2 * c.inputLen));
  const parts = seeds.map((s, j) => (s === null ? sharePart(plan, j, leaderInputs, blind) : seedPart(j, s)));
  const seed = wrapSeed(plan.header, parts);
  const projections = project(prefixInts, seed, c.reps);
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

