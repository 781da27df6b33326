/**
 * A batch of reports from its keystream key, in the draw order of docs/protocol.md section 5a:
 * secret signs, noise, shares (full or seed-compressed), salts; then binding (section 4a) and
 * the plaintext record layouts of section 7 (shares and seeds).
 */
import { concat, unhex } from "./bytes.js";

if (new Uint8Array(new Uint32Array([1]).buffer)[0] !== 1) throw new Error("this client needs a little-endian platform");
import { bind, CONTENT_SEED, CONTENT_SHARE } from "./binding.js";
import { mapper, type RawValue } from "./features.js";
import { Keystream } from "./keystream.js";
import { draw } from "./noise.js";
import { expandSeedBytes, roundHalfEven } from "./ring.js";
import { noisePlan, provedFeatures, provedScale, valueBound, type Study } from "./study.js";
import { proveBatch, validityPlan } from "./validity/study.js";

export const SHARES_TYPE = "application/x-dpsketch-shares";
export const SEEDS_TYPE = "application/x-dpsketch-seeds";

export interface ServerBatch {
  position: number;
  content: number; // 1 share, 2 seed
  mediaType: string;
  /** payload_j of every report: 8 width share bytes or a 32-byte seed */
  payloads: Uint8Array[];
  salts: Uint8Array[];
  proofs: Uint8Array[];
}

export interface PreparedBatch {
  reportIds: Uint8Array[];
  servers: ServerBatch[];
  signs: number[] | null;
  /** the noisy ring vectors (row-major), before sharing */
  noisy: BigUint64Array;
  bytesUsed: number;
  clamped: number[];
}

export interface BatchOptions {
  /** seed-compressed sharing with the full share at this position; null: full shares */
  full: number | null;
}

/** The plaintext body of one server's batch (section 7). */
export function plainBody(reportIds: Uint8Array[], sb: ServerBatch): Uint8Array {
  const parts: Uint8Array[] = [];
  reportIds.forEach((id, i) => parts.push(id, sb.proofs[i], sb.payloads[i]));
  return concat(...parts);
}

export interface NoisyRows {
  /** the rows' vectors before sign and noise */
  vectors: number[][];
  /** a study with proved features: the clipped rows (the witness's source) */
  clippedRows: number[][] | null;
  signs: number[] | null;
  /** the noisy ring vectors (row-major) and their 32-bit halves */
  noisy: BigUint64Array;
  halves: Uint32Array;
  clamped: number[];
  /** the noisy vectors in grid units (validity.grid_units), m rows of W integers */
  units(shift: number): bigint[][];
}

/**
 * Steps 1 and 2 of the draw order from `ks`: map (clip, features), secret signs, then noise;
 * what every path (per-report shares, per-report proofs, batch proofs) starts from.
 */
export function noisyRows(study: Study, rows: RawValue[][], ks: Keystream): NoisyRows {
  const W = noisePlan(study).width;
  const m = rows.length;
  const mp = mapper(study);
  // a study with proved features: its proof multiplies the clipped rows (the witness)
  const clippedRows = provedFeatures(study) ? rows.map((r) => mp.clipped(r)) : null;
  const vectors = clippedRows ? clippedRows.map((a) => mp.features(a)) : rows.map((r) => mp.vector(r));
  let signs: number[] | null = null;
  if (study.secret_sign) {
    const bits = ks.bits(m);
    signs = Array.from(bits, (b) => (b ? -1 : 1));
  }
  const { noisy, halves } = encodeNoisy(study, vectors, signs, ks, W);
  const units = (shift: number): bigint[][] => {
    const out: bigint[][] = [];
    const s = BigInt(shift);
    for (let i = 0; i < m; i++) {
      const row: bigint[] = [];
      for (let j = 0; j < W; j++) {
        const x = BigInt.asIntN(64, noisy[i * W + j]);
        if (x % (1n << s) !== 0n) throw new Error("a value is not on the study's noise grid");
        row.push(x >> s);
      }
      out.push(row);
    }
    return out;
  };
  return { vectors, clippedRows, signs, noisy, halves, clamped: mp.clamped, units };
}

