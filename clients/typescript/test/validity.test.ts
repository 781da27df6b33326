/**
 * conformance/validity.json: validity studies (N = 2 and 3; sketch, histogram, l1, gram and
 * moments) from their noisy ring vectors to what each server receives: the plan, digits, helpers'
 * seeds, binding, joint randomness, proofs and the leader's shares, from the client key; a gram
 * or moments study's also from its rows (clipping, proved scale, two noise blocks, witness); a
 * study with parties' blocks from its party key, individuals and rows (partiesVector).
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { Keystream } from "../src/keystream.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, hex, unhex } from "../src/bytes.js";
import { encodeNoisy } from "../src/batch.js";
import { mapper } from "../src/features.js";
import { INV_SQRT2, provedScale, serverStd, spacing, studyId, validateStudy, width, type Study } from "../src/study.js";
import type { NormBound } from "../src/validity/flp.js";
import { GramNorm, hypot } from "../src/validity/gram.js";
import { partyPlan, validityPlan, proveBatch, witnessRows, type ValidityPlan } from "../src/validity/study.js";
import { blockMediaType, blocksBody, partySigns, prepareBlocks, pseudonym } from "../src/parties.js";
import { blockPrefixes, CONTENT_SEED, CONTENT_SHARE } from "../src/binding.js";
import { clip } from "../src/features.js";
import { partyClipBounds } from "../src/study.js";
import { vectors } from "./helpers.js";

function checkPlan(plan: ValidityPlan, want: any, label: string): void {
  assert.equal(plan.shift, want.grid_shift, label);
  assert.equal(plan.t, want.t, label);
  assert.equal(plan.r2, BigInt(want.r2), label);
  assert.equal(plan.q, want.q, label);
  assert.equal(plan.circuit.half, BigInt(want.H), label);
  assert.equal(plan.circuit.slackDigits, want.slack_digits, label);
  assert.equal(plan.circuit.inputLen, want.input_len, label);
  assert.equal(plan.circuit.proofLen, want.proof_len, label);
  assert.equal(plan.circuit.verifierLen, want.verifier_len, label);
  assert.equal(plan.leaderWidth, want.leader_width, label);
}

/** The leader's payloads as decimal strings, one list per report. */
function leaderElements(payloads: Uint8Array[]): string[][] {
  return payloads.map((p) => {
    const dv = new DataView(p.buffer, p.byteOffset, p.length);
    return Array.from({ length: p.length / 8 }, (_, k) => dv.getBigUint64(8 * k, true).toString());
  });
}

/**
 * A signed study with two parties and validity (docs/validity.md section 13): from the vector's
 * inputs (party key, individuals, rows; each party's noise and client keys) every party's
 * pseudonyms, signs, plan, clipped signed blocks, noisy ring vectors, digits, block prefixes,
 * helpers' seeds, binding, block ids, joint randomness, proofs and the leader's shares, byte for
 * byte; then the client's one-keystream path (prepareBlocks) against the same steps, and its bodies.
 */
