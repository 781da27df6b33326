/**
 * A data owner's client: fetch the study from every server and check it (same id everywhere,
 * recomputed; the protocol's structural rules; its epsilon and floor where this client can
 * recompute them; each server's published policy; open for uploads; sealing keys), then submit rows in batches: each batch keyed from a submission secret
 * (so a rerun with the same secret rebuilds the same reports and nothing is counted twice), the
 * full share rotating over the servers, sealed or not, every POST retried, progress reported.
 * A study with batch proofs gets proved batches (section 4d): one record a server a batch, the
 * leader rotating over the servers batch by batch.
 */
import { hmac } from "@noble/hashes/hmac.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, hex, randomBytes } from "./bytes.js";
import { plainBody, prepareBatch, type PreparedBatch, type ServerBatch } from "./batch.js";
import { CONTENT_SEED } from "./binding.js";
import { blocksBody, blocksMediaType, partySigns, prepareBlocks, pseudonym, type PreparedBlocks } from "./parties.js";
import type { RawValue } from "./features.js";
import * as sealedLayout from "./sealing/v4.js";
import { checkDistinctKeys, currentKey, type HpkeKeys, type ServerKey, type SuiteName } from "./sealing/suites.js";
import { checkPromise, type PromiseCheck } from "./accounting.js";
import { studyId, validateStudy, width, type Study } from "./study.js";
import { prepareProofBatch, proofBatchRows, type ProofBatch } from "./proof_batch.js";
import { sealedContent } from "./validity/batch_records.js";
import { DEFAULT_RETRY, getJson, ProblemError, request, type FetchLike, type RetryPolicy, type UploadResult } from "./upload.js";

export interface ServerEndpoint {
  url: string;
  /** this server's upload token for the study (Authorization: Bearer), if it requires one */
  token?: string;
}

export interface ConnectOptions {
  studyId: string;
  servers: ServerEndpoint[];
  /** "none" (default), "classical" or "post-quantum": seal every batch to its server (section 7a) */
  sealing?: "none" | SuiteName;
  fetch?: FetchLike;
  retry?: Partial<RetryPolicy>;
}

export interface Progress {
  batch: number;
  batches: number;
  rowsDone: number;
  rowsTotal: number;
  accepted: number[];
  duplicates: number[];
}

export interface SubmitOptions {
  /** rows per batch (default 1000; a study with batch proofs: proofBatchRows, the leader's record within 8 MiB) */
  batchSize?: number;
  /**
   * 32-byte submission secret: batch b is keyed HMAC-SHA256(secret, "dpsketch/submission-batch/1"
   * || b as 8 bytes big-endian). Keep it until every server holds the submission: submitting the
   * same rows with it again resends the same reports (duplicates, counted once). Fresh by default.
   */
  secret?: Uint8Array;
  onProgress?: (p: Progress) => void;
  onRetry?: (server: string, attempt: number, why: string) => void;
  /** keep each batch's noisy ring vectors in the result (tests and audits of one's own reports) */
  keepVectors?: boolean;
  /**
   * A study with batch proofs (docs/protocol.md section 4d): true (default) proves each batch
   * whole, one record a server; false proves each row on its own (per-report records, section 4c).
   */
  batchProofs?: boolean;
}

export interface SubmitResult {
  reportIds: string[];
  accepted: number[];
  duplicates: number[];
  secret: Uint8Array;
  /** per column, how many values the study's bounds clamped */
  clamped: number[];
  vectors?: bigint[][];
}

interface ServerInfo {
  study_id: string;
  server_id: string;
  status: string;
  study: Study;
  hpke?: HpkeKeys | null;
}

/** Rows given as arrays (study order) or as objects (by column name), as arrays in study order. */
export function rowArrays(study: Study, rows: (RawValue[] | Record<string, RawValue>)[]): RawValue[][] {
  return rows.map((r) => (Array.isArray(r) ? r : study.columns.map((c) => {
    if (!(c in r)) throw new Error(`a row has no value for column ${c}`);
    return r[c];
  })));
}