export function prepareBatch(study: Study, studyIdHex: string, rows: RawValue[][], key: Uint8Array, opts: BatchOptions): PreparedBatch {
  const W = noisePlan(study).width;
  const m = rows.length;
  const N = study.servers.length;
  const ks = new Keystream(key);
  const { vectors, clippedRows, signs, noisy, halves, clamped } = noisyRows(study, rows, ks);
  const mp = { clamped };
  if (study.validity !== undefined) return provedBatch(study, studyIdHex, noisy, ks, opts.full ?? N - 1, signs, mp.clamped, study.kind === "histogram" ? vectors : null, clippedRows);
  const servers = shareAndSalt(halves, m, W, N, ks, opts.full);
  const reportIds: Uint8Array[] = [];
  const sid = unhex(studyIdHex);
  for (let i = 0; i < m; i++) {
    const b = bind(sid, servers.map((s) => s.content), servers.map((s) => s.salts[i]), servers.map((s) => s.payloads[i]));
    reportIds.push(b.reportId);
    servers.forEach((s, j) => s.proofs.push(b.proofs[j]));
  }
  return { reportIds, servers, signs, noisy, bytesUsed: ks.used, clamped: mp.clamped };
}

/**
 * A validity study's batch (docs/protocol.md sections 4b, 4c): always seed-compressed, the
 * leader at `full` receiving its input and proof shares (n + P field elements a report), every
 * other server a seed; the keystream continues after the noise.
 */
function provedBatch(study: Study, studyIdHex: string, noisy: BigUint64Array, ks: Keystream, full: number,
  signs: number[] | null, clamped: number[], onehot: number[][] | null, clippedRows: number[][] | null): PreparedBatch {
  const plan = validityPlan(study);
  const b = proveBatch(study, studyIdHex, plan, noisy, ks, full, onehot, clippedRows);
  const servers: ServerBatch[] = b.servers.map((s, j) => ({
    position: j,
    content: s.content,
    mediaType: s.content === CONTENT_SEED ? SEEDS_TYPE : SHARES_TYPE,
    payloads: s.payloads,
    salts: [],
    proofs: s.proofs,
  }));
  return { reportIds: b.reportIds, servers, signs, noisy, bytesUsed: ks.used, clamped };
}

/**
 * The client noise of m rows of W values, row-major, in grid units. A study with proved features
 * (section 4b) draws it in two blocks: every column of scale 1 as one (m, w_1) block, then the
 * strict upper triangle's as an (m, W - w_1) block with sd sigma / sqrt(2).
 */
function clientNoise(study: Study, ks: Keystream, m: number, W: number): Int32Array | Float64Array | null {
  const plan = noisePlan(study);
  if (!plan.client) return null;
  if (!plan.clientUpper) return draw(ks, m * W, plan.client.t, plan.client.limit);
  const scale = provedScale(study);
  const out = new Float64Array(m * W);
  const columns = scale.map((_, c) => c);
  const blocks = [
    { ...plan.client, cols: columns.filter((c) => scale[c] === 1) },
    { ...plan.clientUpper, cols: columns.filter((c) => scale[c] !== 1) },
  ];
  for (const { t, limit, cols } of blocks) {
    if (cols.length === 0) continue;
    const block = draw(ks, m * cols.length, t, limit);
    for (let i = 0; i < m; i++) cols.forEach((c, k) => (out[i * W + c] = block[i * cols.length + k]));
  }
  return out;
}

/**
 * Step 2 of the draw order: the vectors (signed already; times provedScale in a study with proved
 * features) rounded to the grid plus the client noise, as ring values; also their little-endian
 * 32-bit halves (every |value| < 2^53 is an exact double, so no BigInt per value).
 */