function partiesVector(v: any): void {
  const study = v.study as Study;
  test(`validity.json ${v.id}: pseudonyms, party-key signs, the parties' plans`, () => {
    validateStudy(study);
    assert.equal(studyId(study), v.study_id);
    const key = unhex(v.party_key);
    const ps = (v.individuals as string[]).map((x) => pseudonym(key, v.study_id, x));
    assert.deepEqual(ps.map(hex), v.pseudonyms);
    assert.deepEqual(partySigns(key, v.study_id, ps), (v.signs as number[]).map((s) => (s ? -1 : 1)));
    assert.throws(() => validityPlan(study), /partyPlan/);
    assert.equal(Math.max(...study.parties!.map((_, j) => partyPlan(study, j).circuit.verifierLen)), v.verifier_len);
    for (const p of v.parties) checkPlan(partyPlan(study, p.index), p.plan, p.party);
  });
  for (const p of v.parties) {
    test(`validity.json ${v.id}: party ${p.party}'s proved blocks, byte for byte`, () => {
      const plan = partyPlan(study, p.index);
      const cols = study.parties![p.index].columns.map((c) => study.columns.indexOf(c));
      const rows = (v.rows as number[][]).map((r) => cols.map((c) => r[c]));
      const signs = (v.signs as number[]).map((s) => (s ? -1 : 1));
      const bound = partyClipBounds(study)![p.index].clip_bound;
      const clipped = rows.map((r) => clip(r, bound));
      assert.deepEqual(clipped.map((r, i) => r.map((x) => signs[i] * x)), p.blocks);
      const d = cols.length;
      const { noisy } = encodeNoisy(study, clipped, signs, new Keystream(unhex(p.noise_key)), d);
      assert.deepEqual(Array.from(noisy, String), p.encoded.flat());
      const pseudonyms = (v.pseudonyms as string[]).map(unhex);
      const prefixes = blockPrefixes(v.study_id, p.index, pseudonyms);
      assert.deepEqual(prefixes.map(hex), p.block_prefixes);
      const b = proveBatch(study, v.study_id, plan, noisy, new Keystream(unhex(p.client_key)), p.full, null, null, prefixes);
      assert.deepEqual(b.inputs.map((r) => r.map(String)), p.input);
      assert.deepEqual(b.reportIds.map(hex), p.report_ids);
      b.servers.forEach((s, j) => {
        assert.equal(s.content, j === p.full ? CONTENT_SHARE : CONTENT_SEED);
        assert.equal(hex(Uint8Array.from(s.proofs.flatMap((x) => Array.from(x)))), p.binding[j], `binding ${j}`);
        if (j !== p.full) assert.equal(hex(Uint8Array.from(s.payloads.flatMap((x) => Array.from(x)))), p.helper_seeds[String(j)], `seeds ${j}`);
      });
      assert.deepEqual(b.proofs.map((r) => r.map(String)), p.proof);
      assert.deepEqual(leaderElements(b.servers[p.full].payloads), p.leader);
      // the same blocks as report ids would be other ids (the prefix is what makes them blocks)
      const asReports = proveBatch(study, v.study_id, plan, noisy, new Keystream(unhex(p.client_key)), p.full);
      assert.notDeepEqual(asReports.reportIds.map(hex), p.report_ids);
    });
  }
  test(`validity.json ${v.id}: prepareBlocks is noise then proof from one keystream, with plaintext bodies of section 4c`, () => {
    const key = sha256(ascii("a party's batch key"));
    const pseudonyms = (v.pseudonyms as string[]).map(unhex);
    const signs = (v.signs as number[]).map((s) => (s ? -1 : 1));
    const N = study.servers.length;
    for (const p of v.parties) {
      const cols = study.parties![p.index].columns.map((c) => study.columns.indexOf(c));
      const rows = (v.rows as number[][]).map((r) => cols.map((c) => r[c]));
      for (let full = 0; full < N; full++) {
        const got = prepareBlocks(study, v.study_id, p.party, pseudonyms, rows, key, { signs, full });
        const ks = new Keystream(key);
        const bound = partyClipBounds(study)![p.index].clip_bound;
        const { noisy } = encodeNoisy(study, rows.map((r) => clip(r, bound)), signs, ks, cols.length);
        const want = proveBatch(study, v.study_id, partyPlan(study, p.index), noisy, ks, full, null, null, blockPrefixes(v.study_id, p.index, pseudonyms));
        assert.deepEqual(got.blockIds.map(hex), want.reportIds.map(hex));
        assert.deepEqual(got.servers, want.servers);
        for (let j = 0; j < N; j++) {
          const body = blocksBody(got, j);
          const share = j === full ? 8 * p.plan.leader_width : 32;
          assert.equal(body.length, rows.length * (32 + 16 * N + share));
          assert.equal(hex(body.subarray(16, 32)), v.pseudonyms[0]);
          assert.equal(blockMediaType(p.party, j !== full), j === full ? `application/x-dpsketch-blocks; party=${p.party}` : `application/x-dpsketch-block-seeds; party=${p.party}`);
        }
      }
      assert.throws(() => prepareBlocks(study, v.study_id, p.party, pseudonyms, rows, key), /party-key sign/);
      assert.throws(() => prepareBlocks(study, v.study_id, p.party, pseudonyms, rows, key, { signs, full: N }), /a server position/);
    }
  });
}

