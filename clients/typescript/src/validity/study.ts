/**
 * A validity study's reports (docs/protocol.md sections 4b and 4c): the plan every party
 * derives from the study (grid, R^2, digits, the circuit), and the client's proved batch from its
 * noisy ring vectors: digits, the helpers' seeds, binding of the leader's input share and the
 * seeds, joint randomness, proof, the leader's input and proof shares.
 */
import { u64sToBytes } from "../bytes.js";
import { bind, CONTENT_SEED, CONTENT_SHARE } from "../binding.js";
import type { Keystream } from "../keystream.js";
import { gridShift, INV_SQRT2, provedFeatures, rowWidth, spacing, width, type Study } from "../study.js";
import { sample, sub, type Fp } from "./field.js";
import { digitsFor, expandShare, jointRand, NormBound, prove } from "./flp.js";
import { GramNorm, gramBounds, normAllowance, witnessRow } from "./gram.js";

export const BETA = 4;

/**
 * The client noise's parameter t in grid steps (validity.client_scale): ceil(std / h), at least 1,
 * or 0 in a study without client noise (epsilon at the floor: the predicate has no allowance).
 */
function clientScale(study: Study, std: number, h: number): number {
  return study.sigma > 0 ? Math.max(1, Math.ceil(std / h)) : 0;
}

export interface ValidityPlan {
  shift: number;
  t: number;
  /** a gram or moments study: the strict upper triangle's sampler parameter t_o */
  tUpper: number | null;
  r2: bigint;
  q: number;
  circuit: NormBound | GramNorm;
  /** n + P: the leader's elements per report */
  leaderWidth: number;
}

/**
 * A gram or moments study's plan (docs/protocol.md section 4b, validity.plan): GramNorm with
 * t_e = max(t, sqrt(2) t_o), the witness grid g = 2^-m = sqrt(h).
 */
function gramPlan(study: Study): ValidityPlan {
  const shift = gridShift(study);
  const h = spacing(study);
  const m = (study.frac_bits - shift) / 2;
  const t = clientScale(study, study.sigma, h);
  const tUpper = clientScale(study, study.sigma * INV_SQRT2, h);
  const tEff = Math.max(t, Math.SQRT2 * tUpper);
  const d = rowWidth(study);
  const gram = study.kind === "gram";
  const { r2Row, r2 } = gramBounds(gram, d, width(study), study.row_bound, h, tEff);
  const q = digitsFor(r2, BETA);
  const circuit = new GramNorm(d, gram, 1n << BigInt(m), 1n << BigInt(2 * m), BETA, digitsFor(r2Row, BETA), r2Row, q, r2);
  return { shift, t, tUpper, r2, q, circuit, leaderWidth: circuit.inputLen + circuit.proofLen };
}

export function validityPlan(study: Study): ValidityPlan {
  if (study.validity !== "norm-bound/1") throw new Error("not a validity study");
  if (study.parties) throw new Error("a study with parties proves each party's blocks with the party's own plan (partyPlan)");
  // an l1 study proves what a sketch study does (its noisy row); gram and moments studies their
  // features' witness row and noise (circuit GramNorm, docs/validity.md section 12)
  if (provedFeatures(study)) return gramPlan(study);
  const w = width(study);
  let oneHot: { blocks: [number, number][]; unit: bigint } | null = null;
  if (study.kind === "histogram") {
    const sizes = study.histogram!.axes.map((ax) => (ax.edges ?? ax.categories ?? []).length + 1);
    const blocks: [number, number][] = [];
    if (study.histogram!.marginal) {
      let o = 0;
      for (const n of sizes) {
        blocks.push([o, n]);
        o += n;
      }
    } else blocks.push([0, w]);
    oneHot = { blocks, unit: 1n << BigInt(study.frac_bits - gridShift(study)) };
  }
  // a histogram's one-hot part is proved exactly: its bound is the noise allowance alone
  return normBoundPlan(study, w, study.kind === "histogram" ? 0 : study.row_bound, oneHot);
}

/**
 * Party `index`'s plan in a validity study with parties (docs/protocol.md section 4b's last
 * bullet, validity.party_plan): the sketch predicate of width d_j and bound B_j = row_bound_j,
 * NormBound(d_j, 4, q_j, R2_j), with the study's grid and noise.
 */
export function partyPlan(study: Study, index: number): ValidityPlan {
  if (study.validity !== "norm-bound/1") throw new Error("not a validity study");
  const party = study.parties?.[index];
  if (!party) throw new Error("only a study with parties has party plans, one per party");
  return normBoundPlan(study, party.columns.length, party.row_bound, null);
}

/** NormBound(w, 4, q, R2) with R2 = ceil((B / h + t sqrt(w + 2 sqrt(w a) + 2 a))^2) (doubles). */
function normBoundPlan(study: Study, w: number, rowBound: number, oneHot: { blocks: [number, number][]; unit: bigint } | null): ValidityPlan {
  const h = spacing(study);
  const t = clientScale(study, study.sigma, h);
  const r = rowBound / h + normAllowance(t, w);
  const r2 = BigInt(Math.ceil(r * r));
  const q = digitsFor(r2, BETA);
  const circuit = new NormBound(w, BETA, q, r2, oneHot);
  return { shift: gridShift(study), t, tUpper: null, r2, q, circuit, leaderWidth: circuit.inputLen + circuit.proofLen };
}

