/**
 * The replace-one accounting of a signed study (docs/protocol.md section 5, "Secret sign";
 * docs/secret_sign.md): a certified upper bound on delta(epsilon) of the mixture
 * 1/2 N(u, I) + 1/2 N(-u, I) against the same at v, ||u||, ||v|| <= r, as the largest over the
 * corners (r cos phi_j, r sin phi_j+1) of a fixed cover of [0, pi/4] of
 * (1 + e^eps)/2 E[(A_a A_b - tanh(eps/2))_+], A_a = tanh(a |X|), X ~ N(a, 1), each factor's law
 * put at the tops of cells of |X| of width 0.004 (so an upper bound), inflated by 1e-9.
 */
import { logPhi } from "./accounting.js";

export const CELL = 0.004;
const TAIL_SIGMAS = 13.5;
const FLOAT_ALLOWANCE = 1e-9;
const COVER_START = Math.PI / 8;
const COVER_RATIO = 0.93;
const COVER_LAST = 1e-4;
/** beyond these the accounting is the plain Gaussian's (section 5) */
export const MAX_EPSILON = 30;
export const MAX_RADIUS = 20;

// a hair up / down (at least one ulp for the values met here, 2^-1022 < x <= 1): the bound only
// grows, as the reference's nextafter makes it
const nextUp = (x: number): number => x * (1 + Number.EPSILON);
const nextDown = (x: number): number => (x > 0 ? x * (1 - Number.EPSILON) : x - Number.MIN_VALUE);

const GL = [[-Math.sqrt(3 / 5) / 2, 5 / 18], [0, 8 / 18], [Math.sqrt(3 / 5) / 2, 5 / 18]];
const DENSITY = 1 / Math.sqrt(2 * Math.PI);

/** Q(x_i + shift) for the uniform grid x (upper tails of N(0, 1)). */
function upperTails(xs: Float64Array, shift: number): Float64Array {
  const n = xs.length;
  const out = new Float64Array(n);
  out[n - 1] = Math.exp(logPhi(-(xs[n - 1] + shift)));
  for (let i = n - 2; i >= 0; i--) {
    const lo = xs[i] + shift, h = xs[i + 1] - xs[i], mid = lo + h / 2;
    let integral = 0;
    for (const [off, w] of GL) {
      const t = mid + off * h;
      integral += w * Math.exp(-0.5 * t * t);
    }
    out[i] = out[i + 1] + integral * h * DENSITY;
  }
  return out;
}

/** The law of A_a on the cells' tops: atoms alpha (last 1), survivals S_i, stop-loss tails. */
class Factor {
  alpha: Float64Array;
  surv: Float64Array;
  mass: Float64Array;
  tail: Float64Array;
  constructor(a: number) {
    const n = Math.floor((a + TAIL_SIGMAS + CELL) / CELL - 1e-12) + 1; // numpy arange(0, a + T + cell, cell)
    const xs = new Float64Array(n);
    for (let i = 0; i < n; i++) xs[i] = i * CELL;
    // S_i = P(X > x_i) + P(X < -x_i) = Q(x_i - a) + Q(x_i + a), Q the normal's upper tail: each
    // from the top cell down, Q(y) = Q(y + cell) + the density's integral over the cell
    // (3-point Gauss-Legendre, error far below 1e-16 relative), so that one exact tail per
    // factor replaces thousands of erfc evaluations and the far tail keeps its relative accuracy
    const upper = upperTails(xs, -a), lower = upperTails(xs, a);
    const surv = new Float64Array(n);
    for (let i = 0; i < n; i++) surv[i] = upper[i] + lower[i];
    surv[0] = 1;
    const alpha = new Float64Array(n);
    for (let i = 1; i < n; i++) alpha[i - 1] = Math.min(nextUp(Math.tanh(a * xs[i])), 1);
    alpha[n - 1] = 1;
    this.alpha = alpha;
    this.surv = surv;
    this.mass = new Float64Array(n);
    for (let i = 0; i < n - 1; i++) this.mass[i] = surv[i] - surv[i + 1];
    this.mass[n - 1] = surv[n - 1];
    const steps = new Float64Array(n);
    let prev = 0;
    for (let i = 0; i < n; i++) {
      steps[i] = (alpha[i] - prev) * surv[i];
      prev = alpha[i];
    }
    this.tail = new Float64Array(n + 1);
    for (let i = n - 1; i >= 0; i--) this.tail[i] = this.tail[i + 1] + steps[i];
  }

  /** E[(A - x)_+] for x >= 0, an upper bound (x taken a hair low). */
  stopLoss(x0: number): number {
    const x = nextDown(x0);
    let lo = 0, hi = this.alpha.length; // first atom strictly above x
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (this.alpha[mid] <= x) lo = mid + 1;
      else hi = mid;
    }
    if (lo >= this.alpha.length) return 0;
    return Math.max((this.alpha[lo] - x) * this.surv[lo] + this.tail[lo + 1], 0);
  }
}

const factors = new Map<number, Factor>();
function factor(a: number): Factor {
  let f = factors.get(a);
  if (!f) {
    f = new Factor(a);
    if (factors.size > 512) factors.clear();
    factors.set(a, f);
  }
  return f;
}

/** Upper bound on delta(epsilon) of the experiment E(a, b). */
export function pairDelta(a: number, b: number, epsilon: number): number {
  if (a <= 0 || b <= 0) return 0;
  const z = Math.tanh(epsilon / 2);
  const fa = factor(a), fb = factor(b);
  let s = 0;
  for (let i = 0; i < fa.alpha.length; i++) s += fb.stopLoss(z / fa.alpha[i]) * (fa.mass[i] * fa.alpha[i]);
  return 0.5 * (1 + Math.exp(Math.min(epsilon, 700))) * s * (1 + FLOAT_ALLOWANCE);
}

export function coverAngles(): number[] {
  const quarter = Math.PI / 4;
  const angles = [0, COVER_START];
  let gap = quarter - COVER_START;
  while (gap > COVER_LAST) {
    gap *= COVER_RATIO;
    angles.push(quarter - gap);
  }
  angles.push(quarter);
  return angles;
}

/**
 * The largest corner of the cover, or with `reached` whether it exceeds that: a certified bound on
 * the signed study's delta(epsilon) at r. Branch and bound as the reference: the corner
 * (r cos phi_i, r sin phi_k) of pieces i..k-1 dominates each of theirs, so a group whose corner
 * stays at or below the best so far (or below `reached`) needs no refinement.
 */
export function replaceDelta(r: number, epsilon: number, reached: number | null = null): number {
  if (r <= 0) return 0;
  const phi = coverAngles();
  const n = phi.length - 1;
  const value = (i: number, k: number) => pairDelta(r * Math.cos(phi[i]), r * Math.sin(phi[k]), epsilon);
  let best = value(n - 1, n);
  const stack: [number, number][] = [[0, n - 1]];
  while (stack.length) {
    const [i, k] = stack.pop()!;
    const v = value(i, k);
    if (v <= best || (reached !== null && v <= reached)) continue;
    if (k - i === 1) {
      best = Math.max(best, v);
      if (reached !== null && best > reached) return best;
      continue;
    }
    const mid = (i + k) >> 1;
    stack.push([i, mid], [mid, k]);
  }
  return best;
}