for (const v of vectors("validity.json")) {
  if (v.type === "validity_parties_study") {
    partiesVector(v);
    continue;
  }
  if (v.plan.circuit === "GramNorm") {
    // a gram or moments study (circuit GramNorm, docs/validity.md section 12): from the rows
    // themselves, the clipped rows, the proved scale, the noise in two blocks, the witness and the
    // noise e = u - psi(r) (the vector's noise keystream key is the generator's,
    // scripts/make_validity_vectors.py: SHA-256("dpsketch/validity-vector/1/" || id || "/noise"))
    test(`validity.json ${v.id}: gram plan, rows to noisy features, witness`, () => {
      const study = v.study as Study;
      const plan = validityPlan(study);
      const c = plan.circuit as GramNorm;
      assert.ok(c instanceof GramNorm);
      assert.equal(plan.tUpper, v.plan.t_upper);
      assert.equal(c.lin, BigInt(v.plan.lin));
      assert.equal(c.countUnit, BigInt(v.plan.count_unit));
      assert.equal(c.r2Row, BigInt(v.plan.r2_row));
      assert.equal(c.qRow, v.plan.q_row);
      assert.equal(c.halfRow, BigInt(v.plan.H_row));
      assert.equal(c.rowSlackDigits, v.plan.row_slack_digits);
      assert.deepEqual(provedScale(study), v.proved_scale);
      const mp = mapper(study);
      const clipped = v.rows.map((r: number[]) => mp.clipped(r));
      assert.deepEqual(clipped, v.clipped);
      const witness = witnessRows(plan, clipped);
      assert.deepEqual(witness.map((r) => r.map(Number)), v.witness);
      const ks = new Keystream(sha256(ascii(`dpsketch/validity-vector/1/${v.id}/noise`)));
      const W = width(study);
      const { noisy } = encodeNoisy(study, clipped.map((a: number[]) => mp.features(a)), null, ks, W);
      assert.deepEqual(Array.from(noisy, String), v.encoded.flat());
      const units = witness.map((r, i) => {
        const psi = c.features(r);
        return psi.map((p, j) => Number(BigInt.asIntN(64, noisy[i * W + j]) / (1n << BigInt(plan.shift)) - p));
      });
      assert.deepEqual(units, v.units);
    });
  }
  test(`validity.json ${v.id}`, () => {
    const study = v.study as Study;
    assert.equal(studyId(study), v.study_id);
    const plan = validityPlan(study);
    checkPlan(plan, v.plan, v.id);
    const noisy = BigUint64Array.from(v.encoded.flat().map((x: string) => BigInt(x)));
    const ks = new Keystream(unhex(v.client_key));
    const b = proveBatch(study, v.study_id, plan, noisy, ks, v.full, v.onehot, v.clipped ?? null);
    if (v.plan.unit !== null) assert.equal((plan.circuit as NormBound).oneHot!.unit, BigInt(v.plan.unit));
    if (v.plan.blocks !== null) assert.deepEqual((plan.circuit as NormBound).oneHot!.blocks, v.plan.blocks);
    assert.deepEqual(b.inputs.map((r) => r.map(String)), v.input);
    assert.deepEqual(b.reportIds.map(hex), v.report_ids);
    b.servers.forEach((s, j) => {
      assert.equal(hex(Uint8Array.from(s.proofs.flatMap((p) => Array.from(p)))), v.binding[j], `binding ${j}`);
      if (j !== v.full) assert.equal(hex(Uint8Array.from(s.payloads.flatMap((p) => Array.from(p)))), v.helper_seeds[String(j)], `seeds ${j}`);
    });
    assert.deepEqual(b.proofs.map((r) => r.map(String)), v.proof);
    assert.deepEqual(leaderElements(b.servers[v.full].payloads), v.leader);
  });
}

