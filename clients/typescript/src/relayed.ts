/**
 * Relayed uploads (docs/protocol.md section 7b, docs/relay.md): a device sends one request, its
 * sealed batch for every server in one bundle, to a relay that forwards many devices' entries to
 * each server in one request. The TypeScript side of dpsketch/protocol/relayed.py (the format,
 * the token id and the entry MAC) and client_sdk/relayed.py (Enrolment, RelayClient).
 *
 * Why the relay is trusted with nothing: every entry is a version 4 sealed batch (section 7a)
 * sealed to its server's key, which the device holds from its enrolment (read from the servers,
 * never from the relay); and the upload token never leaves the device: the entry carries the
 * token's public id and an HMAC-SHA256, keyed from the token's SHA-256 digest (which the server
 * keeps), over the batch's transcript (study, server, batch id, key id, count, encapsulation).
 *
 *     bundle  = count (4) | entry_0 | ... | entry_{count-1}                      (big-endian)
 *     entry   = len(server_id) (1) | server_id | token_id (8) | mac (32) | length (4) | batch
 *     mac_key = SHA-256("dpsketch/relayed/1/key" || SHA-256(token))
 *     mac     = HMAC-SHA256(mac_key, "dpsketch/relayed/1" || transcript_v4)
 */
import { hmac } from "@noble/hashes/hmac.js";
import { sha256 } from "@noble/hashes/sha2.js";
import { ascii, concat, hex, randomBytes, u32be, unhex } from "./bytes.js";
import { prepareBatch } from "./batch.js";
import { Client, rowArrays, sealServerBatch, type ConnectOptions } from "./client.js";
import type { RawValue } from "./features.js";
import * as sealedLayout from "./sealing/v4.js";
import { checkDistinctKeys, keyId, suite, type ServerKey, type SuiteName } from "./sealing/suites.js";
import { studyId, validateStudy, type Study } from "./study.js";
import { DEFAULT_RETRY, ProblemError, request, retryable, sleep, type FetchLike, type RetryPolicy, type UploadResult } from "./upload.js";

export const MEDIA_TYPE = "application/x-dpsketch-relayed";
export const ENTRY_LABEL = ascii("dpsketch/relayed/1");
export const KEY_LABEL = ascii("dpsketch/relayed/1/key");
export const TOKEN_ID_BYTES = 8;
export const MAC_BYTES = 32;
export const COUNT_BYTES = 4;
export const LENGTH_BYTES = 4;
/** entries in one bundle: a device sends one per server; a relay at most this many to a server */
export const MAX_ENTRIES = 65_536;
export const NO_TOKEN_ID = new Uint8Array(TOKEN_ID_BYTES);
export const NO_MAC = new Uint8Array(MAC_BYTES);
const SUITES: SuiteName[] = ["classical", "post-quantum"];

/** One device's sealed batch for one server, with its token's id and MAC. */
export interface Entry {
  serverId: string;
  tokenId: Uint8Array;
  mac: Uint8Array;
  batch: Uint8Array;
}

export function encodeEntry(e: Entry): Uint8Array {
  const sid = ascii(e.serverId);
  if (sid.length < 1 || sid.length > 255 || !/^[\x00-\x7f]+$/.test(e.serverId)) throw new Error(`server id ${JSON.stringify(e.serverId)} is not 1 to 255 ASCII characters`);
  if (e.tokenId.length !== TOKEN_ID_BYTES || e.mac.length !== MAC_BYTES) throw new Error("an entry's token id is 8 bytes and its MAC 32");
  if (e.batch.length < 1) throw new Error("an entry's batch is not empty");
  return concat(Uint8Array.of(sid.length), sid, e.tokenId, e.mac, u32be(e.batch.length), e.batch);
}

/** SHA-256 of an upload token's UTF-8 bytes: what a server keeps of it. */
export function tokenDigest(token: string): Uint8Array {
  return sha256(ascii(token));
}

/** A token's public id (8 bytes): the first bytes of its digest, the id its server lists. */
export function tokenId(digest: Uint8Array): Uint8Array {
  return digest.slice(0, TOKEN_ID_BYTES);
}

/** The MAC key of a token: SHA-256 of a label and its digest (the id says nothing about the key). */
export function macKey(digest: Uint8Array): Uint8Array {
  if (digest.length !== 32) throw new Error("a token's digest is 32 bytes");
  return sha256(concat(KEY_LABEL, digest));
}

/**
 * The header of a version 4 sealed batch (what its transcript hashes: 85 + Nenc bytes), read from
 * its layout and suite alone; an Error if it is not one.
 */