/**
 * One server's share or seed batch (its records: `reportIds` with `sb`'s proofs and payloads, in
 * order) sealed to that server's key as one version 4 batch (docs/protocol.md section 7a).
 */
export function sealServerBatch(studyIdHex: string, serverId: string, key: ServerKey, reportIds: Uint8Array[], sb: ServerBatch): Promise<Uint8Array> {
  return sealedLayout.seal({
    studyId: studyIdHex,
    serverId,
    key,
    content: sb.content,
    reportIds,
    plaintexts: reportIds.map((_, i) => concat(sb.proofs[i], sb.payloads[i])),
  });
}

export function batchKey(secret: Uint8Array, b: number): Uint8Array {
  const be = new Uint8Array(8);
  new DataView(be.buffer).setBigUint64(0, BigInt(b), false);
  return hmac(sha256, secret, concat(ascii("dpsketch/submission-batch/1"), be));
}

export class Client {
  private constructor(
    readonly study: Study,
    readonly studyId: string,
    /** endpoints in the study's server order */
    readonly endpoints: ServerEndpoint[],
    private readonly keys: ServerKey[] | null,
    private readonly fetchFn: FetchLike,
    private readonly retry: RetryPolicy,
    /** the study's epsilon and floor as this client recomputed them (accounting.ts) */
    readonly promise: PromiseCheck,
    /** each server's published policy from its /v1/info (study order; null: it publishes none) */
    readonly policies: readonly (Record<string, unknown> | null)[],
  ) {}

  static async connect(opts: ConnectOptions): Promise<Client> {
    const fetchFn: FetchLike = opts.fetch ?? ((u, i) => globalThis.fetch(u, i));
    const retry = { ...DEFAULT_RETRY, ...(opts.retry ?? {}) };
    const infos = await Promise.all(
      opts.servers.map((s) => getJson<ServerInfo>(fetchFn, `${s.url.replace(/\/$/, "")}/v1/studies/${opts.studyId}`, retry)),
    );
    const study = infos[0].study;
    for (const [j, info] of infos.entries()) {
      const got = studyId(info.study);
      if (got !== opts.studyId) throw new Error(`${opts.servers[j].url} holds a study whose id is ${got}, not ${opts.studyId}`);
      if (info.status !== "open") throw new Error(`${opts.servers[j].url}: the study is ${info.status}, not open for uploads`);
    }
    validateStudy(study);
    const promise = checkPromise(study); // throws if the noise does not give what the study promises
    // order the endpoints as the study's servers: share j goes to server j
    const byId = new Map(infos.map((info, j) => [info.server_id, j]));
    const order = study.servers.map((sid) => {
      const j = byId.get(sid);
      if (j === undefined) throw new Error(`no endpoint given for the study's server ${sid}`);
      return j;
    });
    if (new Set(order).size !== opts.servers.length) throw new Error("the endpoints are not the study's servers, each once");
    const endpoints = order.map((j) => ({ ...opts.servers[j], url: opts.servers[j].url.replace(/\/$/, "") }));
    // each server's published policy: the study must be one it would serve
    const published = await Promise.all(endpoints.map((e) => getJson<{ policy?: Record<string, unknown> | null }>(fetchFn, `${e.url}/v1/info`, retry)));
    const policies = published.map((p) => p.policy ?? null);
    policies.forEach((p, j) => checkPolicy(study, p, endpoints[j].url));
    let keys: ServerKey[] | null = null;
    const sealing = opts.sealing ?? "none";
    if (sealing !== "none") {
      keys = order.map((j) => currentKey(infos[j].hpke, sealing, sealedLayout.VERSION));
      checkDistinctKeys(keys);
    }
    return new Client(study, opts.studyId, endpoints, keys, fetchFn, retry, promise, policies);
  }

  /** The current key this client seals to at each server (study order), or null when it does not seal. */
  get sealingKeys(): readonly ServerKey[] | null {
    return this.keys;
  }

