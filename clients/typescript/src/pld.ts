/**
 * The add/remove accounting of docs/protocol.md section 5 ("Per-report epsilon"), computed as the
 * reference computes it (dpsketch/protocol/accounting.py and secret_sign.py with dp-accounting's
 * dense privacy-loss distributions), so that a client reaches the same verdict on a study:
 *
 * one honest report's presence is the pair P = N(M e_1, r I_w) against Q = N(0, I_w). Its loss
 * ln p/q is L1 + L2, L1 the shift-and-scale part along e_1 (a quadratic of a Gaussian), L2 the
 * variance change of the other w - 1 coordinates (a scaled chi-square); with the secret sign,
 * L1 is the loss of the mixture (N(M, r) + N(-M, r))/2 against N(0, 1) and L2 has w degrees of
 * freedom. Each law is discretised pessimistically (the mass of ((j-1) g, j g] placed at j g,
 * g = 10^-3, coarser when a law would need more than 400,000 points; what lies outside its
 * 9.5-sigma / 10^-18 range counts as infinite loss), the two are convolved, and epsilon is read
 * off at delta in both directions (removing: ln p/q under P; adding: ln q/p under Q). The result
 * is an upper bound on the true epsilon, tight to the grid, and the same bound the reference
 * states (within floating-point noise: the vectors of conformance/accounting.json).
 */
import { chi2CdfSf, chi2Quantile, ndtr } from "./special.js";

/** Loss grid of the add/remove computation (accounting.LOSS_GRID). */
export const LOSS_GRID = 1e-3;
/** Most grid points of one discretised loss law; a wider law gets a coarser grid. */
export const MAX_GRID_POINTS = 400_000;
/** Probability left out at each end of a chi-square loss law. */
const TAIL_MASS = 1e-18;
/** Standard deviations kept of a Gaussian coordinate: P[|Z| > 9.5] ~ 2e-21. */
const Z_CUT = 9.5;

/** A loss law: its range and the masses of the bins between consecutive (ascending) edges. */
export interface LossLaw {
  lo: number;
  hi: number;
  masses: (edges: Float64Array) => Float64Array;
}

/** A dense pessimistic PLD pmf: probs[i] is the mass at loss (lower + i) * grid. */
export interface Pmf {
  grid: number;
  lower: number;
  probs: Float64Array;
  infinity: number;
}

/** P[lo < Z <= hi] for a standard normal Z, from whichever tail keeps precision. */
function interval(lo: number, hi: number): number {
  const out = lo > 0 ? ndtr(-lo) - ndtr(-hi) : ndtr(hi) - ndtr(lo);
  return out > 0 ? out : 0;
}

/**
 * L1(y) = a y^2 + b y + c, a = (r-1)/2r, b = M/r, c = -M^2/2r - ln(r)/2, under y ~ N(M, r)
 * (`upper`, the remove direction), or -L1 under y ~ N(0, 1) (add).
 */
export function shiftScaleLoss(shift: number, ratio: number, upper: boolean): LossLaw {
  const r = ratio, m = shift;
  const a = (r - 1) / (2 * r), b = m / r, c = (-m * m) / (2 * r) - 0.5 * Math.log(r);
  const mean = upper ? m : 0, sd = upper ? Math.sqrt(r) : 1;
  const sign = upper ? 1 : -1;
  const vertex = -b / (2 * a);
  const ys = [mean - Z_CUT * sd, mean + Z_CUT * sd];
  const values = ys.map((y) => a * y * y + b * y + c);
  if (ys[0] < vertex && vertex < ys[1]) values.push(a * vertex * vertex + b * vertex + c);
  let lo = sign * Math.min(...values), hi = sign * Math.max(...values);
  if (!upper) [lo, hi] = [hi, lo];
  /** standardised y- <= y+ with L1(y) = x (the vertex where L1 never reaches x) */
  const roots = (x: number): [number, number] => {
    const disc = b * b - 4 * a * (c - x);
    if (!(disc >= 0)) return [(vertex - mean) / sd, (vertex - mean) / sd];
    const q = -0.5 * (b + Math.sqrt(disc));
    const r1 = q !== 0 ? q / a : -Infinity, r2 = q !== 0 ? (c - x) / q : Infinity;
    return [(Math.min(r1, r2) - mean) / sd, (Math.max(r1, r2) - mean) / sd];
  };
  const masses = (edges: Float64Array): Float64Array => {
    const n = edges.length;
    const zm = new Float64Array(n), zp = new Float64Array(n);
    for (let i = 0; i < n; i++) [zm[i], zp[i]] = roots(upper ? edges[i] : -edges[i]);
    const out = new Float64Array(n - 1);
    for (let i = 0; i < n - 1; i++) {
      // remove: L1 <= x is y in [y-, y+], rising and falling with x; add: the hole shrinks with x
      out[i] = upper ? interval(zp[i], zp[i + 1]) + interval(zm[i + 1], zm[i])
        : interval(zm[i], zm[i + 1]) + interval(zp[i + 1], zp[i]);
    }
    return out;
  };
  return { lo, hi, masses };
}

