/**
 * Studies with parties (docs/protocol.md section 2d): a party's blocks. Pseudonyms and, in a
 * signed study, signs from the parties' shared key; each block clipped to the party's B'_j,
 * signed, noised, then either fully shared and bound under a block id that commits to the party
 * and the pseudonym (the `application/x-dpsketch-blocks; party=NAME` body of section 7), or, in a
 * study with validity, proved with the party's own plan (section 4b's last bullet, validity.ts
 * partyPlan) and shared as a validity report is: the leader's input and proof shares, a seed at
 * every helper (`application/x-dpsketch-block-seeds; party=NAME`, section 4c).
 */
import { hmac } from "@noble/hashes/hmac.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, u32be, unhex } from "./bytes.js";
import { bind, blockPrefixes, CONTENT_SEED, CONTENT_SHARE } from "./binding.js";
import { encodeNoisy, shareAndSalt } from "./batch.js";
import { clip } from "./features.js";
import { Keystream } from "./keystream.js";
import { partyClipBounds, type Study } from "./study.js";
import { partyPlan, proveBatch } from "./validity/study.js";

const INDIVIDUAL = ascii("dpsketch/individual/1");
const SIGN = ascii("dpsketch/sign/1");

/** An individual's pseudonym in this study: HMAC-SHA256(party key, ...)[0:16]. */
export function pseudonym(partyKey: Uint8Array, studyIdHex: string, individual: string | Uint8Array): Uint8Array {
  const x = typeof individual === "string" ? new TextEncoder().encode(individual) : individual;
  return hmac(sha256, partyKey, concat(INDIVIDUAL, unhex(studyIdHex), u32be(x.length), x)).subarray(0, 16);
}

/**
 * The party-key sign of each individual in a signed study with parties (section 2d,
 * parties.signs): -1 where the low bit of the first byte of HMAC-SHA256(party key,
 * "dpsketch/sign/1" || study id || pseudonym) is set, else 1. Every party derives the same.
 */
export function partySigns(partyKey: Uint8Array, studyIdHex: string, pseudonyms: Uint8Array[]): number[] {
  const sid = unhex(studyIdHex);
  return pseudonyms.map((p) => {
    if (p.length !== 16) throw new Error("a pseudonym is 16 bytes");
    return hmac(sha256, partyKey, concat(SIGN, sid, p))[0] & 1 ? -1 : 1;
  });
}

/** A block batch's media type: shares, or (a validity study's helper) seeds. */
export function blockMediaType(party: string, seeds = false): string {
  return `application/x-dpsketch-${seeds ? "block-seeds" : "blocks"}; party=${party}`;
}

export interface PreparedBlocks {
  party: string;
  /** the party's 0-based index */
  index: number;
  blockIds: Uint8Array[];
  pseudonyms: Uint8Array[];
  /**
   * per server: content kind (1 share, 2 seed), the binding proofs and payloads of every block
   * (a share: 8 d_j bytes, or in a validity study the leader's 8 (n_j + P_j); a seed: 32 bytes)
   */
  servers: { content: number; proofs: Uint8Array[]; payloads: Uint8Array[] }[];
  noisy: BigUint64Array;
}

export interface BlockOptions {
  /** a signed study: each individual's party-key sign (partySigns), -1 or 1 */
  signs?: number[] | null;
  /** a validity study: the leader's position (default the last server) */
  full?: number;
}

/**
 * One party's blocks of m individuals from the batch's keystream key (draw order of section 5a
 * without the sign draw: noise, then full shares and salts; or, with validity, the helpers'
 * seeds, the salts and the prove randomness, as a report's, section 4b).
 */
export function prepareBlocks(study: Study, studyIdHex: string, party: string, pseudonyms: Uint8Array[], rows: number[][], key: Uint8Array, opts: BlockOptions = {}): PreparedBlocks {
  const index = (study.parties ?? []).findIndex((p) => p.name === party);
  if (index < 0) throw new Error(`the study has no party ${party}`);
  const d = study.parties![index].columns.length;
  if (pseudonyms.length !== rows.length) throw new Error(`${pseudonyms.length} pseudonyms for ${rows.length} rows`);
  const signs = opts.signs ?? null;
  if (study.secret_sign && (signs === null || signs.length !== rows.length || signs.some((s) => s !== 1 && s !== -1)))
    throw new Error("a signed study with parties needs each individual's party-key sign (partySigns)");
  if (!study.secret_sign && signs !== null) throw new Error("signs are for a signed study with parties only");
  const bound = partyClipBounds(study)![index].clip_bound;
  const vectors = rows.map((r) => {
    if (r.length !== d || !r.every((v) => typeof v === "number" && Number.isFinite(v))) throw new Error(`a block has ${d} finite numbers`);
    return clip(r, bound);
  });
  const ks = new Keystream(key);
  const N = study.servers.length;
  const m = rows.length;
  const { noisy, halves } = encodeNoisy(study, vectors, signs, ks, d);
  const prefixes = blockPrefixes(studyIdHex, index, pseudonyms);
  if (study.validity !== undefined) {
    // proved with the party's bound, shared as a validity report (docs/validity.md section 13)
    const b = proveBatch(study, studyIdHex, partyPlan(study, index), noisy, ks, opts.full ?? N - 1, null, null, prefixes);
    return { party, index, blockIds: b.reportIds, pseudonyms, servers: b.servers, noisy };
  }
  const servers = shareAndSalt(halves, m, d, N, ks, null);
  const blockIds: Uint8Array[] = [];
  const out = servers.map(() => ({ content: CONTENT_SHARE, proofs: [] as Uint8Array[], payloads: [] as Uint8Array[] }));
  for (let i = 0; i < m; i++) {
    const bound = bind(studyIdHex, out.map((s) => s.content), servers.map((s) => s.salts[i]), servers.map((s) => s.payloads[i]), prefixes[i]);
    blockIds.push(bound.reportId);
    servers.forEach((s, j) => {
      out[j].proofs.push(bound.proofs[j]);
      out[j].payloads.push(s.payloads[i]);
    });
  }
  return { party, index, blockIds, pseudonyms, servers: out, noisy };
}

/** Server j's media type: its party's block shares, or block seeds at a validity study's helper. */
export function blocksMediaType(p: PreparedBlocks, j: number): string {
  return blockMediaType(p.party, p.servers[j].content === CONTENT_SEED);
}

/** Server j's body: block id, pseudonym, proof, share (or seed) per record. */
export function blocksBody(p: PreparedBlocks, j: number): Uint8Array {
  const parts: Uint8Array[] = [];
  p.blockIds.forEach((id, i) => parts.push(id, p.pseudonyms[i], p.servers[j].proofs[i], p.servers[j].payloads[i]));
  return concat(...parts);
}
