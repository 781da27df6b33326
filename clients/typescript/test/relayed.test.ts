/**
 * Relayed uploads (docs/protocol.md section 7b): section 9's `relayed` vector byte for byte (token
 * digest, id, MAC key, the sealed batch's header and transcript, the MAC, the entry and its
 * bundle), malformed bundles named, the enrolment's JSON (the Python SDK's shape) and its checks,
 * and a RelayClient against a relay that misbehaves (a fake fetch, no network): outcomes worth
 * retrying resent with the same bytes and only those, the first refusal surfaced with its server;
 * enrol over fake servers refusing (NotRelayable, naming the server) only where a policy says
 * relayed_uploads false, and a study with parties or batch proofs.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { hex, unhex } from "../src/bytes.js";
import { keyId, suite } from "../src/sealing/suites.js";
import { transcript } from "../src/sealing/v4.js";
import * as relayed from "../src/relayed.js";
import { Enrolment, NotRelayable, ProblemError, RelayClient, checkRelayable, enrol } from "../src/index.js";
import { studyId, type Study } from "../src/study.js";
import { section9, vectors } from "./helpers.js";

test("relayed: section 9's vector, every byte from section 7b's definitions", () => {
  const doc = section9();
  const v = doc.relayed;
  const sealed = doc.sealed_v4.find((x: any) => x.suite === "classical");
  assert.equal(v.study_id, sealed.study_id);
  assert.equal(v.server_id, sealed.server_id);
  const batch = unhex(sealed.body);
  const digest = relayed.tokenDigest(v.token);
  assert.equal(hex(digest), v.token_digest);
  assert.equal(hex(relayed.tokenId(digest)), v.token_id);
  assert.equal(hex(relayed.macKey(digest)), v.mac_key);
  const header = relayed.batchHeader(batch);
  assert.equal(header.length, 117);
  assert.equal(hex(header), v.batch_header);
  const t = transcript(v.study_id, v.server_id, header);
  assert.equal(hex(t), v.transcript);
  assert.equal(hex(relayed.ENTRY_LABEL) + hex(t), v.mac_input);
  assert.equal(hex(relayed.entryMac(digest, v.study_id, v.server_id, batch)), v.mac);
  const entry = relayed.makeEntry(v.token, v.study_id, v.server_id, batch);
  assert.equal(hex(relayed.encodeEntry(entry)), v.entry);
  const bundle = relayed.encode([entry]);
  assert.equal(hex(bundle), v.bundle);
  assert.equal(hex(relayed.encode([relayed.encodeEntry(entry)])), v.bundle);
  const [back] = relayed.decode(bundle);
  assert.equal(back.serverId, v.server_id);
  assert.equal(hex(relayed.encodeEntry(back)), v.entry);
  assert.ok(relayed.verifyMac(digest, v.study_id, v.server_id, back));
  // another token, study or server gives another MAC
  assert.ok(!relayed.verifyMac(relayed.tokenDigest(v.token + "x"), v.study_id, v.server_id, back));
  assert.ok(!relayed.verifyMac(digest, "ab".repeat(32), v.server_id, back));
  assert.ok(!relayed.verifyMac(digest, v.study_id, "s2", back));
  // a study without tokens: zero id and MAC
  const open = relayed.makeEntry(null, v.study_id, v.server_id, batch);
  assert.equal(hex(open.tokenId) + hex(open.mac), "00".repeat(40));
  assert.throws(() => relayed.makeEntry(v.token, v.study_id, v.server_id, new Uint8Array(40)), /not a version 4 sealed batch/);
});

test("relayed: a bundle round-trips and every malformed bundle is named", () => {
  const e = { serverId: "s1", tokenId: new Uint8Array(8).fill(1), mac: new Uint8Array(32).fill(2), batch: new Uint8Array(150).fill(3) };
  const f = { serverId: "server-two", tokenId: relayed.NO_TOKEN_ID, mac: relayed.NO_MAC, batch: new Uint8Array(7).fill(4) };
  const body = relayed.encode([e, f]);
  assert.equal(hex(body.subarray(0, 4)), "00000002");
  assert.equal(body.length, 4 + (1 + 2 + 8 + 32 + 4 + 150) + (1 + 10 + 44 + 7));
  assert.deepEqual(relayed.decode(body).map(relayed.encodeEntry).map(hex), [e, f].map(relayed.encodeEntry).map(hex));
  const cases: [Uint8Array, RegExp][] = [
    [new Uint8Array(0), /entry count/],
    [new Uint8Array(4), /1 to/],
    [body.subarray(0, body.length - 1), /runs past/],
    [Uint8Array.of(...body, 0x78), /1 bytes follow/],
    [Uint8Array.of(0, 0, 0, 3, ...body.subarray(4)), /missing/],
    [Uint8Array.of(0, 0, 0, 1, 0, ...body.subarray(6)), /empty server id/],
  ];
  for (const [bad, why] of cases) assert.throws(() => relayed.decode(bad), why);
  assert.throws(() => relayed.encode([]), /1 to 65536/);
});

const study = vectors("noise.json").find((v) => v.id === "batch-sketch-signed")!.study as Study;
const id = studyId(study);

async function freshKeys(n: number): Promise<Uint8Array[]> {
  const s = suite("classical");
  const out: Uint8Array[] = [];
  for (let j = 0; j < n; j++) {
    const kp = await s.hpke.kem.generateKeyPair();
    out.push(new Uint8Array(await s.hpke.kem.serializePublicKey(kp.publicKey)));
  }
  return out;
}

function pythonJson(keys: Uint8Array[], order = study.servers): string {
  // the Python SDK's Enrolment.to_json: {study, recipients: [{server_id, suite, public_key}]}
  return JSON.stringify({ study, recipients: order.map((s, j) => ({ server_id: s, suite: "classical", public_key: hex(keys[j]) })) });
}

test("enrolment: the Python SDK's JSON loads, saves back the same, and is checked", async () => {
  const keys = await freshKeys(3);
  const e = Enrolment.fromJson(pythonJson(keys));
  assert.equal(e.studyId, id);
  assert.deepEqual(e.recipients.map((r) => r.key.keyId), keys.map(keyId));
  assert.deepEqual(JSON.parse(e.toJson()), JSON.parse(pythonJson(keys)));
  assert.throws(() => Enrolment.fromJson(pythonJson(keys, [...study.servers].reverse())), /one key per server/);
  assert.throws(() => Enrolment.fromJson(pythonJson([keys[0], keys[1], keys[0]])), /share a public key/);
  assert.throws(() => Enrolment.fromJson(pythonJson(keys).replaceAll('"classical"', '"rot13"')), /suite "rot13"/);
});

interface Post {
  entries: relayed.Entry[];
  body: Uint8Array;
}

/** A relay answering each entry by `answer(serverId, attempt at that server)`. */
function fakeRelay(answer: (serverId: string, attempt: number) => relayed.RelayedOutcome, log: Post[]) {
  const attempts = new Map<string, number>();
  return async (url: string, init: RequestInit): Promise<Response> => {
    assert.equal(url, `http://relay.test/v1/studies/${id}/relayed`);
    assert.equal((init.headers as Record<string, string>)["Content-Type"], relayed.MEDIA_TYPE);
    const body = init.body as Uint8Array;
    const entries = relayed.decode(body);
    log.push({ entries, body });
    const results = entries.map((e) => {
      const a = (attempts.get(e.serverId) ?? 0) + 1;
      attempts.set(e.serverId, a);
      return answer(e.serverId, a);
    });
    return new Response(JSON.stringify({ results }), { status: 200, headers: { "Content-Type": "application/json" } });
  };
}

