/**
 * SHA-256 and the ChaCha20 keystream for the prover's bulk work: Node's built-in OpenSSL when
 * the runtime has it (process.getBuiltinModule, Node >= 20.16: synchronous, no import of a Node
 * module that a browser bundle would trip on), else @noble's plain TS, the same bytes either way
 * (test/primitives.test.ts checks both against each other). A batch proof hashes its leader's
 * 8 MiB share and expands megabytes of seeded shares: OpenSSL does that tens of times faster.
 */
import { chacha20 as nobleChacha20 } from "@noble/ciphers/chacha.js";
import { sha256 as nobleSha256 } from "@noble/hashes/sha2.js";

interface NodeCrypto {
  createHash(alg: string): { update(d: Uint8Array): { digest(): Uint8Array } };
  createCipheriv(alg: string, key: Uint8Array, iv: Uint8Array): { update(d: Uint8Array): Uint8Array };
  getCiphers(): string[];
}

function nodeCrypto(): NodeCrypto | null {
  try {
    const proc = (globalThis as { process?: { getBuiltinModule?: (id: string) => unknown } }).process;
    const c = proc?.getBuiltinModule?.("node:crypto") as NodeCrypto | undefined;
    return c && c.getCiphers().includes("chacha20") ? c : null;
  } catch {
    return null;
  }
}

const NODE = nodeCrypto();

/** whether the fast (Node OpenSSL) primitives are in use */
export const nativePrimitives = NODE !== null;

const asBytes = (b: Uint8Array): Uint8Array => new Uint8Array(b.buffer, b.byteOffset, b.byteLength);

/** SHA-256 of data. */
export const sha256Noble = (data: Uint8Array): Uint8Array => nobleSha256(data);
export const sha256: (data: Uint8Array) => Uint8Array = NODE
  ? (data) => asBytes(NODE.createHash("sha256").update(data).digest())
  : sha256Noble;

/** ChaCha20 (RFC 8439: 32-byte key, 12-byte nonce, 32-bit block counter) XORed over data. */
export const chacha20Noble = (key: Uint8Array, nonce: Uint8Array, data: Uint8Array, counter = 0): Uint8Array =>
  nobleChacha20(key, nonce, data, undefined, counter);
export const chacha20: (key: Uint8Array, nonce: Uint8Array, data: Uint8Array, counter?: number) => Uint8Array = NODE
  ? (key, nonce, data, counter = 0) => {
    if (key.length !== 32 || nonce.length !== 12 || !(Number.isInteger(counter) && counter >= 0 && counter < 2 ** 32)) {
      return chacha20Noble(key, nonce, data, counter);
    }
    // OpenSSL's IV: the counter (u32 LE), then the nonce
    const iv = new Uint8Array(16);
    new DataView(iv.buffer).setUint32(0, counter, true);
    iv.set(nonce, 4);
    const out = asBytes(NODE.createCipheriv("chacha20", key, iv).update(data));
    // a counter wrapping past 2^32 within data: OpenSSL carries into the nonce, RFC 8439 may not
    return counter + Math.ceil(data.length / 64) > 2 ** 32 ? chacha20Noble(key, nonce, data, counter) : out;
  }
  : chacha20Noble;