export interface ProvedBatch {
  reportIds: Uint8Array[];
  /** per server: content kind, payloads (leader: 8 (n + P) bytes; helper: 32-byte seed), binding proofs */
  servers: { content: number; payloads: Uint8Array[]; proofs: Uint8Array[] }[];
  inputs: Fp[][];
  proofs: Fp[][];
}

/** The witness rows of a gram or moments study's clipped rows (validity.witness_rows). */
export function witnessRows(plan: ValidityPlan, clipped: number[][]): bigint[][] {
  const c = plan.circuit;
  if (!(c instanceof GramNorm)) throw new Error("only a gram or moments study's proof takes a witness row");
  const m = c.lin.toString(2).length - 1; // g = 2^-m
  return clipped.map((a) => witnessRow(a, m));
}

/**
 * The proved batch from the noisy ring vectors (m rows of width values), leader at `full`; a
 * histogram's one-hot rows, a gram or moments study's clipped rows (its witness's source). One
 * party's blocks (`prefixes`: binding.blockPrefixes of the party and each block's pseudonym, with
 * the party's plan) are bound under block ids, so the proofs' joint randomness commits to the
 * party and the pseudonym too (docs/protocol.md section 4b, last bullet).
 */
export function proveBatch(study: Study, studyIdHex: string, plan: ValidityPlan, noisy: BigUint64Array, ks: Keystream, full: number,
  onehot: number[][] | null = null, clipped: number[][] | null = null, prefixes: Uint8Array[] | null = null): ProvedBatch {
  const c = plan.circuit;
  const w = c.w;
  const m = noisy.length / w;
  const N = study.servers.length;
  if (!(Number.isInteger(full) && full >= 0 && full < N)) throw new Error(`full=${full}: a server position, 0 to ${N - 1}`);
  if (prefixes && prefixes.length !== m) throw new Error(`${prefixes.length} block prefixes for ${m} blocks`);
  const witness = c instanceof GramNorm ? witnessRows(plan, clipped ?? []) : null;
  if (witness && (witness.length !== m || witness.some((r) => r.length !== (c as GramNorm).d))) throw new Error(`a ${study.kind} study's proof needs the clipped rows`);
  const inputs: Fp[][] = [];
  for (let i = 0; i < m; i++) {
    const u: bigint[] = [];
    for (let j = 0; j < w; j++) {
      const x = BigInt.asIntN(64, noisy[i * w + j]);
      if (x % (1n << BigInt(plan.shift)) !== 0n) throw new Error("a value is not on the study's noise grid");
      u.push(x >> BigInt(plan.shift));
    }
    if (c instanceof GramNorm) {
      // the noise e = u - psi(r) of the witness r
      const psi = c.features(witness![i]);
      inputs.push(c.encode(witness![i], u.map((x, j) => x - psi[j])));
    } else inputs.push(c.encode(u, onehot ? onehot[i] : null));
  }
  // the helpers' seeds (m each, helper by helper in server order), the leader's input shares
  const seeds: (Uint8Array[] | null)[] = [];
  const leaderIn = inputs.map((x) => x.slice());
  const helperProofs: Fp[][][] = [];
  for (let j = 0; j < N; j++) {
    if (j === full) {
      seeds.push(null);
      continue;
    }
    const b = ks.bytes(32 * m).slice();
    const list: Uint8Array[] = [];
    const hp: Fp[][] = [];
    for (let i = 0; i < m; i++) {
      const seed = b.subarray(32 * i, 32 * i + 32);
      list.push(seed);
      const e = expandShare(c, seed);
      leaderIn[i] = leaderIn[i].map((x, k) => sub(x, e.input[k]));
      hp.push(e.proof);
    }
    seeds.push(list);
    helperProofs.push(hp);
  }
  // binding: the leader's input share, the helpers' seeds; salts from the keystream
  const saltBytes = ks.bytes(16 * N * m).slice();
  const contents = seeds.map((s) => (s === null ? CONTENT_SHARE : CONTENT_SEED));
  const reportIds: Uint8Array[] = [];
  const bindingProofs: Uint8Array[][] = Array.from({ length: N }, () => []);
  for (let i = 0; i < m; i++) {
    const salts = Array.from({ length: N }, (_, j) => saltBytes.subarray(16 * (j * m + i), 16 * (j * m + i) + 16));
    const payloads = seeds.map((s) => (s === null ? u64sToBytes(leaderIn[i]) : s[i]));
    const b = bind(studyIdHex, contents, salts, payloads, prefixes ? prefixes[i] : undefined);
    reportIds.push(b.reportId);
    b.proofs.forEach((p, j) => bindingProofs[j].push(p));
  }
  // the proofs, after the ids fix the joint randomness
  const R = c.proveRandLen;
  const rand = sample(ks, m * R);
  const proofs: Fp[][] = [];
  const servers: ProvedBatch["servers"] = seeds.map((s, j) => ({ content: contents[j], payloads: s === null ? [] : s, proofs: bindingProofs[j] }));
  for (let i = 0; i < m; i++) {
    const proof = prove(c, inputs[i], jointRand(c, reportIds[i]), rand.slice(i * R, (i + 1) * R));
    proofs.push(proof);
    let lp = proof;
    for (const hp of helperProofs) lp = lp.map((x, k) => sub(x, hp[i][k]));
    servers[full].payloads.push(u64sToBytes([...leaderIn[i], ...lp]));
  }
  return { reportIds, servers, inputs, proofs };
}
