/**
 * Studies with parties (docs/protocol.md section 2d): a party's blocks. Pseudonyms from the
 * parties' shared key, each block clipped to the party's B'_j, noised, fully shared (draw order
 * steps 2 to 4), bound under a block id that commits to the party and the pseudonym, and the
 * `application/x-dpsketch-blocks; party=NAME` body of section 7.
 */
import { hmac } from "@noble/hashes/hmac.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, u32be, unhex } from "./bytes.js";
import { commitment, CONTENT_SHARE, proof } from "./binding.js";
import { encodeNoisy, shareAndSalt } from "./batch.js";
import { clip } from "./features.js";
import { Keystream } from "./keystream.js";
import { partyClipBounds, type Study } from "./study.js";

const INDIVIDUAL = ascii("dpsketch/individual/1");
const BLOCK = ascii("dpsketch/block/2");

/** An individual's pseudonym in this study: HMAC-SHA256(party key, ...)[0:16]. */
export function pseudonym(partyKey: Uint8Array, studyIdHex: string, individual: string | Uint8Array): Uint8Array {
  const x = typeof individual === "string" ? new TextEncoder().encode(individual) : individual;
  return hmac(sha256, partyKey, concat(INDIVIDUAL, unhex(studyIdHex), u32be(x.length), x)).subarray(0, 16);
}

export function blockMediaType(party: string): string {
  return `application/x-dpsketch-blocks; party=${party}`;
}

export interface PreparedBlocks {
  party: string;
  blockIds: Uint8Array[];
  pseudonyms: Uint8Array[];
  /** per server: the binding proofs and share bytes of every block */
  servers: { proofs: Uint8Array[]; payloads: Uint8Array[] }[];
  noisy: BigUint64Array;
}

export function prepareBlocks(study: Study, studyIdHex: string, party: string, pseudonyms: Uint8Array[], rows: number[][], key: Uint8Array): PreparedBlocks {
  const index = (study.parties ?? []).findIndex((p) => p.name === party);
  if (index < 0) throw new Error(`the study has no party ${party}`);
  // its blocks must each carry a proof with the party's bound (docs/protocol.md sections 2d and 4c,
  // docs/validity.md section 13); unproved blocks would be refused by every server
  if (study.validity !== undefined)
    throw new Error(`the study proves every block valid (${study.validity}): this client does not prove a party's blocks yet; submit them with the Python SDK (Client.submit_blocks)`);
  const d = study.parties![index].columns.length;
  if (pseudonyms.length !== rows.length) throw new Error(`${pseudonyms.length} pseudonyms for ${rows.length} rows`);
  const bound = partyClipBounds(study)![index].clip_bound;
  const vectors = rows.map((r) => {
    if (r.length !== d || !r.every((v) => typeof v === "number" && Number.isFinite(v))) throw new Error(`a block has ${d} finite numbers`);
    return clip(r, bound);
  });
  const ks = new Keystream(key);
  const N = study.servers.length;
  const m = rows.length;
  const { noisy, halves } = encodeNoisy(study, vectors, null, ks, d);
  const servers = shareAndSalt(halves, m, d, N, ks, null);
  const sid = unhex(studyIdHex);
  const blockIds: Uint8Array[] = [];
  const out = servers.map(() => ({ proofs: [] as Uint8Array[], payloads: [] as Uint8Array[] }));
  for (let i = 0; i < m; i++) {
    const cs = servers.map((s, j) => commitment(j, CONTENT_SHARE, s.salts[i], s.payloads[i]));
    const h = sha256.create().update(BLOCK).update(sid).update(Uint8Array.of(index)).update(pseudonyms[i]);
    for (const c of cs) h.update(c);
    blockIds.push(h.digest().subarray(0, 16));
    servers.forEach((s, j) => {
      out[j].proofs.push(proof(j, s.salts[i], cs));
      out[j].payloads.push(s.payloads[i]);
    });
  }
  return { party, blockIds, pseudonyms, servers: out, noisy };
}

/** Server j's body: block id, pseudonym, proof, shares per record. */
export function blocksBody(p: PreparedBlocks, j: number): Uint8Array {
  const parts: Uint8Array[] = [];
  p.blockIds.forEach((id, i) => parts.push(id, p.pseudonyms[i], p.servers[j].proofs[i], p.servers[j].payloads[i]));
  return concat(...parts);
}
