/**
 * The Client against servers that misbehave (a fake fetch, no network): a server holding
 * another study, a closed study, a policy the study breaks, two servers with one key, a key id
 * that does not match its key; transient failures retried with the same bytes; 413 halved;
 * a refusal surfaced as its problem slug.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { Client, ProblemError } from "../src/index.js";
import { hex } from "../src/bytes.js";
import { keyId, suite } from "../src/sealing/suites.js";
import { studyId, type Study } from "../src/study.js";
import { vectors } from "./helpers.js";

const study = vectors("noise.json").find((v) => v.id === "batch-sketch-signed")!.study as Study;
const id = studyId(study);
const urls = ["http://s1.test", "http://s2.test", "http://s3.test"];

interface Fake {
  studies?: (j: number) => Study;
  status?: string;
  policy?: Record<string, unknown>;
  keys?: string[];
  post?: (j: number, body: Uint8Array, type: string, attempt: number) => Response;
}

async function fakeKeys(n: number): Promise<string[]> {
  const s = suite("classical");
  const out: string[] = [];
  for (let j = 0; j < n; j++) {
    const kp = await s.hpke.kem.generateKeyPair();
    out.push(hex(new Uint8Array(await s.hpke.kem.serializePublicKey(kp.publicKey))));
  }
  return out;
}

function fakeFetch(f: Fake, log: { url: string; body?: Uint8Array }[] = []) {
  const attempts = new Map<string, number>();
  return async (url: string, init: RequestInit): Promise<Response> => {
    const j = urls.findIndex((u) => url.startsWith(u));
    const path = url.slice(urls[j].length);
    const json = (o: unknown, status = 200) => new Response(JSON.stringify(o), { status, headers: { "Content-Type": "application/json" } });
    if (init.method === "GET" && path === `/v1/studies/${id}`) {
      const hpke = f.keys ? { kem_id: 32, current: keyId(Buffer.from(f.keys[j], "hex")), keys: [{ key_id: keyId(Buffer.from(f.keys[j], "hex")), public_key: f.keys[j] }], versions: [4] } : null;
      return json({ study_id: id, server_id: study.servers[j], status: f.status ?? "open", study: f.studies ? f.studies(j) : study, hpke });
    }
    if (init.method === "GET" && path === "/v1/info") return json({ server_id: study.servers[j], policy: f.policy ?? null });
    if (init.method === "POST" && path === `/v1/studies/${id}/batches`) {
      const body = init.body as Uint8Array;
      log.push({ url, body });
      const key = `${j}`;
      const a = (attempts.get(key) ?? 0) + 1;
      attempts.set(key, a);
      if (f.post) return f.post(j, body, (init.headers as Record<string, string>)["Content-Type"], a);
      const W = 3, N = 3;
      const m = body.length / (16 + 16 * N + (body.length % (16 + 16 * N + 8 * W) === 0 ? 8 * W : 32));
      return json({ accepted: m, duplicates: 0, report_count: m });
    }
    return json({ type: "urn:dpsketch:problem:not-found", status: 404 }, 404);
  };
}

const servers = urls.map((url) => ({ url }));
const rows = Array.from({ length: 8 }, (_, i) => [0.1 * i, -0.05 * i, 0.2]);

test("a server that holds another study (its id recomputed) is refused before anything is sent", async () => {
  const fetch = fakeFetch({ studies: (j) => (j === 1 ? { ...study, epsilon: 2 } : study) });
  await assert.rejects(Client.connect({ studyId: id, servers, fetch }), /holds a study whose id is/);
});

test("a closed study and a study outside a server's published policy are refused", async () => {
  await assert.rejects(Client.connect({ studyId: id, servers, fetch: fakeFetch({ status: "committed" }) }), /not open/);
  await assert.rejects(Client.connect({ studyId: id, servers, fetch: fakeFetch({ policy: { max_epsilon: 0.5 } }) }), /max_epsilon/);
  await assert.rejects(Client.connect({ studyId: id, servers, fetch: fakeFetch({ policy: { max_floor_epsilon: 2 } }) }), /max_floor_epsilon/);
});

test("sealing: two servers publishing one key are refused; a key id that lies is refused", async () => {
  const keys = await fakeKeys(3);
  await assert.rejects(Client.connect({ studyId: id, servers, sealing: "classical", fetch: fakeFetch({ keys: [keys[0], keys[1], keys[0]] }) }), /same public key/);
  const c = await Client.connect({ studyId: id, servers, sealing: "classical", fetch: fakeFetch({ keys }) });
  assert.equal(c.endpoints.length, 3);
  await assert.rejects(Client.connect({ studyId: id, servers, sealing: "post-quantum", fetch: fakeFetch({ keys }) }), /no post-quantum keys/);
});

test("transient failures are retried with the same bytes; progress reaches the end", async () => {
  const log: { url: string; body?: Uint8Array }[] = [];
  const fetch = fakeFetch({
    post: (j, body, _type, attempt) => (j === 2 && attempt <= 2
      ? new Response(JSON.stringify({ type: "urn:dpsketch:problem:unavailable", status: 503 }), { status: 503, headers: { "Retry-After": "0" } })
      : new Response(JSON.stringify({ accepted: body.length / (16 + 48 + 24), duplicates: 0, report_count: 0 }), { status: 200 })),
  }, log);
  const c = await Client.connect({ studyId: id, servers, fetch, retry: { backoff: 0.001 } });
  const retries: number[] = [];
  const progress: number[] = [];
  const r = await c.submit(rows, { onRetry: (_s, a) => retries.push(a), onProgress: (p) => progress.push(p.rowsDone) });
  assert.deepEqual(retries, [1, 2]);
  assert.deepEqual(progress, [8]);
  const toS3 = log.filter((e) => e.url.startsWith(urls[2])).map((e) => hex(e.body!));
  assert.equal(toS3.length, 3);
  assert.ok(toS3.every((b) => b === toS3[0]), "a retry resends the very same bytes");
  assert.deepEqual(r.accepted, [8, 8, 8]);
});

test("413 halves a batch (the same records); a refusal surfaces as its problem", async () => {
  const sizes: number[] = [];
  const fetch = fakeFetch({
    post: (_j, body) => {
      const m = body.length / (16 + 48 + 24);
      sizes.push(m);
      return m > 2
        ? new Response(JSON.stringify({ type: "urn:dpsketch:problem:payload-too-large", status: 413 }), { status: 413 })
        : new Response(JSON.stringify({ accepted: m, duplicates: 0, report_count: 0 }), { status: 200 });
    },
  });
  const c = await Client.connect({ studyId: id, servers, fetch });
  const r = await c.submit(rows);
  assert.deepEqual(r.accepted, [8, 8, 8]);
  assert.ok(sizes.includes(8) && sizes.includes(4) && sizes.includes(2));
  const refusing = fakeFetch({ post: () => new Response(JSON.stringify({ type: "urn:dpsketch:problem:binding-refused", status: 422, detail: "x" }), { status: 422 }) });
  const c2 = await Client.connect({ studyId: id, servers, fetch: refusing });
  await assert.rejects(c2.submit(rows), (e: unknown) => {
    assert.ok(e instanceof ProblemError && e instanceof Error);
    assert.deepEqual([e.slug, e.status], ["binding-refused", 422]);
    // named in err.name, hence in its stack and console output (not "Error")
    assert.equal(e.name, "ProblemError");
    assert.match(String(e.stack), /^ProblemError: http:\/\/s1\.test.*: 422 urn:dpsketch:problem:binding-refused x\n/);
    assert.equal(String(e), `ProblemError: ${e.message}`);
    return true;
  });
});

test("the same submission secret rebuilds the same reports; a fresh one does not", async () => {
  const c = await Client.connect({ studyId: id, servers, fetch: fakeFetch({}) });
  const a = await c.submit(rows, { batchSize: 3 });
  const b = await c.submit(rows, { batchSize: 3, secret: a.secret });
  const fresh = await c.submit(rows, { batchSize: 3 });
  assert.deepEqual(b.reportIds, a.reportIds);
  assert.equal(new Set([...a.reportIds, ...fresh.reportIds]).size, 16);
});