/**
 * L2 = (r-1)/2 X - dof/2 ln r, X ~ chi^2_dof (`upper`), or -L2 with L2 = (r-1)/2r X - dof/2 ln r.
 */
export function varianceLoss(ratio: number, dof: number, upper: boolean): LossLaw {
  const r = ratio;
  const alpha = upper ? (r - 1) / 2 : (r - 1) / (2 * r);
  const beta = -0.5 * dof * Math.log(r);
  const xLo = chi2Quantile(TAIL_MASS, dof, false), xHi = chi2Quantile(TAIL_MASS, dof, true);
  const lo = upper ? alpha * xLo + beta : -(alpha * xHi + beta);
  const hi = upper ? alpha * xHi + beta : -(alpha * xLo + beta);
  const masses = (x: Float64Array): Float64Array => {
    const n = x.length;
    const edge = new Float64Array(n), cdf = new Float64Array(n), sf = new Float64Array(n);
    for (let i = 0; i < n; i++) {
      edge[i] = upper ? (x[i] - beta) / alpha : (-x[i] - beta) / alpha;
      [cdf[i], sf[i]] = chi2CdfSf(edge[i], dof);
    }
    const out = new Float64Array(n - 1);
    for (let i = 0; i < n - 1; i++) {
      const v = upper ? (edge[i] > dof ? sf[i] - sf[i + 1] : cdf[i + 1] - cdf[i])
        : (edge[i + 1] > dof ? sf[i + 1] - sf[i] : cdf[i] - cdf[i + 1]);
      out[i] = v > 0 ? v : 0;
    }
    return out;
  };
  return { lo, hi, masses };
}

/**
 * The secret sign's one-coordinate loss: L(y) = ln[(N(M, R) + N(-M, R))/2 / N(0, 1)](y) under
 * the mixture (`upper`) or -L(y) under N(0, 1). L rises with |y|, so a bin is a pair of |y|
 * intervals whose ends come from an 80-step bisection kept on the pessimistic side.
 */
export function mixtureLoss(shift: number, ratio: number, upper: boolean): LossLaw {
  const m = shift, r = ratio;
  const c = -0.5 * Math.log(r) - (m * m) / (2 * r), quad = 0.5 * (1 - 1 / r), slope = m / r;
  const sd = Math.sqrt(r);
  const loss = (s: number) => {
    const v = Math.abs(slope * s);
    return c + quad * s * s + v + Math.log1p(Math.exp(-2 * v)) - Math.LN2;
  };
  const sMax = upper ? m + Z_CUT * sd : Z_CUT;
  const top = loss(sMax);
  const lo = upper ? c : -top, hi = upper ? top : -c;
  const invert = (x: number, low: boolean) => {
    let a = 0, b = 2 * sMax + 1;
    for (let i = 0; i < 80; i++) {
      const mid = 0.5 * (a + b);
      if (loss(mid) <= x) a = mid;
      else b = mid;
    }
    return low ? a : b;
  };
  const survival = (s: number) => (upper ? ndtr((m - s) / sd) + ndtr((-m - s) / sd) : 2 * ndtr(-s));
  const masses = (edges: Float64Array): Float64Array => {
    const n = edges.length;
    const surv = new Float64Array(n);
    for (let i = 0; i < n; i++) surv[i] = survival(upper ? invert(edges[i], true) : invert(-edges[i], false));
    const out = new Float64Array(n - 1);
    for (let i = 0; i < n - 1; i++) {
      const v = upper ? surv[i] - surv[i + 1] : surv[i + 1] - surv[i];
      out[i] = v > 0 ? v : 0;
    }
    return out;
  };
  return { lo, hi, masses };
}