  /** Turn rows given as objects (by column name) into arrays in study order. */
  private toArrays(rows: (RawValue[] | Record<string, RawValue>)[]): RawValue[][] {
    return rowArrays(this.study, rows);
  }

  /** Prepare batch b (pure: no I/O); its full share at server b mod N when seeds are smaller. */
  prepare(rows: RawValue[][], key: Uint8Array, b: number): PreparedBatch {
    const N = this.study.servers.length;
    // seeds where they are smaller than a share; a validity study's batches always (its leader rotates)
    const compress = width(this.study) > 4 || this.study.validity !== undefined;
    return prepareBatch(this.study, this.studyId, rows, key, { full: compress ? b % N : null });
  }

  /** One server's body for records [lo, hi) of a prepared batch: plaintext or sealed. */
  async body(p: PreparedBatch, sb: ServerBatch, lo = 0, hi = p.reportIds.length): Promise<{ body: Uint8Array; type: string }> {
    const ids = p.reportIds.slice(lo, hi);
    const part: ServerBatch = { ...sb, proofs: sb.proofs.slice(lo, hi), payloads: sb.payloads.slice(lo, hi), salts: sb.salts.slice(lo, hi) };
    if (!this.keys) return { body: plainBody(ids, part), type: sb.mediaType };
    const body = await sealServerBatch(this.studyId, this.study.servers[sb.position], this.keys[sb.position], ids, part);
    return { body, type: sealedLayout.MEDIA_TYPE };
  }

  /** POST records [lo, hi) to server j, halving on 413 (the same records, so idempotent). */
  private async post(p: PreparedBatch, j: number, lo: number, hi: number, onRetry?: SubmitOptions["onRetry"]): Promise<UploadResult> {
    const e = this.endpoints[j];
    const { body, type } = await this.body(p, p.servers[j], lo, hi);
    const headers: Record<string, string> = { "Content-Type": type, Accept: "application/json" };
    if (e.token) headers.Authorization = `Bearer ${e.token}`;
    try {
      const resp = await request(this.fetchFn, `${e.url}/v1/studies/${this.studyId}/batches`, { method: "POST", headers, body: body as unknown as BodyInit }, this.retry,
        (a, why) => onRetry?.(this.study.servers[j], a, why));
      const r = (await resp.json()) as UploadResult;
      if (r.accepted + r.duplicates !== hi - lo) throw new Error(`${e.url} acknowledged ${r.accepted} + ${r.duplicates} of ${hi - lo} records`);
      return r;
    } catch (err) {
      if (err instanceof ProblemError && err.status === 413 && hi - lo > 1) {
        const mid = lo + Math.floor((hi - lo) / 2);
        const a = await this.post(p, j, lo, mid, onRetry);
        const b = await this.post(p, j, mid, hi, onRetry);
        return { accepted: a.accepted + b.accepted, duplicates: a.duplicates + b.duplicates, report_count: b.report_count };
      }
      throw err;
    }
  }

  /** Server j's body of a proved batch: its record, plaintext or sealed (docs/sealing.md section 3b: content 0x05 or 0x06, the batch id in the clear). */
  async proofBatchBody(p: ProofBatch, j: number): Promise<{ body: Uint8Array; type: string }> {
    const rec = p.records[j];
    if (!this.keys) return { body: rec.body, type: rec.mediaType };
    const body = await sealedLayout.seal({
      studyId: this.studyId,
      serverId: this.study.servers[j],
      key: this.keys[j],
      content: sealedContent(rec.mediaType),
      reportIds: [p.batchId],
      plaintexts: [rec.body],
    });
    return { body, type: sealedLayout.MEDIA_TYPE };
  }

