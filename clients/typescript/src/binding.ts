/**
 * Report binding (docs/protocol.md section 4a): each server's payload is committed under a salt,
 * and the report id commits to all N commitments, so a server stores under an id only what the
 * client sent it.
 */
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, unhex } from "./bytes.js";

const COMMIT = ascii("dpsketch/commit/2");
const REPORT = ascii("dpsketch/report/2");
/** A party's block (section 2d): its id also commits to the party and the individual's pseudonym. */
const BLOCK = ascii("dpsketch/block/2");

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

/**
 * What a block's id hashes before the commitments (section 2d): the block domain, the study id,
 * the party's 0-based index (one byte) and the individual's 16-byte pseudonym.
 */
export function blockPrefixes(studyId: string | Uint8Array, party: number, pseudonyms: Uint8Array[]): Uint8Array[] {
  const sid = typeof studyId === "string" ? unhex(studyId) : studyId;
  if (sid.length !== 32 || !(Number.isInteger(party) && party >= 0 && party < 256)) throw new Error("a study id is 32 bytes and a party index 0..255");
  return pseudonyms.map((p) => {
    if (p.length !== 16) throw new Error("a pseudonym is 16 bytes");
    return concat(BLOCK, sid, Uint8Array.of(party), p);
  });
}

/** A block's id: SHA-256 of its prefix (blockPrefixes) and the commitments, truncated to 16 bytes. */
export function blockId(prefix: Uint8Array, commitments: Uint8Array[]): Uint8Array {
  const h = sha256.create().update(prefix);
  for (const c of commitments) h.update(c);
  return h.digest().subarray(0, 16);
}

/** One report's binding; with `prefix` (blockPrefixes) a block's, under its block id. */
export function bind(studyIdHex: string | Uint8Array, contents: number[], salts: Uint8Array[], payloads: Uint8Array[], prefix?: Uint8Array): BoundReport {
  const commitments = payloads.map((p, j) => commitment(j, contents[j], salts[j], p));
  const id = prefix === undefined ? reportId(studyIdHex, commitments) : blockId(prefix, commitments);
  return { reportId: id, commitments, proofs: salts.map((s, j) => proof(j, s, commitments)) };
}