function span(laws: (LossLaw | null)[]): number {
  return laws.reduce((s, l) => s + (l ? l.hi - l.lo : 0), 0);
}

/** The pessimistic pmf of a law on the grid: bin ((j-1) g, j g] at j g; the rest at infinity. */
export function discretise(law: LossLaw, grid: number): Pmf {
  const first = Math.floor(law.lo / grid), last = Math.ceil(law.hi / grid);
  if (last - first > 4 * MAX_GRID_POINTS) throw new Error("loss law too wide for the grid");
  const edges = new Float64Array(last - first + 1);
  for (let i = 0; i < edges.length; i++) edges[i] = (first + i) * grid;
  const probs = new Float64Array(edges.length);
  probs.set(law.masses(edges), 1);
  return { grid, lower: first, probs, infinity: Math.max(0, 1 - pairwiseSum(probs, 0, probs.length)) };
}

/** Pairwise summation as numpy's (blocks of 128 in 8 lanes): the infinite-loss mass 1 - sum rounds alike. */
function pairwiseSum(a: Float64Array, start: number, n: number): number {
  if (n < 8) {
    let s = 0;
    for (let i = 0; i < n; i++) s += a[start + i];
    return s;
  }
  if (n <= 128) {
    const r = [a[start], a[start + 1], a[start + 2], a[start + 3], a[start + 4], a[start + 5], a[start + 6], a[start + 7]];
    let i = 8;
    for (; i < n - (n % 8); i += 8) for (let k = 0; k < 8; k++) r[k] += a[start + i + k];
    let s = (r[0] + r[1]) + (r[2] + r[3]) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) s += a[start + i];
    return s;
  }
  let half = n >> 1;
  half -= half % 8;
  return pairwiseSum(a, start, half) + pairwiseSum(a, start + half, n - half);
}

/** In-place iterative radix-2 FFT (inverse without the 1/n scale). */
function fft(re: Float64Array, im: Float64Array, inverse: boolean): void {
  const n = re.length;
  for (let i = 1, j = 0; i < n; i++) {
    let bit = n >> 1;
    for (; j & bit; bit >>= 1) j ^= bit;
    j ^= bit;
    if (i < j) {
      [re[i], re[j]] = [re[j], re[i]];
      [im[i], im[j]] = [im[j], im[i]];
    }
  }
  for (let len = 2; len <= n; len <<= 1) {
    const angle = ((inverse ? 2 : -2) * Math.PI) / len;
    const half = len >> 1;
    const wr = new Float64Array(half), wi = new Float64Array(half);
    for (let k = 0; k < half; k++) {
      wr[k] = Math.cos(angle * k);
      wi[k] = Math.sin(angle * k);
    }
    for (let i = 0; i < n; i += len) {
      for (let k = 0; k < half; k++) {
        const a = i + k, b = a + half;
        const xr = re[b] * wr[k] - im[b] * wi[k], xi = re[b] * wi[k] + im[b] * wr[k];
        re[b] = re[a] - xr;
        im[b] = im[a] - xi;
        re[a] += xr;
        im[a] += xi;
      }
    }
  }
}