  /** POST a proved batch's record to server j. One proof covers its rows: a 413 stands (a smaller batchSize is the remedy). */
  private async postProofBatch(p: ProofBatch, j: number, onRetry?: SubmitOptions["onRetry"]): Promise<UploadResult> {
    const e = this.endpoints[j];
    const { body, type } = await this.proofBatchBody(p, j);
    const headers: Record<string, string> = { "Content-Type": type, Accept: "application/json" };
    if (e.token) headers.Authorization = `Bearer ${e.token}`;
    const resp = await request(this.fetchFn, `${e.url}/v1/studies/${this.studyId}/batches`, { method: "POST", headers, body: body as unknown as BodyInit }, this.retry,
      (a, why) => onRetry?.(this.study.servers[j], a, why));
    const r = (await resp.json()) as UploadResult;
    const m = p.rowIds.length;
    if (r.accepted + r.duplicates !== m) throw new Error(`${e.url} acknowledged ${r.accepted} + ${r.duplicates} of a proved batch of ${m} rows`);
    return r;
  }

  /**
   * A study with batch proofs: each batch of rows (batchSize, default proofBatchRows: the leader's
   * record within 8 MiB) proved whole from its batch key, the leader at server b mod N, one record
   * to each server. The ids are the rows' (hashes of the batch id and the row's index).
   */
  private async submitProofBatches(rows: RawValue[][], opts: SubmitOptions, secret: Uint8Array): Promise<SubmitResult> {
    const N = this.study.servers.length;
    const batchSize = proofBatchRows(this.study, opts.batchSize);
    const batches = Math.ceil(rows.length / batchSize);
    const accepted = new Array(N).fill(0), duplicates = new Array(N).fill(0);
    const reportIds: string[] = [];
    const clamped = new Array(this.study.columns.length).fill(0);
    const vectors: bigint[][] = [];
    const W = width(this.study);
    for (let b = 0; b < batches; b++) {
      const chunk = rows.slice(b * batchSize, (b + 1) * batchSize);
      const p = prepareProofBatch(this.study, chunk, batchKey(secret, b), b % N);
      p.clamped.forEach((c, i) => (clamped[i] += c));
      const results = await Promise.all(p.records.map((_, j) => this.postProofBatch(p, j, opts.onRetry)));
      results.forEach((r, j) => {
        accepted[j] += r.accepted;
        duplicates[j] += r.duplicates;
      });
      for (const id of p.rowIds) reportIds.push(hex(id));
      if (opts.keepVectors) for (let i = 0; i < chunk.length; i++) vectors.push(Array.from(p.noisy.subarray(i * W, (i + 1) * W)));
      opts.onProgress?.({ batch: b + 1, batches, rowsDone: Math.min(rows.length, (b + 1) * batchSize), rowsTotal: rows.length, accepted: accepted.slice(), duplicates: duplicates.slice() });
    }
    return { reportIds, accepted, duplicates, secret, clamped, ...(opts.keepVectors ? { vectors } : {}) };
  }

  async submit(rowsIn: (RawValue[] | Record<string, RawValue>)[], opts: SubmitOptions = {}): Promise<SubmitResult> {
    if (this.study.parties) throw new Error("a study with parties takes blocks: submitBlocks(party, ...)");
    const rows = this.toArrays(rowsIn);
    if (this.study.batch_proofs && opts.batchProofs !== false) {
      const secret = opts.secret ?? randomBytes(32);
      if (secret.length !== 32) throw new Error("the submission secret is 32 bytes");
      return this.submitProofBatches(rows, opts, secret);
    }
    const batchSize = opts.batchSize ?? 1000;
    if (!(batchSize >= 1)) throw new Error("batchSize must be at least 1");
    const secret = opts.secret ?? randomBytes(32);
    if (secret.length !== 32) throw new Error("the submission secret is 32 bytes");
    const N = this.study.servers.length;
    const batches = Math.ceil(rows.length / batchSize);
    const accepted = new Array(N).fill(0), duplicates = new Array(N).fill(0);
    const reportIds: string[] = [];
    const clamped = new Array(this.study.columns.length).fill(0);
    const vectors: bigint[][] = [];
    for (let b = 0; b < batches; b++) {
      const chunk = rows.slice(b * batchSize, (b + 1) * batchSize);
      const p = this.prepare(chunk, batchKey(secret, b), b);
      p.clamped.forEach((c, i) => (clamped[i] += c));
      const results = await Promise.all(p.servers.map((_, j) => this.post(p, j, 0, chunk.length, opts.onRetry)));
      results.forEach((r, j) => {
        accepted[j] += r.accepted;
        duplicates[j] += r.duplicates;
      });
      for (const id of p.reportIds) reportIds.push(hex(id));
      if (opts.keepVectors) {
        const W = width(this.study);
        for (let i = 0; i < chunk.length; i++) vectors.push(Array.from(p.noisy.subarray(i * W, (i + 1) * W)));
      }
      opts.onProgress?.({ batch: b + 1, batches, rowsDone: Math.min(rows.length, (b + 1) * batchSize), rowsTotal: rows.length, accepted: accepted.slice(), duplicates: duplicates.slice() });
    }
    return { reportIds, accepted, duplicates, secret, clamped, ...(opts.keepVectors ? { vectors } : {}) };
  }

