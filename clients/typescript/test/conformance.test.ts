/**
 * Every conformance vector a client needs, recomputed by this package: study ids, ring, sketch
 * hashes, the keystream, sampler and secret sign, noise parameters and whole batches, the
 * binding, bounds and seed vectors of docs/protocol.md section 9.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { sha256 } from "@noble/hashes/sha2.js";
import { hex, unhex, u64sToBytes, MASK64 } from "../src/bytes.js";
import { canonical, type Json } from "../src/canonical.js";
import { canonicalStudy, studyId, validateStudy, width, noisePlan, partyClipBounds, type Study } from "../src/study.js";
import { encode, decode, expandSeed, lastShare } from "../src/ring.js";
import { osnap, l1Rows } from "../src/sketch.js";
import { Keystream } from "../src/keystream.js";
import { blockTable, bernoulliExp, draw } from "../src/noise.js";
import { prepareBatch, plainBody } from "../src/batch.js";
import { bind } from "../src/binding.js";
import { columnMap, toBall } from "../src/bounds.js";
import { vectors, section9 } from "./helpers.js";

const big = (xs: (string | bigint)[]) => xs.map((x) => BigInt(x));

test("study_ids.json: canonical encodings and study ids", () => {
  for (const v of vectors("study_ids.json")) {
    if (v.type === "canonical_json") {
      const text = canonical(v.input as Json);
      assert.equal(text, v.canonical, v.id);
      assert.equal(hex(new TextEncoder().encode(text)), v.canonical_hex, v.id);
      assert.equal(hex(sha256(new TextEncoder().encode(text))), v.sha256, v.id);
    } else {
      const study = v.input as Study;
      validateStudy(study);
      assert.equal(canonicalStudy(study), v.canonical, v.id);
      assert.equal(studyId(study), v.study_id, v.id);
      assert.equal(width(study), v.derived.width, v.id);
      assert.equal(study.columns.length, v.derived.d, v.id);
      assert.equal(study.k * width(study), v.derived.aggregate_cells, v.id);
    }
  }
});

test("study id: secret_sign false reads as absent", () => {
  const v = vectors("study_ids.json").find((x) => x.id === "study-unsigned")!;
  const withFalse = { ...(v.input as Study), secret_sign: false };
  assert.equal(studyId(withFalse), v.study_id);
});

test("ring.json: encode, decode, shares, seed shares", () => {
  for (const v of vectors("ring.json")) {
    if (v.type === "encode") {
      if (v.refused) assert.throws(() => encode(v.x, v.frac_bits, v.bound), RangeError, v.id);
      else {
        const r = encode(v.x, v.frac_bits, v.bound);
        assert.equal(r.toString(), v.encoded, v.id);
        assert.equal(decode(r, v.frac_bits), v.decoded, v.id);
      }
    } else if (v.type === "decode") {
      assert.equal(decode(BigInt(v.ring), v.frac_bits), v.value, v.id);
    } else if (v.type === "share") {
      const got = lastShare(big(v.x), v.random_shares.map(big));
      assert.deepEqual(Array.from(got, String), v.last_share, v.id);
      // and the shares add back up to x
      const sum = Array.from(got, (g, i) => v.random_shares.reduce((a: bigint, s: string[]) => a + BigInt(s[i]), g) & MASK64);
      assert.deepEqual(sum.map(String), v.x.map(String), v.id);
    } else if (v.type === "seed_share") {
      const exp = v.seeds.map((s: string) => expandSeed(unhex(s), v.width));
      assert.deepEqual(exp.map((e: BigUint64Array) => Array.from(e, String)), v.expanded, v.id);
      assert.deepEqual(Array.from(lastShare(big(v.x), exp), String), v.last_share, v.id);
    } else assert.fail(`unknown ring vector ${v.type}`);
  }
});

test("sketch.json: osnap and l1 rows, aggregates", () => {
  for (const v of vectors("sketch.json")) {
    if (v.type === "osnap") {
      const r = osnap(v.seed, v.k, v.s, unhex(v.report_id));
      assert.equal(hex(r.digest), v.digest, v.id);
      assert.deepEqual(r.buckets, v.buckets, v.id);
      assert.deepEqual(r.signs, v.signs, v.id);
      assert.deepEqual(r.rows, v.rows, v.id);
    } else if (v.type === "l1") {
      const rows = l1Rows(v.seed, v as any, unhex(v.report_id));
      assert.deepEqual(rows, v.rows, v.id);
      assert.equal(v.s * v.level0_buckets + v.levels * v.buckets, v.k, v.id);
    } else if (v.type === "aggregate") {
      const agg: bigint[] = new Array(v.k * v.width).fill(0n);
      v.report_ids.forEach((rid: string, i: number) => {
        const sh = big(v.shares[i]);
        const place = v.kind === "l1" ? l1Rows(v.seed, v.l1, unhex(rid)).map((r) => [r, 1]) : (() => {
          const o = osnap(v.seed, v.k, v.s, unhex(rid));
          return o.rows.map((r, l) => [r, o.signs[l]]);
        })();
        for (const [row, sign] of place) for (let c = 0; c < v.width; c++) agg[row * v.width + c] = (agg[row * v.width + c] + BigInt(sign) * sh[c]) & MASK64;
      });
      assert.equal(hex(u64sToBytes(agg)), v.aggregate_hex, v.id);
      assert.equal(hex(sha256(Uint8Array.from(v.report_ids.flatMap((r: string) => Array.from(unhex(r)))))), v.inclusion_hash, v.id);
    } else assert.fail(`unknown sketch vector ${v.type}`);
  }
});

for (const v of vectors("noise.json")) test(`noise.json ${v.id}`, () => {
  {
    if (v.type === "keystream") {
      assert.equal(hex(new Keystream(unhex(v.key)).bytes(96)), v.bytes, v.id);
      assert.deepEqual(new Keystream(unhex(v.key)).words64(4).map(String), v.words64, v.id);
      assert.deepEqual(Array.from(new Keystream(unhex(v.key)).words32(4), String), v.words32, v.id);
      assert.deepEqual(Array.from(new Keystream(unhex(v.key)).bits(20)), v.bits, v.id);
    } else if (v.type === "block_table") {
      const tb = blockTable(v.t, v.limit);
      assert.equal(tb.block, v.block, v.id);
      assert.equal(tb.entries, v.entries, v.id);
      assert.equal(hex(sha256(u64sToBytes(tb.bounds))), v.bounds_sha256, v.id);
      if (v.bounds) assert.deepEqual(tb.bounds.map(String), v.bounds, v.id);
      if (v.first) assert.deepEqual(tb.bounds.slice(0, 8).map(String), v.first, v.id);
      if (v.last) assert.deepEqual(tb.bounds.slice(-4).map(String), v.last, v.id);
    } else if (v.type === "uniform_below") {
      const ks = new Keystream(unhex(v.key));
      const got = uniformBelow(ks, BigInt(v.bound), v.count);
      assert.deepEqual(got.map(String), v.values, v.id);
      assert.equal(ks.used, v.bytes_used, v.id);
    } else if (v.type === "bernoulli_exp") {
      const ks = new Keystream(unhex(v.key));
      const r = bernoulliExp(ks, big(v.nums), BigInt(v.den));
      assert.deepEqual(Array.from(r), v.results, v.id);
      assert.equal(ks.used, v.bytes_used, v.id);
    } else if (v.type === "sampler") {
      const ks = new Keystream(unhex(v.key));
      assert.deepEqual(Array.from(draw(ks, v.count, v.t, v.limit)), v.draws, v.id);
      assert.equal(ks.used, v.bytes_used, v.id);
    } else if (v.type === "secret_sign") {
      const ks = new Keystream(unhex(v.key));
      assert.deepEqual(Array.from(ks.bits(v.rows), (b) => (b ? -1 : 1)), v.signs, v.id);
      assert.equal(ks.used, v.bytes_used, v.id);
    } else if (v.type === "noise_parameters") {
      const plan = noisePlan(v.study);
      assert.equal(studyId(v.study), v.study_id, v.id);
      assert.equal(plan.width, v.width, v.id);
      assert.equal(plan.clipBound, v.clip_bound, v.id);
      assert.equal(plan.shift, v.shift, v.id);
      assert.equal(plan.spacing, v.spacing, v.id);
      assert.deepEqual(plan.client, v.client, v.id);
      assert.deepEqual(plan.server, v.server, v.id);
      assert.deepEqual(partyClipBounds(v.study), v.party_clip_bounds, v.id);
    } else if (v.type === "batch") {
      checkBatch(v);
    } else assert.fail(`unknown noise vector ${v.type}`);
  }
});

/**
 * The uniform_below vectors: floor(w / q) for w = Below(count, q b, size), q = floor((2^size - 1) / b),
 * 32-bit words below 2^28 (the offset R of step c), 64-bit words above.
 */
