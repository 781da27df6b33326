/**
 * The add/remove accountant's parts on their own (conformance/accounting.json checks the whole
 * against the reference, accounting.test.ts): the normal and chi-square tails against scipy's
 * values to 1e-13 relative, deep in both tails; a pmf's mass and the infinite-loss rule; the FFT
 * convolution against the direct one; and the loss laws against what they must be: a ratio
 * barely above 1 gives the Gaussian shift's epsilon (from above, within the grid), and epsilon
 * grows with the shift, the ratio and the width.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { chi2CdfSf, chi2Quantile, erfc, ndtr } from "../src/special.js";
import { addRemoveEpsilon, convolve, discretise, epsilonForDelta, LOSS_GRID, shiftScaleLoss, varianceLoss } from "../src/pld.js";
import { gaussianEpsilon } from "../src/accounting.js";

const rel = (got: number, want: number, tol: number, what: string) =>
  assert.ok(Math.abs(got - want) <= tol * Math.abs(want), `${what}: ${got} against ${want}`);

test("normal CDF and erfc against scipy, both tails", () => {
  rel(ndtr(-10), 7.61985302416047e-24, 1e-13, "ndtr(-10)");
  rel(ndtr(-1), 0.15865525393145707, 1e-14, "ndtr(-1)");
  rel(ndtr(3), 0.9986501019683699, 1e-15, "ndtr(3)");
  rel(erfc(0.5), 0.4795001221869535, 1e-14, "erfc(0.5)");
  rel(erfc(5), 1.5374597944280347e-12, 1e-13, "erfc(5)");
  assert.ok(erfc(27) >= 0 && erfc(27) < 1e-300);
});

test("chi-square CDF and survival against scipy, small and large dof, both tails", () => {
  const cases: [number, number, number, number][] = [
    [1, 1, 0.6826894921370859, 0.31731050786291115],
    [0.01, 9, 8.408755369388955e-13, 0.9999999999991591],
    [100, 10, 1.0, 5.4497019829205215e-17],
    [2000, 1000, 1.0, 4.1436785914539184e-69],
    [900, 1000, 0.01071723809128973, 0.9892827619087102],
    [0.004, 3, 6.72028513215418e-05, 0.9999327971486784],
  ];
  for (const [x, k, cdf, sf] of cases) {
    const [c, s] = chi2CdfSf(x, k);
    rel(c, cdf, 1e-12, `cdf(${x}; ${k})`);
    rel(s, sf, 1e-12, `sf(${x}; ${k})`);
  }
  rel(chi2Quantile(1e-18, 9, false), 0.00048196687932564595, 1e-10, "ppf(1e-18; 9)");
  rel(chi2Quantile(1e-18, 9, true), 105.90540455687416, 1e-10, "isf(1e-18; 9)");
});

test("a discretised loss law keeps its mass; what falls outside is infinite loss", () => {
  const pmf = discretise(shiftScaleLoss(1, 1.3, true), LOSS_GRID);
  const total = pmf.probs.reduce((a, b) => a + b, 0);
  assert.ok(Math.abs(total + pmf.infinity - 1) < 1e-12 && pmf.infinity < 1e-15, `${total} ${pmf.infinity}`);
  const rest = discretise(varianceLoss(1.3, 20, false), LOSS_GRID);
  assert.ok(rest.infinity < 1e-15 && rest.probs[0] === 0); // the first bin holds nothing: pessimistic
  // an infinite-loss mass above delta: no finite epsilon
  assert.equal(epsilonForDelta({ ...pmf, infinity: 1e-5 }, 1e-6), Infinity);
});

test("FFT convolution equals the direct one", () => {
  const a = new Float64Array(300).map((_, i) => Math.exp(-((i - 150) ** 2) / 800));
  const b = new Float64Array(90).map((_, i) => 1 / (1 + i));
  const fast = convolve(a, b);
  const direct = new Float64Array(a.length + b.length - 1);
  for (let i = 0; i < a.length; i++) for (let j = 0; j < b.length; j++) direct[i + j] += a[i] * b[j];
  for (let i = 0; i < direct.length; i++) assert.ok(Math.abs(fast[i] - direct[i]) < 1e-12 * Math.max(...direct), `${i}`);
});

test("the presence pair: a ratio barely above 1 is the Gaussian shift, and epsilon grows with every parameter", () => {
  for (const shift of [0.3, 1, 2.5]) {
    const g = gaussianEpsilon(shift, 1e-6);
    const e = addRemoveEpsilon(shift, 1 + 1e-9, 5, 1e-6);
    assert.ok(e >= g - 1e-9 && e <= g + 3 * LOSS_GRID, `shift ${shift}: ${e} against the Gaussian's ${g}`);
  }
  const base = addRemoveEpsilon(1, 1.05, 10, 1e-6);
  assert.ok(addRemoveEpsilon(1.1, 1.05, 10, 1e-6) > base);
  assert.ok(addRemoveEpsilon(1, 1.1, 10, 1e-6) > base);
  assert.ok(addRemoveEpsilon(1, 1.05, 40, 1e-6) > base);
  assert.ok(addRemoveEpsilon(1, 1.05, 10, 1e-5) < base);
});