export function batchHeader(batch: Uint8Array): Uint8Array {
  if (batch.length < 32 || batch[24] !== 0x80 || batch[25] !== sealedLayout.VERSION) {
    throw new Error("not a version 4 sealed batch (byte 24 must be 0x80 and byte 25 the version, 4)");
  }
  const ids = (o: number) => (batch[o] << 8) | batch[o + 1];
  const s = SUITES.map(suite).find((x) => x.kemId === ids(26) && x.kdfId === ids(28) && x.aeadId === ids(30));
  if (!s) throw new Error(`sealed batch: HPKE suite (kem 0x${ids(26).toString(16)}) is not one this client knows`);
  const size = 85 + s.encBytes;
  if (batch.length < size) throw new Error(`${batch.length} bytes: a ${s.name} sealed batch's header is ${size} bytes`);
  return batch.slice(0, size);
}

/** The MAC of a sealed batch for `serverId` and the study under the token of SHA-256 digest `digest`. */
export function entryMac(digest: Uint8Array, studyIdHex: string, serverId: string, batch: Uint8Array): Uint8Array {
  const t = sealedLayout.transcript(studyIdHex, serverId, batchHeader(batch));
  return hmac(sha256, macKey(digest), concat(ENTRY_LABEL, t));
}

/**
 * A device's entry for one server: its sealed batch with its token's id and MAC (`token` null: a
 * study that takes uploads without tokens, zero id and MAC).
 */
export function makeEntry(token: string | null, studyIdHex: string, serverId: string, batch: Uint8Array): Entry {
  if (token === null) {
    batchHeader(batch);
    return { serverId, tokenId: NO_TOKEN_ID.slice(), mac: NO_MAC.slice(), batch };
  }
  const digest = tokenDigest(token);
  return { serverId, tokenId: tokenId(digest), mac: entryMac(digest, studyIdHex, serverId, batch), batch };
}

/** Whether `entry`'s MAC is the token's (what a server checks; constant time in the MAC's bytes). */
export function verifyMac(digest: Uint8Array, studyIdHex: string, serverId: string, entry: Entry): boolean {
  const want = entryMac(digest, studyIdHex, serverId, entry.batch);
  if (entry.mac.length !== want.length) return false;
  let diff = 0;
  for (let i = 0; i < want.length; i++) diff |= want[i] ^ entry.mac[i];
  return diff === 0;
}

/** A bundle of entries (each an Entry, or an entry already encoded). */
export function encode(entries: (Entry | Uint8Array)[]): Uint8Array {
  if (!(entries.length >= 1 && entries.length <= MAX_ENTRIES)) throw new Error(`a bundle holds 1 to ${MAX_ENTRIES} entries, not ${entries.length}`);
  return concat(u32be(entries.length), ...entries.map((e) => (e instanceof Uint8Array ? e : encodeEntry(e))));
}

/** The entries of a bundle; an Error naming what is wrong if it is not exactly `count` whole entries. */
export function decode(body: Uint8Array): Entry[] {
  if (body.length < COUNT_BYTES) throw new Error(`a relayed bundle starts with a ${COUNT_BYTES}-byte entry count; the body has ${body.length} bytes`);
  const dv = new DataView(body.buffer, body.byteOffset, body.byteLength);
  const count = dv.getUint32(0, false);
  if (!(count >= 1 && count <= MAX_ENTRIES)) throw new Error(`a relayed bundle holds 1 to ${MAX_ENTRIES} entries, not ${count}`);
  const out: Entry[] = [];
  let at = COUNT_BYTES;
  for (let i = 0; i < count; i++) {
    if (at >= body.length) throw new Error(`relayed bundle: entry ${i} of ${count} is missing (the body ends at byte ${at})`);
    const n = body[at];
    const fixed = 1 + n + TOKEN_ID_BYTES + MAC_BYTES + LENGTH_BYTES;
    if (n === 0 || at + fixed > body.length) throw new Error(`relayed bundle: entry ${i} is cut short or names an empty server id`);
    const sid = body.subarray(at + 1, at + 1 + n);
    if (sid.some((b) => b > 0x7f)) throw new Error(`relayed bundle: entry ${i}'s server id is not ASCII`);
    let p = at + 1 + n;
    const tid = body.slice(p, p + TOKEN_ID_BYTES);
    const mac = body.slice(p + TOKEN_ID_BYTES, p + TOKEN_ID_BYTES + MAC_BYTES);
    p += TOKEN_ID_BYTES + MAC_BYTES;
    const length = dv.getUint32(p, false);
    p += LENGTH_BYTES;
    if (length === 0 || p + length > body.length) throw new Error(`relayed bundle: entry ${i}'s batch of ${length} bytes is empty or runs past the body (${body.length} bytes)`);
    out.push({ serverId: new TextDecoder().decode(sid), tokenId: tid, mac, batch: body.slice(p, p + length) });
    at = p + length;
  }
  if (at !== body.length) throw new Error(`relayed bundle: ${body.length - at} bytes follow its ${count} entries`);
  return out;
}

