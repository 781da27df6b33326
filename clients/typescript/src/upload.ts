/**
 * Talking to the share servers (docs/protocol.md section 6): one logical request retried on
 * transport errors, 408, 429 and 5xx (the server's Retry-After honoured), problem JSON turned
 * into a ProblemError, and a batch POST that halves itself on 413. Uploads are idempotent by
 * report id, so resending the same records is always safe.
 */

export class ProblemError extends Error {
  /** "ProblemError" in `err.name`, stack traces and console output (a string, not the class's
   * name: a minifier may rename the class) */
  override readonly name = "ProblemError";
  constructor(
    public readonly status: number,
    public readonly problem: { type?: string; title?: string; detail?: string; [k: string]: unknown },
    public readonly url: string,
    /** a relayed entry's refusal (relayed.ts): the server that refused it */
    public readonly serverId?: string,
  ) {
    super(`${url}: ${serverId === undefined ? "" : `server ${serverId}: `}${status} ${problem.type ?? ""} ${problem.detail ?? problem.title ?? ""}`.trim());
  }
  get slug(): string {
    return String(this.problem.type ?? "").replace("urn:dpsketch:problem:", "");
  }
}

export interface RetryPolicy {
  maxRetries: number;
  backoff: number; // seconds, doubled per attempt
  maxBackoff: number;
  maxRetryAfter: number;
  timeout: number; // seconds per attempt, the response's body included
}

export const DEFAULT_RETRY: RetryPolicy = { maxRetries: 6, backoff: 0.25, maxBackoff: 20, maxRetryAfter: 120, timeout: 60 };

/** Statuses worth sending the same request again for: 408, 429 and 5xx but 501 and 505. */
export const retryable = (status: number) => status === 408 || status === 429 || (status >= 500 && status !== 501 && status !== 505);
export const sleep = (s: number) => new Promise((r) => setTimeout(r, s * 1000));

export type FetchLike = (url: string, init: RequestInit) => Promise<Response>;

export async function request(
  fetchFn: FetchLike,
  url: string,
  init: RequestInit,
  policy: RetryPolicy = DEFAULT_RETRY,
  onRetry?: (attempt: number, why: string) => void,
): Promise<Response> {
  for (let attempt = 0; ; attempt++) {
    let why: string;
    let retryAfter: string | null = null;
    try {
      // The attempt's deadline covers the body as well as the headers: a server (or a proxy)
      // that sends its headers and then stalls is retried, never waited on for ever. The
      // caller gets the response with its body already read.
      const ctl = new AbortController();
      const timer = setTimeout(() => ctl.abort(), policy.timeout * 1000);
      let resp: Response;
      let body: ArrayBuffer;
      try {
        resp = await fetchFn(url, { ...init, signal: ctl.signal });
        body = await resp.arrayBuffer();
      } finally {
        clearTimeout(timer);
      }
      if (resp.ok) {
        const bodyless = resp.status === 204 || resp.status === 205 || resp.status === 304;
        return new Response(bodyless ? null : body, { status: resp.status, statusText: resp.statusText, headers: resp.headers });
      }
      if (!retryable(resp.status) || attempt >= policy.maxRetries) {
        let problem: Record<string, unknown>;
        const text = new TextDecoder().decode(body);
        try {
          problem = JSON.parse(text);
        } catch {
          problem = { detail: text.slice(0, 200) };
        }
        throw new ProblemError(resp.status, problem, url);
      }
      retryAfter = resp.headers.get("Retry-After");
      why = `status ${resp.status}`;
    } catch (e) {
      if (e instanceof ProblemError) throw e;
      if (attempt >= policy.maxRetries) throw e;
      why = `transport: ${(e as Error).message}`;
    }
    let delay = Math.min(policy.maxBackoff, policy.backoff * 2 ** attempt) * (0.5 + Math.random() / 2);
    if (retryAfter !== null) {
      const secs = Number(retryAfter);
      const wait = Number.isFinite(secs) ? secs : (Date.parse(retryAfter) - Date.now()) / 1000;
      if (Number.isFinite(wait)) delay = Math.max(delay, Math.min(Math.max(wait, 0), policy.maxRetryAfter));
    }
    onRetry?.(attempt + 1, why);
    await sleep(delay);
  }
}

export async function getJson<T>(fetchFn: FetchLike, url: string, policy?: RetryPolicy): Promise<T> {
  const resp = await request(fetchFn, url, { method: "GET", headers: { Accept: "application/json" } }, policy);
  return (await resp.json()) as T;
}

export interface UploadResult {
  accepted: number;
  duplicates: number;
  report_count: number | null;
}