const stored: relayed.RelayedOutcome = { status: 200, result: { accepted: 1, duplicates: 0, report_count: 1 }, problem: null };
const busy: relayed.RelayedOutcome = { status: 502, result: null, problem: { type: "urn:dpsketch:problem:upstream-failure", status: 502 } };

test("relay client: one request, entries MACed per server; a 502 outcome resent with the same bytes, alone", async () => {
  const enrolment = Enrolment.fromJson(pythonJson(await freshKeys(3)));
  const tokens = ["tok-a-0000000000000000000000", "tok-b-0000000000000000000000", "tok-c-0000000000000000000000"];
  const log: Post[] = [];
  const third = study.servers[2];
  const fetch = fakeRelay((sid, a) => (sid === third && a <= 2 ? busy : stored), log);
  const rc = new RelayClient("http://relay.test/", enrolment, tokens, { fetch, retry: { backoff: 0.001 } });
  const reportId = await rc.submit([0.1, -0.2, 0.3]);
  assert.match(reportId, /^[0-9a-f]{32}$/);
  assert.equal(log.length, 3);
  assert.deepEqual(log[0].entries.map((e) => e.serverId), study.servers);
  log[0].entries.forEach((e, j) => {
    const digest = relayed.tokenDigest(tokens[j]);
    assert.equal(hex(e.tokenId), hex(digest.subarray(0, 8)));
    assert.ok(relayed.verifyMac(digest, id, study.servers[j], e));
    assert.equal(e.batch[24], 0x80);
    assert.equal(e.batch[25], 4);
    // one record: count 1, its report id the row's
    assert.equal(hex(e.batch.subarray(33, 37)), "00000001");
    assert.equal(hex(e.batch.subarray(117, 133)), reportId);
  });
  const first = relayed.encodeEntry(log[0].entries[2]);
  for (const later of log.slice(1)) {
    assert.equal(later.entries.length, 1);
    assert.equal(hex(relayed.encodeEntry(later.entries[0])), hex(first));
  }
});

