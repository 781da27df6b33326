/**
 * The wire records of batch proofs (docs/protocol.md section 4d; the reference is
 * dpsketch/protocol/batch_records.py), what a client sends: one record a server, the leader's
 * with its blind and its input and proof shares, every helper's with its seed.
 *
 *     header  m u32 | w u32 | R^2 u64 | r u32 | T u64 | N u32 | shift u32 | leader u32   (40 bytes)
 *     parts   part_0 .. part_(N-1) | digits part                                   (32 (N + 1) bytes)
 *     leader  its 32-byte blind, then input share (n) then proof share (P), 8 bytes each, each < p
 *     helper  its 32-byte seed
 */
import { concat } from "../bytes.js";
import { vecBytes } from "./fieldvec.js";
import { BLIND_BYTES, SEED_BYTES, type BatchPlan, type ProvedBatch } from "./batch_validity.js";

export const LEADER_MEDIA_TYPE = "application/x-dpsketch-proof-batch";
export const HELPER_MEDIA_TYPE = "application/x-dpsketch-proof-batch-seed";
/** sealed content kinds (docs/sealing.md section 3b) */
export const SEALED_LEADER_CONTENT = 0x05;
export const SEALED_HELPER_CONTENT = 0x06;
export const HEADER_BYTES = 40;
export const PART_BYTES = 32;
export const ELEMENT_BYTES = 8;
/** the most rows one batch record may hold (servers: min(max_reports, 2^17)) */
export const MAX_BATCH_ROWS = 1 << 17;

/** The record header: the plan's 36 bytes and the leader's position (u32 LE). */
export function headerBytes(plan: BatchPlan, leader: number): Uint8Array {
  const out = new Uint8Array(HEADER_BYTES);
  out.set(plan.header);
  new DataView(out.buffer).setUint32(36, leader, true);
  return out;
}

export interface BatchRecord {
  position: number;
  mediaType: string;
  body: Uint8Array;
}

/** Every server's record of a proved batch, in position order. */
export function records(plan: BatchPlan, proved: ProvedBatch): BatchRecord[] {
  const head = concat(headerBytes(plan, proved.leader), ...proved.parts, proved.digitsPart);
  return proved.seeds.map((seed, position) =>
    seed === null
      ? { position, mediaType: LEADER_MEDIA_TYPE, body: concat(head, proved.blind, vecBytes(proved.leaderInputs), vecBytes(proved.leaderProof)) }
      : { position, mediaType: HELPER_MEDIA_TYPE, body: concat(head, seed) });
}

export function leaderLength(plan: BatchPlan): number {
  const c = plan.circuit;
  return HEADER_BYTES + PART_BYTES * (plan.nServers + 1) + BLIND_BYTES + ELEMENT_BYTES * (c.inputLen + c.proofLen);
}

export function helperLength(nServers: number): number {
  return HEADER_BYTES + PART_BYTES * (nServers + 1) + SEED_BYTES;
}

/** The sealed content kind of a record's media type: 0x05 the leader's, 0x06 a helper's. */
export const sealedContent = (mediaType: string): number => (mediaType === LEADER_MEDIA_TYPE ? SEALED_LEADER_CONTENT : SEALED_HELPER_CONTENT);