/** Where a server's shares are sealed to: its id and its current key. */
export interface Recipient {
  serverId: string;
  key: ServerKey;
}

/**
 * A study as every server confirmed it, and the HPKE key to seal to at each (study order): what
 * a device keeps from its enrolment. Public (no token in it), but it must come from the servers,
 * never from the relay: a relay that chose the keys could open the shares. JSON compatible with
 * the Python SDK's `Enrolment` ({study, recipients: [{server_id, suite, public_key (hex)}]}).
 */
export class Enrolment {
  readonly studyId: string;

  constructor(readonly study: Study, readonly recipients: readonly Recipient[]) {
    validateStudy(study);
    if (recipients.map((r) => r.serverId).join("\n") !== study.servers.join("\n")) {
      throw new Error("an enrolment holds one key per server of the study, in its order");
    }
    for (const r of recipients) {
      if (r.key.publicKey.length !== suite(r.key.suite).publicKeyBytes) throw new Error(`enrolment: server ${r.serverId}'s ${r.key.suite} key is of the wrong size`);
      if (keyId(r.key.publicKey) !== r.key.keyId) throw new Error(`enrolment: key id ${r.key.keyId} does not match its public key`);
    }
    try {
      checkDistinctKeys(recipients.map((r) => r.key));
    } catch {
      throw new Error("two servers of an enrolment share a public key");
    }
    this.studyId = studyId(study);
  }

  toJson(): string {
    return JSON.stringify({
      study: this.study,
      recipients: this.recipients.map((r) => ({ server_id: r.serverId, suite: r.key.suite, public_key: hex(r.key.publicKey) })),
    });
  }

  static fromJson(text: string): Enrolment {
    const doc = JSON.parse(text) as { study: Study; recipients: { server_id: string; suite: string; public_key: string }[] };
    const recipients = doc.recipients.map((r) => {
      if (!SUITES.includes(r.suite as SuiteName)) throw new Error(`enrolment: suite ${JSON.stringify(r.suite)} is not one this client seals with`);
      const publicKey = unhex(r.public_key);
      return { serverId: r.server_id, key: { suite: r.suite as SuiteName, keyId: keyId(publicKey), publicKey } };
    });
    return new Enrolment(doc.study, recipients);
  }
}

/**
 * A study whose reports no relay can carry (the Python SDK's `NotRelayable`, docs/relay.md): the
 * servers would refuse every bundle, so `enrol` enrols nothing and the rows are uploaded to the
 * servers directly instead.
 *
 * `reason` says why: `"parties"` or `"batch proofs"`, the study's own (`unrelayable`: the servers
 * answer 415), or `"relayed uploads off"`: server `serverId` at `url` publishes `relayed_uploads`
 * false in its `/v1/info` policy (`dpsketch server --relayed-uploads off`: it answers 403).
 * `serverId` and `url` are undefined for the study's own reasons.
 */
export class NotRelayable extends Error {
  /** "NotRelayable" in `err.name`, stack traces and console output (as ProblemError's) */
  override readonly name = "NotRelayable";
  constructor(
    public readonly studyId: string,
    public readonly reason: string,
    public readonly serverId?: string,
    public readonly url?: string,
  ) {
    let why: string;
    if (serverId !== undefined) {
      why = `server ${serverId} (${url}) takes no relayed uploads (its /v1/info policy says relayed_uploads false: `
        + "dpsketch server --relayed-uploads off, so it refuses every relayed bundle with 403): upload to the servers "
        + "directly (Client.submit), or ask its operator to turn relayed uploads on";
    } else if (reason === "parties") {
      why = `study ${studyId.slice(0, 12)}... has parties: a relay cannot carry them (each party uploads its blocks `
        + "to the servers directly under its own token: Client.submitBlocks)";
    } else { // "batch proofs" (or a reason a later protocol adds)
      why = `study ${studyId.slice(0, 12)}... has ${reason}: a relay cannot carry them (upload the rows to the servers `
        + "directly with Client.submit)";
    }
    super(`${why}; nothing enrolled (docs/relay.md)`);
  }
}

