// The console's entry point: the token gate and a router over the URL fragment
// (#/studies, #/new, #/study/<id>, #/ledger/<population>). The fragment names views only: no
// token or data ever goes into a URL.

import { api, forgetToken, remembered, setToken, token, whenUnauthorized } from "./api.js";
import { announce, check, clear, errorBox, field, h } from "./dom.js";
import { renderCreate } from "./views/create.js";
import { renderLedger } from "./views/ledger.js";
import { renderStudies } from "./views/studies.js";
import { renderStudy } from "./views/study.js";

const main = document.getElementById("main");
const signOut = document.getElementById("sign-out");

// Views register timers (progress refresh) here; a route change stops them.
const timers = new Set();
export function every(ms, fn) {
  const id = setInterval(fn, ms);
  timers.add(id);
  return id;
}

function stopTimers() {
  for (const id of timers) clearInterval(id);
  timers.clear();
}

function tokenForm(message) {
  stopTimers();
  clear(main);
  const input = h("input", { type: "password", id: "token", autocomplete: "off", spellcheck: "false", required: true });
  const remember = h("input", { id: "remember" });
  const status = h("div", { id: "token-status" });
  const form = h("form", { id: "token-form", novalidate: true },
    field("Analyzer API token", input, "The api_token of the analyzer's cluster configuration (dpsketch demo --keep prints it)."),
    check("Remember on this device (kept in this browser's local storage until you choose Forget token)", remember),
    h("div", { class: "actions" }, h("button", { type: "submit" }, "Use this token")),
    status);
  // No name attributes and form-action 'none': even without this handler the token cannot
  // leave the page in a form submission's URL.
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = input.value.trim();
    clear(status);
    if (!value) {
      status.append(h("p", { class: "error", role: "alert" }, "Enter the token."));
      input.focus();
      return;
    }
    setToken(value, remember.checked);
    try {
      await api.checkToken();
    } catch (error) {
      forgetToken();
      status.append(errorBox(error));
      input.focus();
      return;
    }
    input.value = "";
    announce("Token accepted.");
    route();
  });
  main.append(
    h("h1", {}, "Sign in to the analyzer"),
    h("p", { class: "lede" }, "The console calls this analyzer's REST API with your API token as a bearer header. The token stays in this browser tab (session storage) unless you tick the box below; it is never put in a URL."),
    message ? h("p", { class: "error", role: "alert" }, message) : null,
    form);
  signOut.hidden = true;
  input.focus();
}

whenUnauthorized(() => {
  forgetToken();
  tokenForm("The analyzer refused the token (401). Enter it again.");
});

signOut.addEventListener("click", () => {
  forgetToken();
  announce("Token forgotten.");
  tokenForm();
});

function markNav(path) {
  for (const link of document.querySelectorAll("nav a")) {
    const target = link.getAttribute("href").slice(1);
    if (path === target || path.startsWith(`${target}/`)) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

async function route() {
  stopTimers();
  if (!token()) {
    tokenForm();
    return;
  }
  // a remembered token is copied into this tab's session so both stay in step
  if (remembered() && sessionStorage.length === 0) setToken(token(), true);
  signOut.hidden = false;
  const path = decodeURIComponent(location.hash.replace(/^#/, "")) || "/studies";
  const parts = path.split("/").filter(Boolean);
  markNav(path);
  clear(main);
  main.append(h("p", { class: "status" }, "Loading…"));
  const ctx = { main, every, reload: route, navigate: (to) => { location.hash = to; } };
  try {
    if (parts[0] === "new") await renderCreate(ctx);
    else if (parts[0] === "study" && parts[1]) await renderStudy(ctx, parts[1]);
    else if (parts[0] === "ledger") await renderLedger(ctx, parts[1] || null);
    else await renderStudies(ctx);
  } catch (error) {
    if (error.status === 401) return;
    clear(main);
    main.append(h("h1", {}, "Something went wrong"), errorBox(error));
  }
  const heading = main.querySelector("h1");
  if (heading) document.title = `${heading.textContent} · dpsketch console`;
}

window.addEventListener("hashchange", () => {
  route().then(() => main.focus({ preventScroll: true }));
});
route();