/** The full linear convolution of two mass vectors (directly when one is short, else by FFT). */
export function convolve(a: Float64Array, b: Float64Array): Float64Array {
  const n = a.length + b.length - 1;
  const out = new Float64Array(n);
  if (Math.min(a.length, b.length) <= 64) {
    for (let i = 0; i < a.length; i++) {
      const ai = a[i];
      if (ai === 0) continue;
      for (let j = 0; j < b.length; j++) out[i + j] += ai * b[j];
    }
    return out;
  }
  let size = 1;
  while (size < n) size <<= 1;
  const ar = new Float64Array(size), ai = new Float64Array(size), br = new Float64Array(size), bi = new Float64Array(size);
  ar.set(a);
  br.set(b);
  fft(ar, ai, false);
  fft(br, bi, false);
  for (let i = 0; i < size; i++) {
    const r = ar[i] * br[i] - ai[i] * bi[i];
    ai[i] = ar[i] * bi[i] + ai[i] * br[i];
    ar[i] = r;
  }
  fft(ar, ai, true);
  for (let i = 0; i < n; i++) out[i] = ar[i] / size;
  return out;
}

/** The pmf of the sum of two independent losses on one grid (no tail truncation). */
export function compose(p: Pmf, q: Pmf): Pmf {
  if (p.grid !== q.grid) throw new Error("pmfs compose only on a common grid");
  return { grid: p.grid, lower: p.lower + q.lower, probs: convolve(p.probs, q.probs),
    infinity: p.infinity + q.infinity - p.infinity * q.infinity };
}

/**
 * The smallest epsilon >= 0 whose hockey-stick divergence is at most delta (Infinity when the
 * infinite-loss mass alone exceeds it), scanning from the largest loss down as dp-accounting does.
 */
export function epsilonForDelta(pmf: Pmf, delta: number): number {
  if (pmf.infinity > delta) return Infinity;
  let upper = pmf.infinity, lower = 0;
  let loss = (pmf.lower + pmf.probs.length - 1) * pmf.grid;
  for (let i = pmf.probs.length - 1; i >= 0; i--) {
    if (upper > delta && lower > 0 && Math.log((upper - delta) / lower) >= loss) break;
    const prob = pmf.probs[i];
    upper += prob;
    lower += Math.exp(-loss) * prob;
    if (upper >= delta && lower === 0) return Math.max(0, loss);
    loss += -pmf.grid;
  }
  if (upper <= lower + delta) return 0;
  return Math.log((upper - delta) / lower);
}

function lawPmf(one: LossLaw, rest: LossLaw | null, grid: number): Pmf {
  const pmf = discretise(one, grid);
  return rest ? compose(pmf, discretise(rest, grid)) : pmf;
}

/**
 * epsilon at delta between P = N(shift e_1, ratio I_width) and Q = N(0, I_width), both ways
 * (accounting.add_remove_epsilon): each direction on its own grid (LOSS_GRID, or coarser).
 * `ratio` = 1 is the plain Gaussian shift: the caller's closed form.
 */
export function addRemoveEpsilon(shift: number, ratio: number, width: number, delta: number, grid = LOSS_GRID): number {
  if (!(ratio > 1) || width < 1) throw new Error("addRemoveEpsilon: ratio > 1 and width >= 1 (ratio 1 is the Gaussian)");
  let eps = 0;
  for (const upper of [true, false]) {
    const one = shiftScaleLoss(shift, ratio, upper);
    const rest = width > 1 ? varianceLoss(ratio, width - 1, upper) : null;
    const g = Math.max(grid, span([one, rest]) / MAX_GRID_POINTS);
    eps = Math.max(eps, epsilonForDelta(lawPmf(one, rest, g), delta));
  }
  return eps;
}

/**
 * epsilon at delta of the add/remove pair with the secret sign (secret_sign.presence_epsilon):
 * the mixture with variance ratio `ratio` on width + 1 columns against N(0, I), both directions
 * on the coarser of their two grids.
 */
export function presenceEpsilon(shift: number, ratio: number, width: number, delta: number, grid = LOSS_GRID): number {
  const parts = [true, false].map((upper) => {
    const one = mixtureLoss(shift, ratio, upper);
    const rest = ratio > 1 && width >= 1 ? varianceLoss(ratio, width, upper) : null;
    return { one, rest, g: Math.max(grid, span([one, rest]) / MAX_GRID_POINTS) };
  });
  const g = Math.max(...parts.map((p) => p.g));
  return Math.max(...parts.map((p) => epsilonForDelta(lawPmf(p.one, p.rest, g), delta)));
}
