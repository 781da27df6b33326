/**
 * conformance/batch_validity.json (spec batch-draft-3) and sealing.json's sealed batch record,
 * byte for byte: the batch plan, the rows' noise from the noise key, grid units, the slack's
 * roots, the helpers' seeds and blind, the headers, parts, wrap seed and bits, projections,
 * digits, digits part, batch id, row ids, joint randomness, the leader's shares and every
 * server's record; then the rows -> records vectors through the client's own path.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { sha256 } from "@noble/hashes/sha2.js";
import { hex, unhex } from "../src/bytes.js";
import { Keystream } from "../src/keystream.js";
import { noisyRows } from "../src/batch.js";
import { prepareProofBatch, proofBatchRows } from "../src/proof_batch.js";
import { Client, ProblemError } from "../src/index.js";
import { studyId, validateStudy, type Study } from "../src/study.js";
import { BatchNorm, fourSquareTable, TABLE_LIMIT } from "../src/validity/batch_circuit.js";
import { fromVec } from "../src/validity/fieldvec.js";
import { batchId, helperShares, rowIds, studyBatchPlan, proveBatchRows } from "../src/validity/batch_validity.js";
import { headerBytes, helperLength, leaderLength, records, sealedContent } from "../src/validity/batch_records.js";
import { bits } from "../src/validity/wraparound.js";
import { jointRand } from "../src/validity/flp.js";
import { seal, type SealInput } from "../src/sealing/v4.js";
import { keyId, type SuiteName } from "../src/sealing/suites.js";
import { vectors } from "./helpers.js";

const dec = (xs: bigint[]) => xs.map((x) => x.toString());

test("the four-square table: every n up to 8191 exactly", () => {
  const t = fourSquareTable();
  for (let n = 0; n <= TABLE_LIMIT; n++) {
    const [a, b, c, d] = t.subarray(4 * n, 4 * n + 4);
    assert.equal(a * a + b * b + c * c + d * d, n);
  }
});

for (const v of vectors("batch_validity.json").filter((x) => x.type === "batch_proof")) {
  test(`batch_validity.json ${v.id}: plan, noise, proof and records byte for byte`, () => {
    const study = v.study as Study;
    validateStudy(study);
    assert.equal(studyId(study), v.study_id);
    const m = v.rows.length;
    const plan = studyBatchPlan(study, m);
    const c = plan.circuit;
    const want = v.plan;
    assert.deepEqual(
      { m: c.m, w: c.w, r2: Number(c.r2), reps: c.reps, threshold: Number(c.threshold), n_servers: plan.nServers, shift: plan.shift, squares: c.squares, k: c.k,
        rows_per_call: c.rowsPerCall, rows: c.rows, wrap_digits: c.wrapDigits, wrap_bound: Number(c.wrapBound), v_len: c.vLen, input_len: c.inputLen,
        proof_len: c.proofLen, verifier_len: c.verifierLen, leader_length: leaderLength(plan), helper_length: helperLength(plan.nServers) },
      Object.fromEntries(Object.entries(want).map(([k, x]) => [k, Number(x)])));
    // the noise path (signs, then noise, from the noise key) and grid units
    const noisy = noisyRows(study, v.rows, new Keystream(unhex(v.noise_key)));
    assert.deepEqual(dec(Array.from(noisy.noisy)), v.encoded.flat().map(String));
    const units = noisy.units(plan.shift);
    assert.deepEqual(units.map((r) => r.map(String)), v.units.map((r: any[]) => r.map(String)));
    const proved = proveBatchRows(plan, units, new Keystream(unhex(v.client_key)), Number(v.leader));
    const rootsGot = [];
    for (let i = 0; i < c.rows; i++) rootsGot.push(Array.from(proved.prefix.subarray(i * c.k + c.w, (i + 1) * c.k), String));
    assert.deepEqual(rootsGot, v.roots.map((r: any[]) => r.map(String)));
    assert.deepEqual(Array.from(proved.prefix, (x) => (x < 0 ? BigInt(x) + (1n << 64n) - (1n << 32n) + 1n : BigInt(x)).toString()), v.prefix.map(String));
    for (const [j, s] of Object.entries(v.helper_seeds)) assert.equal(hex(proved.seeds[Number(j)]!), s);
    assert.equal(hex(proved.blind), v.blind);
    assert.equal(hex(plan.header), v.plan_header);
    assert.equal(hex(headerBytes(plan, proved.leader)), v.record_header);
    assert.deepEqual(proved.parts.map(hex), v.parts);
    assert.equal(hex(proved.wrapSeed), v.wrap_seed);
    const table = bits(proved.wrapSeed, c.reps, c.vLen);
    assert.equal(table.length, Number(v.wrap_bits_bytes));
    assert.equal(hex(table.subarray(0, 64)), v.wrap_bits_first);
    assert.equal(hex(sha256(table)), v.wrap_bits_sha256);
    assert.deepEqual(proved.projections.map(String), v.projections.map(String));
    assert.deepEqual(dec(c.wrapInput(proved.projections)), v.wrap_input.map(String));
    assert.equal(hex(proved.digitsPart), v.digits_part);
    assert.equal(hex(proved.batchId), v.batch_id);
    assert.equal(hex(batchId(proved.wrapSeed, proved.digitsPart)), v.batch_id);
    assert.deepEqual(rowIds(proved.batchId, m).map(hex), v.row_ids);
    assert.deepEqual(jointRand(c, proved.batchId).map((p) => dec(p)), v.joint_rand[0].map((p: any[]) => p.map(String)));
    assert.deepEqual(dec(fromVec(proved.leaderInputs)), v.leader_inputs.map(String));
    assert.deepEqual(dec(fromVec(proved.leaderProof)), v.leader_proof.map(String));
    const recs = records(plan, proved);
    for (const s of v.servers) {
      const r = recs[Number(s.position)];
      assert.equal(r.mediaType, s.media_type);
      assert.equal(hex(r.body), s.record, `${v.id} server ${s.position}'s record`);
      if (s.seed !== null) {
        // a helper's shares expand from its seed
        const e = fromVec(helperShares(plan, unhex(s.seed)));
        assert.deepEqual(dec(e.slice(0, c.inputLen)), s.input_share.map(String));
        assert.deepEqual(dec(e.slice(c.inputLen)), s.proof_share.map(String));
      }
    }
  });
}

test("sealing.json sealed-batch-record-classical: a helper's batch record sealed as content 0x06 (docs/sealing.md 3b)", async () => {
  const v = vectors("sealing.json").find((x) => x.id === "sealed-batch-record-classical")!;
  const pk = unhex(v.public_key);
  const bv = vectors("batch_validity.json").find((x) => x.id === v.batch_vector)!;
  const rec = bv.servers[Number(v.position)];
  assert.equal(rec.record, v.record);
  assert.equal(sealedContent(v.media_type), Number(v.content));
  const inp: SealInput = {
    studyId: v.study_id, serverId: v.server_id, key: { suite: "classical" as SuiteName, keyId: keyId(pk), publicKey: pk },
    content: sealedContent(v.media_type), reportIds: [unhex(v.batch_id)], plaintexts: [unhex(v.record)],
  };
  const body = await seal(inp, { batchId: unhex(v.header_batch_id), secret: unhex(v.secret), sealedSecret: unhex(v.sealed_secret) });
  assert.equal(hex(body), v.body);
});


for (const v of vectors("batch_validity.json").filter((x) => x.type === "batch_rows")) {
  test(`batch_validity.json ${v.id}: raw rows and a client key to every server's record (prepareProofBatch)`, () => {
    const study = v.study as Study;
    validateStudy(study);
    assert.equal(studyId(study), v.study_id);
    const key = unhex(v.client_key);
    const b = prepareProofBatch(study, v.rows, key, Number(v.leader));
    assert.deepEqual(dec(Array.from(b.noisy)), v.encoded.flat().map(String));
    assert.deepEqual(b.clamped, v.clamped.map(Number));
    const plan = studyBatchPlan(study, v.rows.length);
    assert.equal(plan.circuit.rowsPerCall, Number(v.plan.rows_per_call));
    assert.equal(plan.circuit.rows, Number(v.plan.rows));
    assert.deepEqual(b.records.map((r) => [r.position, r.mediaType, hex(r.body)]), v.records.map((r: any) => [Number(r.position), r.media_type, r.record]));
    assert.equal(hex(b.batchId), v.batch_id);
    assert.deepEqual(b.rowIds.map(hex), v.row_ids);
    // the same key, the same bytes (a resent batch is the same batch)
    assert.deepEqual(prepareProofBatch(study, v.rows, key, Number(v.leader)).records.map((r) => hex(r.body)), b.records.map((r) => hex(r.body)));
  });
}

// --- the Client on a study with batch proofs (a fake fetch, no network) ------------------------------

const bstudy = vectors("batch_validity.json").find((x) => x.id === "three-servers-leader-last")!.study as Study;
const bid = studyId(bstudy);
const burls = ["http://s0.test", "http://s1.test", "http://s2.test"];

function batchFetch(post: (j: number, body: Uint8Array, type: string, attempt: number) => Response | null, log: { j: number; type: string; body: Uint8Array }[]) {
  const attempts = new Map<number, number>();
  return async (url: string, init: RequestInit): Promise<Response> => {
    const j = burls.findIndex((u) => url.startsWith(u));
    const path = url.slice(burls[j].length);
    const json = (o: unknown, status = 200) => new Response(JSON.stringify(o), { status, headers: { "Content-Type": "application/json" } });
    if (init.method === "GET" && path === `/v1/studies/${bid}`) return json({ study_id: bid, server_id: bstudy.servers[j], status: "open", study: bstudy, hpke: null });
    if (init.method === "GET" && path === "/v1/info") return json({ server_id: bstudy.servers[j], policy: null });
    if (init.method === "POST" && path === `/v1/studies/${bid}/batches`) {
      const body = init.body as Uint8Array;
      const type = (init.headers as Record<string, string>)["Content-Type"];
      log.push({ j, type, body });
      const a = (attempts.get(j) ?? 0) + 1;
      attempts.set(j, a);
      const got = post(j, body, type, a);
      if (got) return got;
      // a batch record counts its m rows (the header's first u32); per-report records one each
      const m = type.includes("proof-batch") ? new DataView(body.buffer, body.byteOffset).getUint32(0, true) : -1;
      return json({ accepted: m, duplicates: 0, report_count: m });
    }
    return json({ type: "urn:dpsketch:problem:not-found", status: 404 }, 404);
  };
}

const brows = Array.from({ length: 10 }, (_, i) => [0.05 * i, -0.03 * i, 0.2, 0.1]);

test("Client.submit on a batch_proofs study: one record a server a batch, the leader rotating, retries and reruns byte-identical", async () => {
  const log: { j: number; type: string; body: Uint8Array }[] = [];
  const fetch = batchFetch((j, _b, _t, a) => (j === 1 && a === 1
    ? new Response(JSON.stringify({ type: "urn:dpsketch:problem:unavailable", status: 503 }), { status: 503, headers: { "Retry-After": "0" } }) : null), log);
  const c = await Client.connect({ studyId: bid, servers: burls.map((url) => ({ url })), fetch, retry: { backoff: 0.001 } });
  const r = await c.submit(brows, { batchSize: 4 });
  assert.deepEqual(r.accepted, [10, 10, 10]);
  assert.equal(r.reportIds.length, 10);
  // batch b's leader record (application/x-dpsketch-proof-batch) at server b mod 3, seeds elsewhere
  const firsts = log.filter((e, i) => log.findIndex((f) => f.j === e.j && hex(f.body) === hex(e.body)) === i);
  assert.equal(firsts.length, 9);
  for (const e of firsts) {
    const dv = new DataView(e.body.buffer, e.body.byteOffset);
    const m = dv.getUint32(0, true), leader = dv.getUint32(36, true);
    assert.equal(e.type === "application/x-dpsketch-proof-batch", leader === e.j);
    assert.ok(m === 4 || m === 2);
  }
  const leaders = firsts.filter((e) => e.type === "application/x-dpsketch-proof-batch").map((e) => e.j);
  assert.deepEqual(leaders.sort(), [0, 1, 2]);
  // the 503 at server 1: the very same bytes again
  const toS1 = log.filter((e) => e.j === 1).map((e) => hex(e.body));
  assert.equal(toS1.length, 4);
  assert.equal(toS1[0], toS1[1]);
  // a rerun with the same secret sends the same records and row ids
  const log2: { j: number; type: string; body: Uint8Array }[] = [];
  const c2 = await Client.connect({ studyId: bid, servers: burls.map((url) => ({ url })), fetch: batchFetch(() => null, log2) });
  const r2 = await c2.submit(brows, { batchSize: 4, secret: r.secret });
  assert.deepEqual(r2.reportIds, r.reportIds);
  assert.deepEqual(new Set(log2.map((e) => hex(e.body))), new Set(firsts.map((e) => hex(e.body))));
});

test("a proved batch is not cut on 413 (the problem stands); batchProofs: false sends per-report records", async () => {
  const log: { j: number; type: string; body: Uint8Array }[] = [];
  const fetch = batchFetch((j) => (j === 0 ? new Response(JSON.stringify({ type: "urn:dpsketch:problem:payload-too-large", status: 413 }), { status: 413 }) : null), log);
  const c = await Client.connect({ studyId: bid, servers: burls.map((url) => ({ url })), fetch });
  await assert.rejects(c.submit(brows), (e: unknown) => e instanceof ProblemError && e.status === 413);
  assert.equal(log.filter((e) => e.j === 0).length, 1);
  const plain: { j: number; type: string; body: Uint8Array }[] = [];
  const perReport = batchFetch((_j, body, type) => {
    const m = type === "application/x-dpsketch-seeds" ? body.length / (16 + 48 + 32) : 10;
    return new Response(JSON.stringify({ accepted: m, duplicates: 0, report_count: 0 }), { status: 200 });
  }, plain);
  const c2 = await Client.connect({ studyId: bid, servers: burls.map((url) => ({ url })), fetch: perReport });
  const r = await c2.submit(brows, { batchProofs: false, batchSize: 10 });
  assert.deepEqual(new Set(plain.map((e) => e.type)), new Set(["application/x-dpsketch-shares", "application/x-dpsketch-seeds"]));
  assert.equal(r.reportIds.length, 10);
});

test("proofBatchRows: the SDK's default (the leader's record within 8 MiB, at most 100,000 rows), or batchSize", () => {
  // client_sdk.upload.proof_batch_rows gives 100,000 for this study (w = 4: 72 bytes a row)
  const m = proofBatchRows(bstudy);
  assert.equal(m, 100_000);
  assert.ok(leaderLength(studyBatchPlan(bstudy, m)) <= 8 << 20);
  assert.equal(proofBatchRows(bstudy, 5), 5);
  assert.throws(() => proofBatchRows(bstudy, 0), /at least 1/);
});

test("the study member: batch_proofs only with validity on a sketch or l1 study without parties; false reads as absent", () => {
  const { batch_proofs: _bp, ...without } = bstudy;
  assert.equal(studyId({ ...without, batch_proofs: false }), studyId(without as Study));
  assert.notEqual(studyId(bstudy), studyId(without as Study));
  assert.throws(() => validateStudy({ ...bstudy, validity: undefined }), /batch_proofs only with validity/);
  assert.throws(() => validateStudy({ ...bstudy, batch_proofs: "yes" as unknown as boolean }), /batch_proofs is a boolean/);
  assert.throws(() => prepareProofBatch(without as Study, brows, new Uint8Array(32), 0), /does not take batch proofs/);
});

test("BatchNorm.prefixNumbers is prefix in doubles: random rows (fixed seed), a row at the bound, zeros, and the same refusals", () => {
  let s = 12345;
  const rand = () => {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    return s / 2 ** 32;
  };
  for (const [m, w, r2] of [[37, 3, 1000n], [200, 10, 5_133_776n], [5, 1, 0n], [64, 7, 123_456_789_012n]] as [number, number, bigint][]) {
    const c = new BatchNorm(m, w, r2);
    const bound = Math.sqrt(Number(r2) / w);
    const rows = Array.from({ length: m }, () => Array.from({ length: w }, () => BigInt(Math.trunc((2 * rand() - 1) * bound))));
    rows[0] = rows[0].map(() => 0n);
    if (m > 1) rows[1] = [BigInt(Math.floor(Math.sqrt(Number(r2)))), ...new Array(w - 1).fill(0n)];
    assert.deepEqual(Array.from(c.prefixNumbers(rows), String), c.prefix(rows).map(String), `m ${m} w ${w}`);
    const over = rows.map((r) => r.slice());
    over[m - 1][0] = BigInt(Math.floor(Math.sqrt(Number(r2)))) + 1n;
    assert.throws(() => c.prefix(over), /exceeds R\^2/);
    assert.throws(() => c.prefixNumbers(over), /exceeds R\^2/);
  }
});
