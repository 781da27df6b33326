// Building the page: elements from data, never from HTML strings. Every text the API or the
// analyst supplies (a study's name, a problem's detail) goes in as a text node, so nothing can
// turn into markup; the page's CSP also asks Chromium to refuse any HTML string assignment
// (require-trusted-types-for 'script').

const BOOLEAN_PROPS = new Set(["hidden", "disabled", "checked", "required", "selected", "open", "multiple"]);

/** h("tag", {class, id, for, data-*, aria-*, onclick: fn, ...}, ...children) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttributes(el, attrs);
  append(el, children);
  return el;
}

export function setAttributes(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (BOOLEAN_PROPS.has(key)) {
      el[key] = true;
    } else if (key === "value") {
      el.value = String(value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.firstChild.remove();
  return el;
}

let uid = 0;
/** A fresh id for label/aria references. */
export function newId(prefix = "c") {
  uid += 1;
  return `${prefix}-${uid}`;
}

/** A number for people: 4 significant digits, exponent form outside [1e-3, 1e6). null: "n/a". */
export function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "n/a";
  if (typeof x !== "number") return String(x);
  if (!Number.isFinite(x)) return x > 0 ? "∞" : x < 0 ? "-∞" : "n/a";
  if (x === 0) return "0";
  const a = Math.abs(x);
  const rounded = Number(x.toPrecision(digits));
  if (a >= 1e6 || a < 1e-3) return rounded.toExponential();
  return rounded.toString();
}

/** A table cell holding a number: shown rounded, the exact value kept in data-value. */
export function numCell(x, tag = "td") {
  return h(tag, { class: "num", "data-value": x === null || x === undefined ? "" : String(x) }, fmt(x));
}

export function bytes(n) {
  if (n === null || n === undefined) return "n/a";
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

/** Say something to screen readers (the polite live region of index.html). */
export function announce(text) {
  const region = document.getElementById("announce");
  if (region) region.textContent = text;
}

/** A labelled form control: returns {wrap, input}. */
export function field(label, control, hint) {
  const id = control.id || newId("f");
  control.id = id;
  const parts = [h("label", { for: id }, label), control];
  if (hint) {
    const hintId = `${id}-hint`;
    control.setAttribute("aria-describedby", hintId);
    parts.push(h("span", { class: "hint", id: hintId }, hint));
  }
  return h("div", { class: "field" }, parts);
}

/** A checkbox with its label after it. */
export function check(label, input) {
  const id = input.id || newId("k");
  input.id = id;
  input.type = "checkbox";
  return h("div", { class: "check" }, input, h("label", { for: id }, label));
}

/** An error paragraph from an ApiError (its problem's title and detail) or any Error. */
export function errorBox(error) {
  const problem = error.problem;
  const text = problem ? `${problem.title || "Error"}${problem.detail ? `: ${problem.detail}` : ""}` : String(error.message || error);
  return h("p", { class: "error", role: "alert" }, text);
}

export function table(caption, headers, rows, attrs = {}) {
  return h("table", attrs,
    caption ? h("caption", {}, caption) : null,
    h("thead", {}, h("tr", {}, headers.map((x) => (x instanceof Node ? x : h("th", { scope: "col" }, x))))),
    h("tbody", {}, rows));
}