test("relay client: the first refusal is a ProblemError naming its server; retries spent end in the last outcome", async () => {
  const enrolment = Enrolment.fromJson(pythonJson(await freshKeys(3)));
  const refused: relayed.RelayedOutcome = { status: 401, result: null, problem: { type: "urn:dpsketch:problem:unauthorized", status: 401, detail: "mac" } };
  const second = study.servers[1];
  const log: Post[] = [];
  const rc = new RelayClient("http://relay.test", enrolment, null, { fetch: fakeRelay((sid) => (sid === second ? refused : stored), log) });
  await assert.rejects(rc.submit([0, 0, 0]), (e: unknown) => e instanceof ProblemError && e.status === 401 && e.slug === "unauthorized" && e.serverId === second);
  assert.equal(log.length, 1);
  assert.ok(log[0].entries.every((e) => hex(e.tokenId) === "00".repeat(8) && hex(e.mac) === "00".repeat(32)));
  const always = new RelayClient("http://relay.test", enrolment, null, { fetch: fakeRelay(() => busy, []), retry: { maxRetries: 2, backoff: 0.001 } });
  await assert.rejects(always.submit([0, 0, 0]), (e: unknown) => e instanceof ProblemError && e.status === 502 && e.slug === "upstream-failure");
  assert.throws(() => new RelayClient("http://relay.test", enrolment, ["only-one"]), /one upload token per server/);
});

/** Three servers (no network) holding `study`, each with its key and `policies[j]` as its /v1/info policy. */
function fakeServers(keys: Uint8Array[], policies: (Record<string, unknown> | null | undefined)[]) {
  return async (url: string): Promise<Response> => {
    const j = Number(/^http:\/\/s(\d)\.test/.exec(url)![1]) - 1;
    const path = url.slice("http://s1.test".length);
    const info = path === "/v1/info"
      ? { server_id: study.servers[j], ...(policies[j] === undefined ? {} : { policy: policies[j] }) }
      : { study_id: id, server_id: study.servers[j], status: "open", study,
          hpke: { kem_id: 32, current: keyId(keys[j]), keys: [{ key_id: keyId(keys[j]), public_key: hex(keys[j]) }], versions: [4] } };
    return new Response(JSON.stringify(info), { status: 200, headers: { "Content-Type": "application/json" } });
  };
}

test("enrol: refused (NotRelayable, naming the server) only where a policy says relayed_uploads false", async () => {
  const keys = await freshKeys(3);
  const servers = [1, 2, 3].map((k) => ({ url: `http://s${k}.test` }));
  // no member, no policy, true, a string "false" (not false): let through, as the Python SDK does
  // (docs/protocol.md section 6 requires neither the policy nor the member); checked as enrol does
  // on a connected client's policies (a Client.connect costs a few hundred ms: one is enough)
  const endpoints = servers;
  for (const policies of [[{}, null, { max_epsilon: 10 }], [{ relayed_uploads: true }, null, { relayed_uploads: "false" }]]) {
    checkRelayable(study, { endpoints, policies });
  }
  assert.throws(() => checkRelayable(study, { endpoints, policies: [null, null, { relayed_uploads: false }] }),
    (e: unknown) => e instanceof NotRelayable && e.serverId === study.servers[2] && e.url === "http://s3.test");
  const off = fakeServers(keys, [{ relayed_uploads: true }, { relayed_uploads: false }, { relayed_uploads: false }]);
  await assert.rejects(enrol({ studyId: id, servers, fetch: off }), (e: unknown) => {
    assert.ok(e instanceof NotRelayable && e instanceof Error);
    assert.equal(e.name, "NotRelayable"); // in its stack and console output too, not "Error"
    assert.ok(String(e.stack).startsWith(`NotRelayable: ${e.message}\n`), e.stack);
    assert.deepEqual([e.reason, e.serverId, e.url, e.studyId], ["relayed uploads off", study.servers[1], "http://s2.test", id]);
    assert.match(e.message, /^server \S+ \(http:\/\/s2\.test\) takes no relayed uploads \(its \/v1\/info policy says relayed_uploads false/);
    assert.match(e.message, /upload to the servers directly \(Client\.submit\).*; nothing enrolled \(docs\/relay\.md\)$/);
    return true;
  });
  // the same servers publishing no policy: enrolled
  assert.equal((await enrol({ studyId: id, servers, fetch: fakeServers(keys, [undefined, undefined, undefined]) })).studyId, id);
});

test("checkRelayable: a study with parties or batch proofs, whatever its servers publish", () => {
  checkRelayable(study);
  const parties = { ...study, parties: [{ name: "p", columns: study.columns.slice(0, 1) }, { name: "q", columns: study.columns.slice(1) }] } as Study;
  const proofs = { ...study, batch_proofs: true } as Study;
  for (const [s, reason, hint] of [[parties, "parties", /Client\.submitBlocks/], [proofs, "batch proofs", /directly with Client\.submit\)/]] as const) {
    assert.throws(() => checkRelayable(s), (e: unknown) => e instanceof NotRelayable && e.reason === reason && e.serverId === undefined
      && e.message.startsWith(`study ${studyId(s).slice(0, 12)}... has ${reason}: a relay cannot carry them`) && hint.test(e.message));
  }
});
