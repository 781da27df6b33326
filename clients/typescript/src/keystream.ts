/**
 * The batch keystream of docs/protocol.md section 5a ("The draw order"): ChaCha20 (RFC 8439)
 * under a 32-byte key, counter 0, nonce the 12 ASCII bytes "dpsketch/rng", read as one sequence
 * of bytes. Every random value of a batch comes from it in a fixed order, so a batch is a
 * function of its key (resumable, and comparable byte for byte with the reference).
 */
import { chacha20 } from "./primitives.js";
import { ascii } from "./bytes.js";

export const RNG_NONCE = ascii("dpsketch/rng");
const CHUNK_BLOCKS = 256; // 16 KiB generated at a time

export class Keystream {
  private buf = new Uint8Array(0);
  private pos = 0;
  private counter = 0;
  /** bytes read so far (the vectors' bytes_used) */
  used = 0;

  constructor(private readonly key: Uint8Array, private readonly nonce: Uint8Array = RNG_NONCE) {
    if (key.length !== 32) throw new Error("keystream key must be 32 bytes");
  }

  private refill(need: number): void {
    const rest = this.buf.subarray(this.pos);
    const blocks = Math.max(CHUNK_BLOCKS, Math.ceil((need - rest.length) / 64));
    const fresh = chacha20(this.key, this.nonce, new Uint8Array(64 * blocks), this.counter);
    this.counter += blocks;
    const merged = new Uint8Array(rest.length + fresh.length);
    merged.set(rest, 0);
    merged.set(fresh, rest.length);
    this.buf = merged;
    this.pos = 0;
  }

  /** The next n bytes of the stream (a view: copy it if it must outlive the next read). */
  bytes(n: number): Uint8Array {
    if (this.buf.length - this.pos < n) this.refill(n);
    const out = this.buf.subarray(this.pos, this.pos + n);
    this.pos += n;
    this.used += n;
    return out;
  }

  /** Words64(n) as BigInt. */
  words64(n: number): bigint[] {
    const b = this.bytes(8 * n);
    const dv = new DataView(b.buffer, b.byteOffset, b.length);
    const out: bigint[] = new Array(n);
    for (let i = 0; i < n; i++) out[i] = dv.getBigUint64(8 * i, true);
    return out;
  }

  /** Words64(n) as (hi, lo) uint32 pairs: the fast path of the sampler's table lookup. */
  words64Split(n: number): { hi: Uint32Array; lo: Uint32Array } {
    const b = this.bytes(8 * n);
    const dv = new DataView(b.buffer, b.byteOffset, b.length);
    const hi = new Uint32Array(n), lo = new Uint32Array(n);
    for (let i = 0; i < n; i++) {
      lo[i] = dv.getUint32(8 * i, true);
      hi[i] = dv.getUint32(8 * i + 4, true);
    }
    return { hi, lo };
  }

  words32(n: number): Uint32Array {
    const b = this.bytes(4 * n);
    const dv = new DataView(b.buffer, b.byteOffset, b.length);
    const out = new Uint32Array(n);
    for (let i = 0; i < n; i++) out[i] = dv.getUint32(4 * i, true);
    return out;
  }

  /** Bits(n): bit i is bit (i mod 8) of byte floor(i/8), least significant first. */
  bits(n: number): Uint8Array {
    const b = this.bytes(Math.ceil(n / 8));
    const out = new Uint8Array(n);
    for (let i = 0; i < n; i++) out[i] = (b[i >> 3] >> (i & 7)) & 1;
    return out;
  }

  /** Below(n, top, 64): redraw words >= top, in rounds, replacing in index order. */
  below64(n: number, top: bigint): bigint[] {
    const w = this.words64(n);
    for (;;) {
      const bad: number[] = [];
      for (let i = 0; i < n; i++) if (w[i] >= top) bad.push(i);
      if (bad.length === 0) return w;
      const fresh = this.words64(bad.length);
      bad.forEach((i, k) => (w[i] = fresh[k]));
    }
  }

  /** Below(n, top, 32), top <= 2^32. */
  below32(n: number, top: number): Uint32Array {
    const w = this.words32(n);
    for (;;) {
      const bad: number[] = [];
      for (let i = 0; i < n; i++) if (w[i] >= top) bad.push(i);
      if (bad.length === 0) return w;
      const fresh = this.words32(bad.length);
      bad.forEach((i, k) => (w[i] = fresh[k]));
    }
  }

  /** U(b): uniform below b from ceil(bitlength(b)/8) + 8 bytes, with rejection. */
  uniform(b: bigint): bigint {
    const nbytes = Math.ceil(b.toString(2).length / 8) + 8;
    const space = 1n << BigInt(8 * nbytes);
    const limit = space - (space % b);
    for (;;) {
      const raw = this.bytes(nbytes);
      let w = 0n;
      for (let i = nbytes - 1; i >= 0; i--) w = (w << 8n) | BigInt(raw[i]);
      if (w < limit) return w % b;
    }
  }
}
