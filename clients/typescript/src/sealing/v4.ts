/**
 * Sealed layout version 4 (docs/protocol.md section 7a): one HPKE seal per batch and server of a
 * fresh 32-byte secret, then all the records' plaintexts as one ChaCha20-Poly1305 message under a
 * key derived from the secret and the header's transcript (zero nonce: the key is used once),
 * with the transcript and every report id in order as associated data. A party's blocks
 * (docs/sealing.md section 3a) are content 0x03 (a validity study's helper's: 0x04, a seed for
 * the share): the block id in the clear, the pseudonym sealed before the proof and the share, and
 * the party's index bound after the server id. A layout is
 * this one module: another version is another module with the same exports (VERSION, MEDIA_TYPE, seal).
 */
import { chacha20poly1305 } from "@noble/ciphers/chacha.js";
import { hkdf } from "@noble/hashes/hkdf.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, randomBytes, unhex } from "../bytes.js";
import { hpkeSeal, suite, type ServerKey } from "./suites.js";

export const VERSION = 4;
export const MEDIA_TYPE = "application/x-dpsketch-sealed";
/** The content kind of a sealed batch of one party's blocks. */
export const CONTENT_BLOCK = 0x03;
/** A validity study's helper's blocks (docs/sealing.md section 3a): pseudonym, proof, 32-byte seed. */
export const CONTENT_BLOCK_SEED = 0x04;

/** The Content-Type of a party's sealed blocks. */
export function blocksMediaType(party: string): string {
  return `${MEDIA_TYPE}; party=${party}`;
}
const INFO = ascii("dpsketch/sealed/4");
const RECORDS = ascii("dpsketch/sealed/4/records");

export interface SealInput {
  studyId: string;
  serverId: string;
  key: ServerKey;
  content: number;
  /** a block batch (content 0x03 or 0x04): the party's 0-based index, bound in the context */
  party?: number;
  reportIds: Uint8Array[];
  /** proof || payload of every record, in order */
  plaintexts: Uint8Array[];
}

export interface SealSecrets {
  batchId: Uint8Array;
  secret: Uint8Array;
  /** enc || wrapped, given to reproduce a vector; sealed with HPKE otherwise */
  sealedSecret?: Uint8Array;
}

function u16(n: number): Uint8Array {
  return Uint8Array.of(n >> 8, n & 0xff);
}

export function fixedHeader(inp: SealInput, batchId: Uint8Array): Uint8Array {
  const s = suite(inp.key.suite);
  const count = new Uint8Array(4);
  new DataView(count.buffer).setUint32(0, inp.reportIds.length, false);
  return concat(batchId, unhex(inp.key.keyId), Uint8Array.of(0x80, VERSION), u16(s.kemId), u16(s.kdfId), u16(s.aeadId), Uint8Array.of(inp.content), count);
}

export function prefix(studyId: string, serverId: string, party?: number): Uint8Array {
  const id = ascii(serverId);
  const tail = party === undefined ? new Uint8Array(0) : Uint8Array.of(party);
  return concat(unhex(studyId), Uint8Array.of(id.length), id, tail);
}

export function info(inp: SealInput, fixed: Uint8Array): Uint8Array {
  return concat(INFO, sha256(concat(prefix(inp.studyId, inp.serverId, inp.party), fixed)));
}

/** SHA-256(prefix || header): what a batch's records' key and associated data (and a relayed entry's MAC) bind. */
export function transcript(studyId: string, serverId: string, header: Uint8Array, party?: number): Uint8Array {
  return sha256(concat(prefix(studyId, serverId, party), header));
}

/** The whole sealed body for one server. */
export async function seal(inp: SealInput, secrets?: SealSecrets): Promise<Uint8Array> {
  const count = inp.reportIds.length;
  if (count < 1) throw new Error("a sealed batch has at least one record");
  const block = inp.content === CONTENT_BLOCK || inp.content === CONTENT_BLOCK_SEED;
  if (block !== (inp.party !== undefined)) throw new Error("a block batch (content 0x03 or 0x04), and only one, names its party");
  if (inp.party !== undefined && !(Number.isInteger(inp.party) && inp.party >= 0 && inp.party < 256)) throw new Error("a party's index is one byte");
  const batchId = secrets?.batchId ?? randomBytes(16);
  const secret = secrets?.secret ?? randomBytes(32);
  const fixed = fixedHeader(inp, batchId);
  const sealedSecret = secrets?.sealedSecret ?? (await hpkeSeal(inp.key, info(inp, fixed), secret));
  const header = concat(fixed, sealedSecret);
  const bound = transcript(inp.studyId, inp.serverId, header, inp.party);
  const key = hkdf(sha256, secret, undefined, concat(RECORDS, bound), 32);
  const ids = concat(...inp.reportIds);
  const sealed = chacha20poly1305(key, new Uint8Array(12), concat(bound, ids)).encrypt(concat(...inp.plaintexts));
  return concat(header, ids, sealed);
}