function uniformBelow(ks: Keystream, b: bigint, count: number): bigint[] {
  if (b < 1n << 28n) {
    const m = Number(b);
    const q = Math.floor(4294967295 / m);
    return Array.from(ks.below32(count, q * m), (w) => BigInt(Math.floor(w / q)));
  }
  const q = ((1n << 64n) - 1n) / b;
  return ks.below64(count, q * b).map((w) => w / q);
}

function checkBatch(v: any): void {
  const study = v.study as Study;
  const sid = studyId(study);
  assert.equal(sid, v.study_id, v.id);
  const b = prepareBatch(study, sid, v.rows, unhex(v.key), { full: v.compress ? v.full : null });
  const W = width(study);
  if (v.signs) assert.deepEqual(b.signs, v.signs, v.id);
  const noisy = [];
  for (let i = 0; i < v.rows.length; i++) noisy.push(Array.from(b.noisy.subarray(i * W, (i + 1) * W), String));
  assert.deepEqual(noisy, v.noisy, v.id);
  assert.deepEqual(b.reportIds.map(hex), v.report_ids, v.id);
  for (const s of v.servers) {
    const sb = b.servers[s.position];
    assert.equal(sb.mediaType, s.media_type, v.id);
    assert.deepEqual(sb.salts.map(hex), s.salts, v.id);
    assert.deepEqual(sb.proofs.map(hex), s.proofs, v.id);
    if (s.seeds) assert.deepEqual(sb.payloads.map(hex), s.seeds, v.id);
    assert.equal(hex(plainBody(b.reportIds, sb)), s.body, v.id);
  }
  assert.equal(b.bytesUsed, v.bytes_used, v.id);
}

