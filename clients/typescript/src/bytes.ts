/** Byte helpers shared by every module: hex, concatenation, little-endian uint64 as BigInt. */

export function hex(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.length; i++) s += b[i].toString(16).padStart(2, "0");
  return s;
}

export function unhex(s: string): Uint8Array {
  if (s.length % 2 !== 0 || !/^[0-9a-fA-F]*$/.test(s)) throw new Error(`not hex: ${s.slice(0, 20)}`);
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(s.slice(2 * i, 2 * i + 2), 16);
  return out;
}

export function concat(...parts: Uint8Array[]): Uint8Array {
  let n = 0;
  for (const p of parts) n += p.length;
  const out = new Uint8Array(n);
  let o = 0;
  for (const p of parts) {
    out.set(p, o);
    o += p.length;
  }
  return out;
}

export const ascii = (s: string): Uint8Array => new TextEncoder().encode(s);

export const MASK64 = (1n << 64n) - 1n;

/** Read n little-endian uint64 values from b at offset. */
export function readU64s(b: Uint8Array, n: number, offset = 0): BigUint64Array {
  const out = new BigUint64Array(n);
  const dv = new DataView(b.buffer, b.byteOffset + offset, 8 * n);
  for (let i = 0; i < n; i++) out[i] = dv.getBigUint64(8 * i, true);
  return out;
}

/** The little-endian bytes of uint64 values (ring elements). */
export function u64sToBytes(v: ArrayLike<bigint>): Uint8Array {
  const out = new Uint8Array(8 * v.length);
  const dv = new DataView(out.buffer);
  for (let i = 0; i < v.length; i++) dv.setBigUint64(8 * i, v[i], true);
  return out;
}

export function u32be(n: number): Uint8Array {
  const out = new Uint8Array(4);
  new DataView(out.buffer).setUint32(0, n, false);
  return out;
}

export function equalBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** Fresh bytes from the platform CSPRNG (Web Crypto: Node 20+ and browsers). */
export function randomBytes(n: number): Uint8Array {
  const out = new Uint8Array(n);
  for (let o = 0; o < n; o += 65536) globalThis.crypto.getRandomValues(out.subarray(o, Math.min(n, o + 65536)));
  return out;
}

/** Standard base64 with padding (RFC 4648 section 4), in Node and browsers. */
export function base64(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.length; i += 0x8000) s += String.fromCharCode(...b.subarray(i, i + 0x8000));
  return btoa(s);
}