test("hypot is Python's math.hypot (correctly rounded) where Math.hypot is an ulp off", () => {
  // gram residuals hypot(delta, delta (2 B + delta)) and Python 3.11's math.hypot of them (Node
  // 20's Math.hypot misses each by an ulp, and 12,501 of 40,000 such pairs measured); R^2 of a
  // gram study (docs/protocol.md section 4b) depends on this double
  const cases: [number, number, number][] = [
    [0.01295556558732578, 0.25927915842620314, 0.25960263610735473],
    [0.0013810679320049757, 0.0013829752806377882, 0.0019544741644922474],
    [0.3801726581436387, 7.747984412872774, 7.757305828193153],
    [0.09757809372497497, 0.20467767182494995, 0.22674751094263837],
  ];
  for (const [x, y, want] of cases) {
    assert.equal(hypot(x, y), want);
  }
  assert.equal(hypot(0, 0.5), 0.5);
  assert.equal(hypot(3, 4), 5);
});

test("validateStudy accepts validity on every kind, with parties too, at the floor too, and refuses it without any noise", () => {
  const studies = vectors("validity.json").map((v) => v.study as Study);
  assert.deepEqual([...new Set(studies.map((s) => s.kind))].sort(), ["gram", "histogram", "l1", "moments", "sketch"]);
  for (const s of studies) validateStudy(s);
  assert.ok(studies.some((s) => s.parties));
  const sketch = studies.find((s) => s.kind === "sketch")!;
  assert.throws(() => validateStudy({ ...sketch, sigma: 0, server_sigma: 0 }), /validity/);
  // epsilon at the floor: no client noise, the servers' alone (docs/validity.md section 14)
  const floors = studies.filter((s) => s.sigma === 0);
  assert.deepEqual(floors.map((s) => s.kind).sort(), ["gram", "histogram", "sketch"]);
  for (const s of floors) assert.ok(s.server_sigma > 0 && s.epsilon === s.epsilon_floor);
});

test("a study at the floor: the grid from the servers' noise and max_reports, t = 0, R^2 = ceil((B / h)^2)", () => {
  // validity.floor_grid: the coarsest grid with max_reports h / 2 <= (a server's noise) / 16,
  // and the plan's allowance t sqrt(...) is 0: R^2 = ceil((B / h)^2) for a sketch study, 0 for a
  // histogram (its one-hot cell is proved exactly, and it has no noise of its own)
  for (const v of vectors("validity.json").filter((x) => x.study.sigma === 0)) {
    const study = v.study as Study;
    const plan = validityPlan(study);
    assert.equal(plan.t, 0, v.id);
    const h = spacing(study);
    const smallest = serverStd(study) * (study.kind === "gram" ? INV_SQRT2 : 1);
    assert.ok((study.max_reports * h) / 2 <= smallest / 16, v.id);
    const coarser = study.kind === "gram" ? 4 : 2; // a gram study's grid is 4^-m
    assert.ok((study.max_reports * coarser * h) / 2 > smallest / 16, `${v.id}: the coarsest such grid`);
    if (study.kind === "sketch") assert.equal(plan.r2, BigInt(Math.ceil((study.row_bound / h) ** 2)));
    if (study.kind === "histogram") assert.equal(plan.r2, 0n);
    if (study.kind === "gram") assert.equal(plan.tUpper, 0);
    // from max_reports = 2^17 on, at most 2^20 steps per server noise (validity.FLOOR_MAX_STEPS)
    const big = { ...study, max_reports: 10_000_000 };
    const steps = smallest / spacing(big);
    assert.ok(steps >= 2 ** 20 && steps < 2 ** (study.kind === "gram" ? 22 : 21), `${v.id}: ${steps}`);
  }
});