/**
 * What keeps a study's reports off a relay (section 7b): "parties" (a party uploads its blocks
 * under its party's token, section 2d) or "batch proofs" (each batch comes with its proof
 * record, section 4d); null: the study can be relayed. dpsketch/protocol/relayed.py's
 * `unrelayable`, the rule the servers' 415 follows.
 */
export function unrelayable(study: Study): "parties" | "batch proofs" | null {
  if (study.parties) return "parties";
  if (study.batch_proofs) return "batch proofs";
  return null;
}

/**
 * Throw a NotRelayable unless `study`'s reports can go through a relay: not for a study with
 * parties or batch proofs, nor, given `client` (connected to the study: its servers' /v1/info
 * policies, study order), at a server whose published policy says `relayed_uploads` is false
 * (`dpsketch server --relayed-uploads off`: it answers every bundle 403). The Python SDK's
 * `check_relayable`; `enrol` runs it.
 *
 * A policy without a `relayed_uploads` member, or no policy, is let through: docs/protocol.md
 * makes `/v1/info`'s `policy` optional (section 6) and never requires the member, so its absence
 * says nothing either way (another implementation, or a server from before relayed uploads).
 * Refusing it would keep such a study off every relay on a guess, and nothing is at stake in
 * letting it through: a server that takes no bundle refuses it whole itself (403, or no route),
 * nothing stored, and the device gets that refusal as the server's outcome (RelayClient.submit
 * throws it, naming the server). Only an explicit false refuses here.
 */
export function checkRelayable(study: Study, client?: Pick<Client, "endpoints" | "policies">): void {
  const id = studyId(study);
  const why = unrelayable(study);
  if (why !== null) throw new NotRelayable(id, why);
  if (!client) return;
  for (const [j, policy] of client.policies.entries()) {
    if (policy?.relayed_uploads === false) throw new NotRelayable(id, "relayed uploads off", study.servers[j], client.endpoints[j].url);
  }
}

/**
 * The enrolment of a study read from the share servers themselves (`opts.servers`: their URLs,
 * no tokens needed), with every check Client.connect makes (the recomputed id everywhere, the
 * study's rules and promise, each server's policy, its keys), sealing to `opts.sealing`. Throws
 * a NotRelayable (checkRelayable), nothing enrolled, for a study with parties or batch proofs or
 * at a server whose policy says relayed_uploads false: its bundles would be refused every time.
 */
export async function enrol(opts: Omit<ConnectOptions, "sealing"> & { sealing?: SuiteName }): Promise<Enrolment> {
  const client = await Client.connect({ ...opts, sealing: opts.sealing ?? "classical" });
  checkRelayable(client.study, client);
  const keys = client.sealingKeys!;
  return new Enrolment(client.study, client.study.servers.map((serverId, j) => ({ serverId, key: keys[j] })));
}

/** What became of one entry of a relayed bundle: 200 and its UploadResult, or its problem. */
export interface RelayedOutcome {
  status: number;
  result: UploadResult | null;
  problem: { type?: string; title?: string; detail?: string; [k: string]: unknown } | null;
}

/** One row made ready to send: its report id, its entries (study order) and its noisy ring vector. */
export interface RelayedRow {
  reportId: Uint8Array;
  entries: Entry[];
  /** the row's noisy vector in the ring, before sharing (a device's audit of its own report) */
  vector: bigint[];
}

export interface RelayOptions {
  fetch?: FetchLike;
  /** retries of the whole request (transport errors, 408, 429, 5xx) and rounds of entries worth sending again */
  retry?: Partial<RetryPolicy>;
}

/**
 * A device submitting rows through a relay, with the enrolment it holds and its upload tokens
 * (one per server, study order; none for a study that takes uploads without tokens). Each row
 * is prepared as on the direct path (one batch of one row: clip, sign, noise, full shares, bind
 * or prove), each server's share sealed to its enrolled key as a one-record version 4 batch,
 * each entry MACed with that server's token, and all of them POSTed to the relay in one request.
 */
export class RelayClient {
  readonly url: string;
  readonly tokens: (string | null)[];
  private readonly fetchFn: FetchLike;
  private readonly retry: RetryPolicy;

