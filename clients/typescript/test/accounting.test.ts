/**
 * The client's recomputation of a study's promise: every unsigned replace-one study of
 * study_ids.json (designed by the reference to epsilon 1, floor 4) recomputes to at most its
 * targets and within 1e-5 of them, a study whose noise was halved is refused, a signed one is an upper bound.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { checkPromise, gaussianDelta, gaussianEpsilon, replaceOneEpsilon } from "../src/accounting.js";
import type { Study } from "../src/study.js";
import { vectors } from "./helpers.js";

const studies = vectors("study_ids.json").filter((v) => v.type === "study").map((v) => ({ id: v.id, study: v.input as Study }));

for (const { id, study } of studies) {
  test(`accounting ${id}`, () => {
    const eps = replaceOneEpsilon(study, study.lambda_star);
    const floor = replaceOneEpsilon(study, 1);
    if (!study.secret_sign) {
      // at most the target (the study's check, section 2), and within 1e-5 of it (the reference's
      // calibration leaves about 1.1e-6 to spare)
      assert.ok(eps <= study.epsilon * (1 + 1e-9) && eps >= study.epsilon * (1 - 1e-5), `${id}: epsilon ${eps}`);
      assert.ok(floor <= study.epsilon_floor! * (1 + 1e-9) && floor >= study.epsilon_floor! * (1 - 1e-5), `${id}: floor ${floor}`);
      assert.equal(checkPromise(study).status, "verified");
      const weaker = { ...study, sigma: study.sigma / 2, server_sigma: study.server_sigma / 2 };
      assert.throws(() => checkPromise(weaker), /promises epsilon/);
    } else {
      // the plain Gaussian's epsilon is above the target; the sign mixture's delta bound meets it
      assert.ok(eps > study.epsilon);
      assert.equal(checkPromise(study).status, "verified");
      const weaker = { ...study, sigma: study.sigma * 0.9, server_sigma: study.server_sigma * 0.9 };
      assert.throws(() => checkPromise(weaker), /promises epsilon/);
    }
  });
}

test("Gaussian delta: mu = 1, eps = 1 (Balle and Wang's closed form)", () => {
  // Phi(-0.5) - e Phi(-1.5) = 0.3085375387259869 - 2.718281828459045 * 0.06680720126885807
  assert.ok(Math.abs(gaussianDelta(1, 1) - (0.3085375387259869 - Math.E * 0.06680720126885807)) < 1e-14);
});

/*
 * conformance/accounting.json: the accounting as the reference computes it. Every
 * presence pair's epsilon (plain and signed, on the 1e-3 grid and a coarser one) and every
 * add/remove study's epsilon and floor within the vector's tolerance, and the same verdict: the
 * designed studies accepted, the ones promising 1e-7 more than their noise gives (or with their
 * noise shrunk) refused, one promising 5e-10 more accepted (the reference's 1e-9 tolerance).
 */
import { addRemoveStudyEpsilon } from "../src/accounting.js";
import { addRemoveEpsilon, presenceEpsilon } from "../src/pld.js";

const accounting = vectors("accounting.json");
const near = (got: number, want: number | null, tol: { rtol: number; atol: number }, what: string) => {
  if (want === null) return assert.equal(got, Infinity, `${what}: ${got} should be unbounded`);
  assert.ok(Math.abs(got - want) <= tol.atol + tol.rtol * Math.abs(want), `${what}: ${got} against ${want}`);
};

for (const v of accounting.filter((v) => v.type === "presence")) {
  test(`accounting.json ${v.id}`, () => {
    const got = v.signed ? presenceEpsilon(v.shift, v.ratio, v.width, v.delta)
      : v.ratio === 1 ? gaussianEpsilon(v.shift, v.delta) : addRemoveEpsilon(v.shift, v.ratio, v.width, v.delta);
    near(got, v.epsilon, v.tolerance, v.id);
  });
}

for (const v of accounting.filter((v) => v.type === "study_guarantee")) {
  test(`accounting.json ${v.id} (${v.verdict})`, () => {
    const study = v.study as Study;
    // add/remove: the presence pair's PLD; replace-one: the Gaussian (a signed replace-one
    // study's epsilon is the mixture's root, which this client only tests at the target: verdict)
    const of = study.neighbouring === "add-remove" ? addRemoveStudyEpsilon : study.secret_sign ? null : replaceOneEpsilon;
    if (of) {
      near(of(study, study.lambda_star), v.epsilon, v.tolerance, `${v.id} epsilon`);
      near(of(study, 1), v.floor_epsilon, v.tolerance, `${v.id} floor`);
    }
    if (v.verdict === "accepted") assert.equal(checkPromise(study).status, "verified");
    else assert.throws(() => checkPromise(study), /promises epsilon/);
  });
}

test("accounting.json covers every kind, the sign, both verdicts and a coarse grid", () => {
  const studies = accounting.filter((v) => v.type === "study_guarantee");
  const kinds = new Set(studies.map((v) => (v.study as Study).kind));
  for (const k of ["sketch", "gram", "moments", "histogram", "l1"]) assert.ok(kinds.has(k as Study["kind"]), k);
  assert.ok(studies.some((v) => (v.study as Study).secret_sign && v.verdict === "refused"));
  assert.ok(studies.some((v) => (v.study as Study).parties));
  assert.ok(studies.filter((v) => v.verdict === "refused").length >= 5);
  for (const notion of ["add-remove", "replace-one"])
    for (const verdict of ["accepted", "refused"])
      assert.ok(studies.some((v) => (v.study as Study).neighbouring === notion && v.verdict === verdict), `${notion} ${verdict}`);
  assert.ok(accounting.some((v) => v.type === "presence" && v.ratio >= 10 && v.width >= 200));
});