  /**
   * Server j's body of a party's blocks: plaintext, or sealed (docs/sealing.md section 3a:
   * content 0x03, or 0x04 for a validity study's helper, whose records carry seeds).
   */
  async blocksBody(p: PreparedBlocks, j: number): Promise<{ body: Uint8Array; type: string }> {
    if (!this.keys) return { body: blocksBody(p, j), type: blocksMediaType(p, j) };
    const body = await sealedLayout.seal({
      studyId: this.studyId,
      serverId: this.study.servers[j],
      key: this.keys[j],
      content: p.servers[j].content === CONTENT_SEED ? sealedLayout.CONTENT_BLOCK_SEED : sealedLayout.CONTENT_BLOCK,
      party: p.index,
      reportIds: p.blockIds,
      plaintexts: p.blockIds.map((_, i) => concat(p.pseudonyms[i], p.servers[j].proofs[i], p.servers[j].payloads[i])),
    });
    return { body, type: sealedLayout.blocksMediaType(p.party) };
  }

  /** POST a party's blocks [lo, hi) to server j (sealed when connected with sealing), halving on 413. */
  private async postBlocks(p: PreparedBlocks, j: number, lo: number, hi: number, onRetry?: SubmitOptions["onRetry"]): Promise<UploadResult> {
    const e = this.endpoints[j];
    const part: PreparedBlocks = { ...p, blockIds: p.blockIds.slice(lo, hi), pseudonyms: p.pseudonyms.slice(lo, hi),
      servers: p.servers.map((s) => ({ content: s.content, proofs: s.proofs.slice(lo, hi), payloads: s.payloads.slice(lo, hi) })) };
    const { body, type } = await this.blocksBody(part, j);
    const headers: Record<string, string> = { "Content-Type": type, Accept: "application/json" };
    if (e.token) headers.Authorization = `Bearer ${e.token}`;
    try {
      const resp = await request(this.fetchFn, `${e.url}/v1/studies/${this.studyId}/batches`,
        { method: "POST", headers, body: body as unknown as BodyInit }, this.retry, (a, why) => onRetry?.(this.study.servers[j], a, why));
      return (await resp.json()) as UploadResult;
    } catch (err) {
      if (err instanceof ProblemError && err.status === 413 && hi - lo > 1) {
        const mid = lo + Math.floor((hi - lo) / 2);
        const a = await this.postBlocks(p, j, lo, mid, onRetry);
        const b = await this.postBlocks(p, j, mid, hi, onRetry);
        return { accepted: a.accepted + b.accepted, duplicates: a.duplicates + b.duplicates, report_count: b.report_count };
      }
      throw err;
    }
  }

