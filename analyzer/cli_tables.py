"""Readable tables for ``dpsketch study`` (``--output table``): one function per answer shape.

The JSON the analyzer answers is the source of truth (``--output json`` prints it as it is); a
table shows what an analyst reads first: the numbers in the data's units with their intervals,
progress against min_reports, the guarantees. Anything a shape does not name falls back to the
JSON, so a new member of an answer is never hidden.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows) and rows
               for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths)))

    return "\n".join([line(list(headers)), line(["-" * w for w in widths]), *(line(r) for r in cells)]).rstrip()


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.6g}" if abs(v) >= 1e-4 or v == 0 else f"{v:.3e}"
    return str(v)


def _interval(ci: Sequence[float] | None) -> str:
    if not ci:
        return "-"
    return f"[{_cell(float(ci[0]))}, {_cell(float(ci[1]))}]"


def regression(out: dict[str, Any]) -> str:
    """Coefficients (and intercept) with standard errors and confidence intervals."""
    names = list(out["features"])
    coef = list(out["coef"])
    se = out.get("stderr") or [None] * len(coef)
    ci = out.get("conf_int") or [None] * len(coef)
    rows = [[n, c, s, _interval(i)] for n, c, s, i in zip(names, coef, se, ci)]
    if out.get("fit_intercept") or out.get("intercept"):
        rows.append(["(intercept)", out["intercept"], out.get("intercept_stderr"),
                     _interval(out.get("intercept_conf_int"))])
    level = out.get("confidence")
    head = ["feature", "coef", "std err", f"{level:.0%} interval" if level else "interval"]
    units = "in the data's units" if out.get("in_units") else "in the scale the rows were sent in (no bounds)"
    text = [f"{out.get('label', '')} ~ {' + '.join(names)}   ({out['n_reports']} reports, {units})",
            table(head, rows)]
    if "alpha" in out:
        text.append(f"alpha = {_cell(float(out['alpha']))}")
    return "\n".join(text)


def pca(out: dict[str, Any]) -> str:
    cols = out["columns"]
    rows = [[f"PC{i + 1}", v, *c] for i, (v, c) in enumerate(zip(out["explained_variance"], out["components"]))]
    text = [table(["component", "variance", *cols], rows)]
    if out.get("centered"):
        text.append(table(["", *cols], [["mean", *out["mean"]]]))
    return "\n".join(text)


def progress(out: dict[str, Any]) -> str:
    need = int(out["min_reports"])
    rows = []
    for s in out["servers"]:
        held = s.get("report_count")
        share = "-" if held is None else f"{min(held / need, 9.99):.0%}"
        state = s.get("status") if s.get("reachable") else f"unreachable: {s.get('error')}"
        rows.append([s["server_id"], "private" if held is None and s.get("reachable") else held, need, share, state])
    text = (f"study {out['study_id']} is {out['state']}\n"
            + table(["server", "reports", "min_reports", "progress", "status"], rows))
    if out.get("verification"):
        text += "\n" + verification(out["verification"])
    return text


def study(out: dict[str, Any]) -> str:
    st = out["study"]
    g = out.get("guarantees") or {}
    lines = [f"study {out['study_id']}  ({st['kind']}, {out['state']})",
             f"  name: {st['name']}",
             f"  columns: {', '.join(st['columns'])}" + (f"; label {st['label']}" if st.get("label") else "")]
    if st.get("bounds"):
        lines.append("  bounds: " + ", ".join(f"{c} in [{_cell(float(lo))}, {_cell(float(hi))}]"
                                             for c, (lo, hi) in zip(st["columns"], st["bounds"])))
    lines.append(f"  guarantees: epsilon = {_cell(g.get('epsilon'))} at delta = {_cell(g.get('delta'))} "
                 f"({g.get('neighbouring')}), floor epsilon = {_cell(g.get('floor_epsilon'))}")
    lines.append(f"  min_reports = {st['min_reports']}, max_reports = {st['max_reports']}, servers: "
                 f"{', '.join(st['servers'])}")
    if out.get("n_reports") is not None:
        lines.append(f"  released over {out['n_reports']} reports")
    if out.get("verification"):
        lines.append("  " + verification(out["verification"]))
    return "\n".join(lines)


def verification(v: dict[str, Any]) -> str:
    """A validity study's round in one line: decided, refused, and refused by which server."""
    by = ", ".join(f"{sid} {n}" for sid, n in v.get("refused_by_server", {}).items())
    return (f"validity proofs: {v['decided']} reports checked by every server, {v['refused']} refused "
            f"(by server: {by})")


def studies(out: list[dict[str, Any]]) -> str:
    rows = [[s["study_id"][:16] + "...", s["study"]["kind"], s["state"], s["study"]["name"],
             s.get("n_reports")] for s in out]
    return table(["study", "kind", "state", "name", "reports"], rows) if rows else "no studies"


def ledger_summary(view: dict) -> str:
    """One line per server: composed epsilon against the naive sum and the budget."""
    if view.get("population") is None:
        return ("this study names no population; the servers charge it to the populations their "
                "operators issue its upload tokens for (GET /v1/populations/{p}/ledger)")
    lines = [f"population {view['population']}:"]
    for s in view["servers"]:
        book = s.get("ledger")
        if book is None:
            lines.append(f"  {s['server_id']}: unreadable ({s.get('error')})")
            continue
        eps = "unbounded" if book["epsilon"] is None else f"{book['epsilon']:.4g}"
        naive = "unbounded" if book["naive_epsilon"] is None else f"{book['naive_epsilon']:.4g}"
        budget = ("no budget" if book["budget_epsilon"] is None
                  else f"budget {book['budget_epsilon']:g}")
        lines.append(f"  {s['server_id']}: {len(book['studies'])} studies, epsilon = {eps} at delta = "
                     f"{book['delta']:g} ({book['neighbouring']}; naive sum {naive}); {budget}")
    return "\n".join(lines)


def statistic(out: dict[str, Any]) -> str:
    rows = [[out.get("statistic"), out.get("value"), out.get("se"), _interval(out.get("ci"))]]
    text = table(["statistic", "value", "std err", f"{out.get('confidence', 0.95):.0%} interval"], rows)
    details = out.get("details") or {}
    if details.get("quantiles"):
        q = details["quantiles"]
        text += "\n" + table(["p", "quantile", "interval"],
                             [[d.get("p"), d.get("value"), _interval(d.get("ci"))] for d in q])
    return text


def bounds(out: dict[str, Any]) -> str:
    rows = [[c, lo, hi] for c, (lo, hi) in out["bounds"].items()]
    return table(["column", "lower", "upper"], rows) + f"\n--bounds {out['text']}"


RENDERERS = {
    "ridge": regression, "least-squares": regression, "logistic": regression, "lad": regression,
    "pca": pca, "progress": progress, "show": study, "create": study, "finalize": study, "pilot": study,
    "list": studies, "ledger": ledger_summary, "propose-bounds": bounds,
}


def render(command: str, out: Any) -> str:
    """The table for a command's answer, or the JSON when the shape is not one of the above."""
    fn = RENDERERS.get(command)
    if fn is None and isinstance(out, dict) and "statistic" in out:
        fn = statistic
    if fn is None:
        return json.dumps(out, indent=2)
    try:
        return fn(out)
    except (KeyError, TypeError, ValueError):  # an answer of another shape: show it whole
        return json.dumps(out, indent=2)
