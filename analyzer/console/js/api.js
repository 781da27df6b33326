// The analyzer's REST API as the console calls it: the same /v1 routes the CLI uses
// (docs/protocol.md section 6b), with the API token as a bearer header.
//
// Where the token lives: sessionStorage (this tab, until it closes) by default; localStorage only
// when the analyst ticks "remember on this device". It never goes into a URL (the router uses
// the fragment for views only) and never into a cookie, so a browser never attaches it to a
// request by itself: a page of another origin that makes the browser call the analyzer sends no
// token (and cannot add the header itself: the analyzer allows no cross-origin request).

const KEY = "dpsketch.analyzer-token";

export function token() {
  return sessionStorage.getItem(KEY) ?? localStorage.getItem(KEY);
}

export function remembered() {
  return localStorage.getItem(KEY) !== null;
}

export function setToken(value, remember) {
  sessionStorage.setItem(KEY, value);
  if (remember) localStorage.setItem(KEY, value);
  else localStorage.removeItem(KEY);
}

export function forgetToken() {
  sessionStorage.removeItem(KEY);
  localStorage.removeItem(KEY);
}

/** A problem answer (RFC 9457, docs/protocol.md section 8) or a network failure. */
export class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

// The API lives next to the console (/console/ -> /v1/...), also behind a path prefix.
function url(path) {
  return new URL(`..${path}`, document.baseURI).toString();
}

let onUnauthorized = () => {};
export function whenUnauthorized(callback) { onUnauthorized = callback; }

export async function call(method, path, body, { signingIn = false } = {}) {
  const headers = { Accept: "application/json" };
  const bearer = token();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  const init = { method, headers, credentials: "omit", cache: "no-store", redirect: "error" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(url(path), init);
  } catch (exc) {
    throw new ApiError(0, { title: "The analyzer did not answer", detail: String(exc.message || exc) });
  }
  if (!response.ok) {
    let problem;
    try {
      problem = await response.json();
    } catch {
      problem = { title: response.statusText, detail: `HTTP ${response.status}` };
    }
    const error = new ApiError(response.status, problem);
    if (response.status === 401 && !signingIn) onUnauthorized(error);
    throw error;
  }
  return response.json();
}

const enc = encodeURIComponent;
export const api = {
  studies: () => call("GET", "/v1/studies"),
  checkToken: () => call("GET", "/v1/studies", undefined, { signingIn: true }),
  study: (id) => call("GET", `/v1/studies/${enc(id)}`),
  progress: (id) => call("GET", `/v1/studies/${enc(id)}/progress`),
  create: (body) => call("POST", "/v1/studies", body),
  recommend: (body) => call("POST", "/v1/recommend", body),
  finalize: (id) => call("POST", `/v1/studies/${enc(id)}/finalize`),
  populationLedger: (population) => call("GET", `/v1/populations/${enc(population)}/ledger`),
  analysis: (id, name, body) => call("POST", `/v1/studies/${enc(id)}/analyses/${enc(name)}`, body),
  histogram: (id, confidence) => call("GET", `/v1/studies/${enc(id)}/histogram?confidence=${enc(confidence)}`),
};