export function encodeNoisy(study: Study, vectors: number[][], signs: number[] | null, ks: Keystream, W: number): { noisy: BigUint64Array; halves: Uint32Array } {
  const plan = noisePlan(study);
  const m = vectors.length;
  const f = study.frac_bits;
  const scale = provedFeatures(study) ? provedScale(study) : null;
  if (scale) vectors = vectors.map((v) => v.map((x, c) => x * scale[c]));
  const noise = clientNoise(study, ks, m, W);
  const gridScale = 2 ** (f - plan.shift);
  const unit = 2 ** plan.shift;
  const bound = (valueBound(study) + 20 * study.sigma) * 2 ** f;
  const noisyBuf = new ArrayBuffer(8 * m * W);
  const noisyHalves = new Uint32Array(noisyBuf);
  for (let i = 0; i < m; i++) {
    const v = vectors[i];
    const sgn = signs ? signs[i] : 1;
    for (let c = 0; c < W; c++) {
      const x = (roundHalfEven(sgn * v[c] * gridScale) + (noise ? noise[i * W + c] : 0)) * unit;
      if (!(Math.abs(x) <= bound) || Math.abs(x) >= 2 ** 53) throw new RangeError("a noisy value is outside the encodable range");
      const hi = Math.floor(x / 4294967296);
      noisyHalves[2 * (i * W + c)] = x - hi * 4294967296;
      noisyHalves[2 * (i * W + c) + 1] = hi >>> 0;
    }
  }
  const noisy = new BigUint64Array(noisyBuf);
  return { noisy, halves: noisyHalves };
}

/**
 * Steps 3 and 4: the other servers' shares (full: Words64; seed-compressed with the full share
 * at `full`: seeds), the full share as the noisy values minus them mod 2^64, and the salts.
 */
export function shareAndSalt(halves: Uint32Array, m: number, W: number, N: number, ks: Keystream, full: number | null): ServerBatch[] {
  const noisyHalves = halves;
  const opts = { full };
  // shares, as 32-bit halves: the others from the keystream (or their seeds' expansions), the full
  // share the noisy vectors minus them mod 2^64
  const shares: (Uint8Array | null)[] = new Array(N).fill(null);
  const seeds: (Uint8Array[] | null)[] = new Array(N).fill(null);
  const fullAt = opts.full === null ? N - 1 : opts.full;
  const others: Uint32Array[] = [];
  for (let j = 0; j < N; j++) {
    if (j === fullAt) continue;
    if (opts.full === null) {
      const b = ks.bytes(8 * m * W).slice();
      shares[j] = b;
      others.push(new Uint32Array(b.buffer, b.byteOffset, 2 * m * W));
    } else {
      const b = ks.bytes(32 * m).slice();
      const list: Uint8Array[] = [];
      const arr = new Uint8Array(8 * m * W);
      for (let i = 0; i < m; i++) {
        const seed = b.subarray(32 * i, 32 * i + 32);
        list.push(seed);
        arr.set(expandSeedBytes(seed, W), 8 * i * W);
      }
      seeds[j] = list;
      shares[j] = arr;
      others.push(new Uint32Array(arr.buffer, 0, 2 * m * W));
    }
  }
  const last = new Uint32Array(2 * m * W);
  for (let x = 0; x < m * W; x++) {
    let lo = noisyHalves[2 * x], hi = noisyHalves[2 * x + 1];
    for (const o of others) {
      const olo = o[2 * x];
      const borrow = lo < olo ? 1 : 0;
      lo = (lo - olo + 4294967296) % 4294967296;
      hi = (hi - o[2 * x + 1] - borrow + 8589934592) % 4294967296;
    }
    last[2 * x] = lo;
    last[2 * x + 1] = hi;
  }
  shares[fullAt] = new Uint8Array(last.buffer);
  const saltBytes = ks.bytes(16 * N * m).slice();
  const servers: ServerBatch[] = [];
  for (let j = 0; j < N; j++) {
    const isSeed = seeds[j] !== null;
    const payloads: Uint8Array[] = [];
    for (let i = 0; i < m; i++) payloads.push(isSeed ? seeds[j]![i] : shares[j]!.subarray(8 * i * W, 8 * (i + 1) * W));
    const salts: Uint8Array[] = [];
    for (let i = 0; i < m; i++) salts.push(saltBytes.subarray(16 * (j * m + i), 16 * (j * m + i) + 16));
    servers.push({ position: j, content: isSeed ? CONTENT_SEED : CONTENT_SHARE, mediaType: isSeed ? SEEDS_TYPE : SHARES_TYPE, payloads, salts, proofs: [] });
  }
  return servers;
}
