/**
 * The two HPKE suites of docs/protocol.md section 7a and docs/sealing.md section 2, by the
 * registry's libraries: DHKEM(X25519, HKDF-SHA256) and X-Wing (MLKEM768-X25519, 0x647a,
 * draft-connolly-cfrg-xwing-kem-06: public key pk_M || pk_X, enc ct_M || ct_X, the label last in
 * the SHA3-256 combiner, which is what @hpke/hybridkem-x-wing implements), each with
 * HKDF-SHA256 and ChaCha20-Poly1305, base mode, single shot.
 */
import { CipherSuite } from "@hpke/core";
import { Chacha20Poly1305 } from "@hpke/chacha20poly1305";
import { DhkemX25519HkdfSha256, HkdfSha256 } from "@hpke/dhkem-x25519";
import { XWing } from "@hpke/hybridkem-x-wing";
import { sha256 } from "@noble/hashes/sha2.js";
import { hex, unhex } from "../bytes.js";

export type SuiteName = "classical" | "post-quantum";

export interface Suite {
  name: SuiteName;
  kemId: number;
  kdfId: number;
  aeadId: number;
  publicKeyBytes: number;
  encBytes: number;
  hpke: CipherSuite;
}

let cache: Partial<Record<SuiteName, Suite>> = {};

export function suite(name: SuiteName): Suite {
  const hit = cache[name];
  if (hit) return hit;
  const pq = name === "post-quantum";
  const s: Suite = {
    name,
    kemId: pq ? 0x647a : 0x0020,
    kdfId: 0x0001,
    aeadId: 0x0003,
    publicKeyBytes: pq ? 1216 : 32,
    encBytes: pq ? 1120 : 32,
    hpke: new CipherSuite({ kem: pq ? new XWing() : new DhkemX25519HkdfSha256(), kdf: new HkdfSha256(), aead: new Chacha20Poly1305() }),
  };
  cache = { ...cache, [name]: s };
  return s;
}

/** key_id = hex of the first 8 bytes of SHA-256(raw public key). */
export function keyId(publicKey: Uint8Array): string {
  return hex(sha256(publicKey).subarray(0, 8));
}

export interface ServerKey {
  suite: SuiteName;
  keyId: string;
  publicKey: Uint8Array;
}

/** One HpkeKeys object (section 6) as published by a server. */
export interface HpkeKeys {
  kem_id: number;
  current: string;
  keys: { key_id: string; public_key: string }[];
  post_quantum?: HpkeKeys | null;
  versions?: number[];
}

/**
 * The key a client seals to at one server: the current key of the suite, its key id checked
 * against its bytes, the server's layouts checked to include `version`.
 */
export function currentKey(keys: HpkeKeys | null | undefined, name: SuiteName, version: number): ServerKey {
  if (!keys) throw new Error("server publishes no HPKE keys");
  if (!(keys.versions ?? []).includes(version)) throw new Error(`server does not open sealed layout version ${version}`);
  const set = name === "post-quantum" ? keys.post_quantum : keys;
  if (!set) throw new Error(`server publishes no ${name} keys`);
  const k = set.keys.find((x) => x.key_id === set.current);
  if (!k) throw new Error("current key not among the published keys");
  const pk = unhex(k.public_key);
  if (pk.length !== suite(name).publicKeyBytes) throw new Error("public key of the wrong size");
  if (keyId(pk) !== k.key_id) throw new Error(`key id ${k.key_id} does not match its public key`);
  return { suite: name, keyId: k.key_id, publicKey: pk };
}

/** Refuse unless every server has a key and no public key is published by two servers. */
export function checkDistinctKeys(keys: ServerKey[]): void {
  const seen = new Set<string>();
  for (const k of keys) {
    const h = hex(k.publicKey);
    if (seen.has(h)) throw new Error("two servers publish the same public key");
    seen.add(h);
  }
}

/** HPKE single-shot seal of pt under info (aad empty): enc || ciphertext. */
export async function hpkeSeal(key: ServerKey, info: Uint8Array, pt: Uint8Array): Promise<Uint8Array> {
  const s = suite(key.suite);
  const recipientPublicKey = await s.hpke.kem.deserializePublicKey(key.publicKey.slice().buffer);
  const { ct: ciphertext, enc } = await s.hpke.seal({ recipientPublicKey, info: info.slice().buffer }, pt.slice().buffer);
  const out = new Uint8Array(enc.byteLength + ciphertext.byteLength);
  out.set(new Uint8Array(enc), 0);
  out.set(new Uint8Array(ciphertext), enc.byteLength);
  return out;
}
