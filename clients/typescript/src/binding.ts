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
  return sha256(concat(COMMIT, Uint8Array.of(position, content), salt, payload)).subarray(0, 16);
}

export function reportId(studyIdHex: string, commitments: Uint8Array[]): Uint8Array {
  return sha256(concat(REPORT, unhex(studyIdHex), ...commitments)).subarray(0, 16);
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

export function bind(studyIdHex: string, contents: number[], salts: Uint8Array[], payloads: Uint8Array[]): BoundReport {
  const commitments = payloads.map((p, j) => commitment(j, contents[j], salts[j], p));
  return { reportId: reportId(studyIdHex, commitments), commitments, proofs: salts.map((s, j) => proof(j, s, commitments)) };
}
