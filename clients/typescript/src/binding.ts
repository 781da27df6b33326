/**
 * Report binding (docs/protocol.md section 4a): each server's payload is committed under a salt,
 * and the report id commits to all N commitments, so a server stores under an id only what the
 * client sent it.
 */
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, unhex } from "./bytes.js";

const COMMIT = ascii("dpsketch/commit/2");
const REPORT = ascii("dpsketch/report/2");

export const CONTENT_SHARE = 1;
export const CONTENT_SEED = 2;

export function commitment(position: number, content: number, salt: Uint8Array, payload: Uint8Array): Uint8Array {
  return sha256.create().update(COMMIT).update(Uint8Array.of(position, content)).update(salt).update(payload).digest().subarray(0, 16);
}

/** The report id; the study id as hex or as its 32 bytes. */
export function reportId(studyId: string | Uint8Array, commitments: Uint8Array[]): Uint8Array {
  const h = sha256.create().update(REPORT).update(typeof studyId === "string" ? unhex(studyId) : studyId);
  for (const c of commitments) h.update(c);
  return h.digest().subarray(0, 16);
}

/** Server j's proof: its salt, then every commitment but its own. */
export function proof(position: number, salt: Uint8Array, commitments: Uint8Array[]): Uint8Array {
  return concat(salt, ...commitments.filter((_, i) => i !== position));
}

export interface BoundReport {
  reportId: Uint8Array;
  commitments: Uint8Array[];
  proofs: Uint8Array[];
}

export function bind(studyIdHex: string | Uint8Array, contents: number[], salts: Uint8Array[], payloads: Uint8Array[]): BoundReport {
  const commitments = payloads.map((p, j) => commitment(j, contents[j], salts[j], p));
  return { reportId: reportId(studyIdHex, commitments), commitments, proofs: salts.map((s, j) => proof(j, s, commitments)) };
}