  constructor(relayUrl: string, readonly enrolment: Enrolment, tokens?: (string | null)[] | null, opts: RelayOptions = {}) {
    const n = enrolment.recipients.length;
    this.tokens = tokens ? tokens.slice() : new Array(n).fill(null);
    if (this.tokens.length !== n) throw new Error(`give one upload token per server of the study (${n}), in its order`);
    const study = enrolment.study;
    const why = unrelayable(study);
    if (why === "parties") throw new Error("a study with parties takes no relayed uploads: each party uploads its blocks directly (section 2d)");
    if (why === "batch proofs") throw new Error("a study with batch proofs takes no relayed uploads: a batch comes with its proof record (section 4d)");
    this.url = relayUrl.replace(/\/$/, "");
    this.fetchFn = opts.fetch ?? ((u, i) => globalThis.fetch(u, i));
    this.retry = { ...DEFAULT_RETRY, ...(opts.retry ?? {}) };
  }

  /** One row (an array in the study's column order, or an object by column name) made into its entries. */
  async entries(row: RawValue[] | Record<string, RawValue>): Promise<RelayedRow> {
    const { study, studyId: id, recipients } = this.enrolment;
    const p = prepareBatch(study, id, rowArrays(study, [row]), randomBytes(32), { full: null });
    const entries = await Promise.all(recipients.map(async (r, j) => {
      const batch = await sealServerBatch(id, r.serverId, r.key, p.reportIds, p.servers[j]);
      return makeEntry(this.tokens[j], id, r.serverId, batch);
    }));
    return { reportId: p.reportIds[0], entries, vector: Array.from(p.noisy) };
  }

  /**
   * Submit one row through the relay; its hex report id once every server stored it. Throws the
   * first refusal (a ProblemError with `serverId`), or the last outcome worth retrying once the
   * retries are spent.
   */
  async submit(row: RawValue[] | Record<string, RawValue>): Promise<string> {
    const prepared = await this.entries(row);
    const outcomes = await this.send(prepared.entries);
    outcomes.forEach((o, j) => {
      const r = o.result;
      if (!r || r.accepted + r.duplicates !== 1) throw new Error(`${this.url}: server ${prepared.entries[j].serverId} acknowledged ${r?.accepted} + ${r?.duplicates} of one report`);
    });
    return hex(prepared.reportId);
  }

  /** Send entries until none is worth sending again (the same bytes: idempotent by report id); every outcome 200. */
  async send(entries: Entry[]): Promise<RelayedOutcome[]> {
    let waiting = entries.map((_, i) => i);
    const outcomes: RelayedOutcome[] = new Array(entries.length);
    for (let attempt = 0; ; attempt++) {
      const got = await this.post(waiting.map((i) => entries[i]));
      waiting.forEach((i, k) => (outcomes[i] = got[k]));
      const refused = waiting.find((i) => outcomes[i].status !== 200 && !retryable(outcomes[i].status));
      if (refused !== undefined) throw this.problem(outcomes[refused], entries[refused].serverId);
      waiting = waiting.filter((i) => outcomes[i].status !== 200);
      if (waiting.length === 0) return outcomes;
      if (attempt >= this.retry.maxRetries) throw this.problem(outcomes[waiting[0]], entries[waiting[0]].serverId);
      await sleep(Math.min(this.retry.maxBackoff, this.retry.backoff * 2 ** attempt) * (0.5 + Math.random() / 2));
    }
  }

  /**
   * One bundle to the relay and its outcomes, one per entry in order, whatever they are (the
   * whole request retried on transport errors, 408, 429 and 5xx; another refusal of the whole
   * request is a ProblemError).
   */
  async post(entries: Entry[]): Promise<RelayedOutcome[]> {
    const resp = await request(this.fetchFn, `${this.url}/v1/studies/${this.enrolment.studyId}/relayed`,
      { method: "POST", headers: { "Content-Type": MEDIA_TYPE, Accept: "application/json" }, body: encode(entries) as unknown as BodyInit }, this.retry);
    let results: unknown;
    try {
      results = ((await resp.json()) as { results?: unknown }).results;
    } catch {
      results = undefined;
    }
    if (!Array.isArray(results) || !results.every((o) => o && typeof o === "object" && Number.isInteger((o as RelayedOutcome).status))) {
      throw new Error(`${this.url}: the relay's answer is not RelayedResults JSON`);
    }
    if (results.length !== entries.length) throw new Error(`${this.url} answered ${results.length} outcomes for ${entries.length} entries`);
    return results.map((o: RelayedOutcome) => ({ status: o.status, result: o.result ?? null, problem: o.problem ?? null }));
  }

  private problem(o: RelayedOutcome, serverId: string): ProblemError {
    const body = o.problem ?? { type: "urn:dpsketch:problem:upstream-failure", detail: `server ${serverId}: status ${o.status} without a problem` };
    return new ProblemError(o.status, body, this.url, serverId);
  }
}

