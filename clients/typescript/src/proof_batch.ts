/**
 * A study with batch proofs (docs/protocol.md section 4d): the path for m rows, mirroring the
 * reference's report.prepare_proof_batch (one keystream: secret signs, noise, then the helpers'
 * seeds, the leader's blind and the prove randomness), and the SDK's default batch size
 * (client_sdk.upload.proof_batch_rows: the leader's record within 8 MiB).
 */
import type { RawValue } from "./features.js";
import { Keystream } from "./keystream.js";
import { noisyRows } from "./batch.js";
import type { Study } from "./study.js";
import { greedySteps, EXACT } from "./validity/batch_circuit.js";
import { ELEMENT_BYTES, leaderLength, MAX_BATCH_ROWS, records, type BatchRecord } from "./validity/batch_records.js";
import { proveBatchRows, rowIds, studyBatchPlan } from "./validity/batch_validity.js";
import { validityPlan } from "./validity/study.js";
import { width } from "./study.js";

/** the leader's record of a default batch stays within this (the SDK's DEFAULT_BATCH_BYTES) */
export const DEFAULT_BATCH_BYTES = 8 << 20;
/** and holds at most this many rows (the SDK's MAX_DEFAULT_BATCH_ROWS) */
export const MAX_DEFAULT_BATCH_ROWS = 100_000;
/** a request body this client never exceeds (the SDK's MAX_BATCH_BYTES) */
export const MAX_BATCH_BYTES = 16 << 20;

export interface ProofBatch {
  /** every server's record, in position order */
  records: BatchRecord[];
  leader: number;
  batchId: Uint8Array;
  rowIds: Uint8Array[];
  noisy: BigUint64Array;
  clamped: number[];
}

/** The most rows one batch record of this study may hold: min(max_reports, 2^17). */
export const maxRows = (study: Study): number => Math.min(study.max_reports, MAX_BATCH_ROWS);

/**
 * m rows (1 <= m <= maxRows) of a study with batch proofs, proved with the leader at `leader`,
 * every random bit from the keystream of `key` (so the same key gives the same records: a batch
 * sent again is the same batch). Throws for a row or projection outside its bound
 * (probability <= 2^-96).
 */
export function prepareProofBatch(study: Study, rows: RawValue[][], key: Uint8Array, leader: number): ProofBatch {
  if (!study.batch_proofs) throw new Error("this study does not take batch proofs (its batch_proofs is false)");
  const m = rows.length;
  if (!(m >= 1 && m <= maxRows(study))) throw new Error(`a batch holds 1 to ${maxRows(study)} rows; got ${m}`);
  const ks = new Keystream(key);
  const noisy = noisyRows(study, rows, ks);
  const plan = studyBatchPlan(study, m);
  const proved = proveBatchRows(plan, noisy.units(plan.shift), ks, leader);
  return { records: records(plan, proved), leader, batchId: proved.batchId, rowIds: rowIds(proved.batchId, m), noisy: noisy.noisy, clamped: noisy.clamped };
}

/**
 * Rows per proved batch (client_sdk.upload.proof_batch_rows): `batchSize` if given, else about
 * as many rows as keep the leader's record within DEFAULT_BATCH_BYTES (at most
 * MAX_DEFAULT_BATCH_ROWS); never a leader's record over `maxBatchBytes`, never more than
 * maxRows(study), at least one.
 */
export function proofBatchRows(study: Study, batchSize?: number, maxBatchBytes = MAX_BATCH_BYTES): number {
  if (batchSize !== undefined && !(batchSize >= 1)) throw new Error("batchSize must be at least 1");
  const limit = batchSize !== undefined ? maxBatchBytes : Math.min(DEFAULT_BATCH_BYTES, maxBatchBytes);
  const r2 = validityPlan(study).r2;
  const perRow = ELEMENT_BYTES * (width(study) + greedySteps(r2) + EXACT);
  let m = Math.min(maxRows(study), batchSize === undefined ? MAX_DEFAULT_BATCH_ROWS : batchSize, Math.max(1, Math.floor(limit / perRow)));
  while (m > 1) {
    const excess = leaderLength(studyBatchPlan(study, m)) - limit;
    if (excess <= 0) break;
    m = Math.max(1, m - Math.ceil(excess / perRow));
  }
  return m;
}
