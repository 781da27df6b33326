/**
 * request() against a real HTTP server on loopback that sends a response's headers and then
 * stalls its body: the attempt's deadline covers the body, so the stalled attempt is retried
 * (and the retry's answer returned, its body readable) or, with no retry left, fails: the
 * client never waits on a stalled body for ever.
 */
import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { request, DEFAULT_RETRY } from "../src/upload.js";

/** A server whose first `stalls` answers send headers and half a body, then nothing. */
async function stallingServer(stalls: number): Promise<{ url: string; hits: () => number; close: () => void }> {
  let hits = 0;
  const server = createServer((_req, res) => {
    hits++;
    res.writeHead(200, { "Content-Type": "application/json", "Content-Length": "20" });
    if (hits <= stalls) {
      res.write('{"accepted"'); // 11 of the 20 bytes promised; the rest never comes
      return;
    }
    res.end('{"accepted": 1234}  ');
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address() as AddressInfo;
  const close = () => {
    server.closeAllConnections();
    server.close();
  };
  // A client that waits on the stalled body for ever (the bug these tests catch) must fail its
  // test, not hang the whole `node --test` run: the server drops every connection after 12 s.
  setTimeout(close, 12_000).unref();
  return { url: `http://127.0.0.1:${port}/`, hits: () => hits, close };
}

// 3 s: long enough for a loaded machine to answer the healthy attempt, short for the test
const fast = { ...DEFAULT_RETRY, timeout: 3, backoff: 0.001 };

test("a body that stalls after its headers is retried within the attempt's deadline", { timeout: 30_000 }, async () => {
  const s = await stallingServer(1);
  try {
    const retries: string[] = [];
    const resp = await request(fetch, s.url, { method: "GET" }, { ...fast, maxRetries: 2 }, (_a, why) => retries.push(why));
    assert.deepEqual(await resp.json(), { accepted: 1234 });
    assert.equal(s.hits(), 2);
    assert.equal(retries.length, 1);
    assert.match(retries[0], /^transport: /);
  } finally {
    s.close();
  }
});

test("with no retry left, a stalled body fails the request instead of hanging it", { timeout: 30_000 }, async () => {
  const s = await stallingServer(10);
  try {
    await assert.rejects(request(fetch, s.url, { method: "GET" }, { ...fast, maxRetries: 1 }));
    assert.equal(s.hits(), 2);
  } finally {
    s.close();
  }
});