test("docs/protocol.md section 9: binding, bounds, seed expansion, ring, canonical JSON, sketch", () => {
  const s9 = section9();
  const bd = s9.binding;
  const r = bind(bd.study_id, bd.servers.map((s: any) => s.content), bd.servers.map((s: any) => unhex(s.salt)), bd.servers.map((s: any) => unhex(s.payload)));
  assert.equal(hex(r.reportId), bd.report_id);
  bd.servers.forEach((s: any, j: number) => {
    assert.equal(hex(r.commitments[j]), s.commitment);
    assert.equal(hex(r.proofs[j]), s.proof);
  });
  const bv = s9.bounds;
  const map = columnMap(bv.bounds, bv.clip_bound, bv.constant);
  const clamped = [0, 0, 0];
  bv.rows.forEach((row: number[], i: number) => {
    const m = toBall(map, row);
    assert.deepEqual(m.row, bv.mapped[i]);
    m.clamped.forEach((c, j) => (clamped[j] += c ? 1 : 0));
  });
  assert.deepEqual(clamped, bv.clamped);
  for (const e of s9.seed_expansion) {
    assert.deepEqual(Array.from(expandSeed(unhex(e.seed), e.share.length), String), e.share);
  }
  for (const e of s9.ring) {
    assert.equal(encode(e.x, e.frac_bits, 1e6).toString(), BigInt(e.encoded).toString());
  }
  for (const e of s9.canonical_json) {
    const text = canonical(e.value as Json);
    assert.equal(text, e.canonical);
    assert.equal(hex(sha256(new TextEncoder().encode(text))), e.sha256);
  }
  for (const e of s9.sketch) {
    const o = osnap(s9.seed, e.k, e.s, unhex(e.report_id));
    assert.equal(hex(o.digest), e.digest);
    assert.deepEqual(o.buckets, e.buckets);
    assert.deepEqual(o.signs, e.signs);
  }
});