  /**
   * A party's blocks of a study with parties (section 2d): `individuals` are the individuals'
   * keys (customer numbers), turned into this study's pseudonyms with the parties' shared 32-byte
   * `partyKey`; `rows` the party's columns of each. The upload tokens must be this party's. In a
   * signed study every block is multiplied by its individual's party-key sign; in a study with
   * validity every block is proved with the party's own bound, the leader (its input and proof
   * shares) rotating over the servers batch by batch, a seed to every other server (section 4c).
   */
  async submitBlocks(party: string, partyKey: Uint8Array, individuals: (string | Uint8Array)[], rows: number[][], opts: SubmitOptions = {}): Promise<SubmitResult & { blockIds: string[] }> {
    if (!this.study.parties) throw new Error("the study has no parties");
    if (partyKey.length !== 32) throw new Error("the party key is 32 bytes");
    if (individuals.length !== rows.length) throw new Error(`${individuals.length} individuals for ${rows.length} rows`);
    const batchSize = opts.batchSize ?? 1000;
    const secret = opts.secret ?? randomBytes(32);
    const N = this.study.servers.length;
    const accepted = new Array(N).fill(0), duplicates = new Array(N).fill(0);
    const blockIds: string[] = [];
    const vectors: bigint[][] = [];
    const batches = Math.ceil(rows.length / batchSize);
    const d = this.study.parties.find((p) => p.name === party)?.columns.length ?? 0;
    for (let b = 0; b < batches; b++) {
      const ids = individuals.slice(b * batchSize, (b + 1) * batchSize).map((x) => pseudonym(partyKey, this.studyId, x));
      const signs = this.study.secret_sign ? partySigns(partyKey, this.studyId, ids) : null;
      const p = prepareBlocks(this.study, this.studyId, party, ids, rows.slice(b * batchSize, (b + 1) * batchSize), batchKey(secret, b),
        { signs, full: b % N });
      const results = await Promise.all(p.servers.map((_, j) => this.postBlocks(p, j, 0, ids.length, opts.onRetry)));
      results.forEach((r, j) => {
        accepted[j] += r.accepted;
        duplicates[j] += r.duplicates;
      });
      for (const id of p.blockIds) blockIds.push(hex(id));
      if (opts.keepVectors) for (let i = 0; i < ids.length; i++) vectors.push(Array.from(p.noisy.subarray(i * d, (i + 1) * d)));
      opts.onProgress?.({ batch: b + 1, batches, rowsDone: Math.min(rows.length, (b + 1) * batchSize), rowsTotal: rows.length, accepted: accepted.slice(), duplicates: duplicates.slice() });
    }
    return { reportIds: blockIds, blockIds, accepted, duplicates, secret, clamped: [], ...(opts.keepVectors ? { vectors } : {}) };
  }
}

/**
 * The study against a server's published policy (section 6): what it would refuse at
 * provisioning, checked again by the client (absent members: no limit known).
 */
export function checkPolicy(study: Study, policy: Record<string, unknown> | null, url: string): void {
  if (!policy) return;
  const num = (k: string) => (typeof policy[k] === "number" ? (policy[k] as number) : null);
  const refuse = (why: string) => {
    throw new Error(`${url}: the study is outside the server's published policy: ${why}`);
  };
  const maxEps = num("max_epsilon");
  if (maxEps !== null && study.epsilon > maxEps) refuse(`epsilon ${study.epsilon} > max_epsilon ${maxEps}`);
  const maxDelta = num("max_delta");
  if (maxDelta !== null && study.delta > maxDelta) refuse(`delta ${study.delta} > max_delta ${maxDelta}`);
  const minReports = num("min_reports_floor");
  if (minReports !== null && study.min_reports < minReports) refuse(`min_reports ${study.min_reports} < ${minReports}`);
  const minLambda = num("min_lambda_star");
  if (minLambda !== null && study.lambda_star < minLambda) refuse(`lambda_star ${study.lambda_star} < ${minLambda}`);
  const maxFloor = num("max_floor_epsilon");
  if (maxFloor !== null && (study.epsilon_floor === null || study.epsilon_floor > maxFloor)) refuse(`floor ${study.epsilon_floor} above max_floor_epsilon ${maxFloor}`);
}
