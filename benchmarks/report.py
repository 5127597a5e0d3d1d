"""Reporting: the results file, the tables, and the section of docs/benchmarks.md they regenerate."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tabulate import tabulate

from benchmarks.env import REPO
from benchmarks.operators import FLOOR
from benchmarks.peers import COLUMNS

RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
PEERS = COLUMNS[1:]
# the columns whose first call compiles
COMPILED = ("hoad", "torch.compile", "jax.jit", "folx", "torch-jet compiled")

LEGEND = """\
Cells: median milliseconds per call on one thread (interleaved rounds), and in brackets the
ratio hoad / peer (below 1: hoad is faster); `hoad / best` compares with the fastest correct
peer. hoad computes the value and every order 1..N in one call; each peer computes only the
top-order blocks. hoad config: backend/mode (`auto→reverse`: the direction hoad's cost model
chose), then how per-sample blocks were obtained: `batch_dim=0`, or `Σ_b` = read off the dense
derivative of Σ_b f(X_b) (the fallback when hoad offers no `batch_dim`). Every result was checked
against nested torch.func in float64 before it was timed: `WRONG` is never timed; `crash`,
`error: <class>`, `timeout` say what happened; `n/a` does not apply; `—` left out of this run.
torch.compile runs in a worker process per workload; its first call uses the Inductor cache as
found on the machine.
Operators and training steps (groups 6 and 7) have their own columns: `hoad` is Inductor, `hoad
eager` the eager backend; folx is JAX's forward Laplacian (jit), torch-jet is collapsed Taylor mode
(jet-for-pytorch), eager and under torch.compile; `hoad / best` compares hoad with the fastest
column that is not hoad's. The stochastic operators use the same fixed directions V in every
column. `jet products alone` is not a contender but the cost, through torch's BLAS (MKL), of the
matrix products every forward-jet Laplacian (hoad's, folx's, torch-jet's) runs: those that carry
the S directions of every point through the hidden layers after the first (its config lists them),
timed alone in the same rounds; it is left out of `hoad / best`. A program goes below it only with
a faster product: hoad's last one is its own fused kernel (hoad::jet_sqnorm, where built)."""

TARGETS_LEGEND = """\
The numbers the issues ask for (`python -m benchmarks --targets` runs only these), measured side
by side in this run: hoad first, the named baseline second, both checked against nested
torch.func in float64 before being timed (medians of interleaved rounds). `measured` is hoad /
baseline for times, or hoad's own size or time (peak memory growth and first calls are measured in
fresh processes); `met` holds it against `target`. The notes give each contender's config and time
(`auto→reverse`: the direction hoad's cost model chose) and whatever failed."""


# ------------------------------------------------------------------------------- the file
def write_results(results: dict) -> Path:
    """``benchmarks/results/<stamp>-<mode>.json``, and the same as ``latest.json``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{results['stamp']}-{results['mode']}.json"
    text = json.dumps(results, indent=1, default=str)
    for target in (path, RESULTS / "latest.json"):
        partial = target.with_suffix(".tmp")  # written whole, then renamed: readers never see half a file
        partial.write_text(text)
        partial.replace(target)
    return path


# ------------------------------------------------------------------------------ the tables
def _median_ms(outcome: dict) -> float | None:
    return outcome["median_s"] * 1e3 if outcome.get("median_s") is not None else None


def _ms(ms: float) -> str:
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def _status(outcome: dict | None) -> str:
    if outcome is None:
        return "—"
    status = outcome["status"]
    if status == "error":
        return "error: " + outcome["note"].split(":", 1)[0]
    if status == "ok" and not outcome.get("times"):
        return "not timed"
    return {"skipped": "—"}.get(status, status)


def _cell(outcome: dict | None, hoad_ms: float | None) -> str:
    ms = _median_ms(outcome) if outcome else None
    if ms is None:
        return _status(outcome)
    if hoad_ms is None:
        return _ms(ms)
    return f"{_ms(ms)} ({hoad_ms / ms:.2f})"


def peer_columns(records: list[dict]) -> list[str]:
    """The columns of a group's table after hoad's, in the order the records list them."""
    names = list(PEERS) if all(set(r["outcomes"]) <= set(COLUMNS) for r in records) else []
    for r in records:
        names += [n for n in r["outcomes"] if n != "hoad" and n not in names]
    return list(names)


def steady_state_rows(records: list[dict], peers: list[str] | tuple[str, ...] = PEERS) -> list[list[str]]:
    rows = []
    for r in records:
        o = r["outcomes"]
        hoad_ms = _median_ms(o.get("hoad", {}))
        others = [name for name in peers if not name.startswith("hoad") and name != FLOOR]
        peer_ms = [m for m in (_median_ms(o[name]) for name in others if name in o) if m is not None]
        best = f"{hoad_ms / min(peer_ms):.2f}" if hoad_ms is not None and peer_ms else ""
        hoad_cell = _ms(hoad_ms) if hoad_ms is not None else _status(o.get("hoad"))
        rows.append([r["label"], o.get("hoad", {}).get("config", ""), hoad_cell,
                     *(_cell(o.get(name), hoad_ms) for name in peers), best])
    return rows


def first_call_columns(records: list[dict]) -> list[str]:
    return [name for name in COMPILED if any(name in r["outcomes"] for r in records)]


def first_call_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        cells = []
        for name in first_call_columns(records):
            o = r["outcomes"].get(name)
            cells.append(f"{o['first_call_s']:.2f}" if o and o.get("first_call_s") is not None else _status(o))
        rows.append([r["id"], *cells])
    return rows


def problems(records: list[dict]) -> list[str]:
    """One line per contender that was wrong or failed, and per workload hoad did not run or
    ran only after a better configuration failed."""
    lines = []
    for r in records:
        for name, o in r["outcomes"].items():
            if o["status"] in ("WRONG", "error", "crash", "timeout"):
                what = o["status"]
            elif name == "hoad" and o["status"] == "n/a":
                what = "not run"
            elif name == "hoad" and o["status"] == "ok" and o["note"]:
                what = "fell back after"
            else:
                continue
            config = f" ({o['config']})" if o["config"] else ""
            lines.append(f"`{r['id']}` {name}{config}: {what}: {o['note']}")
    return lines


def _measured(r: dict) -> str:
    if r["value"] is None:
        return "skipped" if r["status"] == "skipped" else "—"
    number = f"{r['value']:.0f}" if r["unit"] == "MB" else f"{r['value']:.2f}"
    return f"{number} {r['unit']}".strip()


def target_rows(records: list[dict]) -> list[list[str]]:
    met = {True: "yes", False: "no", None: "—"}
    return [[str(r["row"]), str(r["issue"]), r["hoad"], r["hoad_cell"], r["baseline"], r["baseline_cell"],
             _measured(r), r["target"], met[r["met"]]] for r in records]


def target_notes(records: list[dict]) -> list[str]:
    return [f"{r['row']}. {r['note']}" for r in records if r["note"]]


def render_targets(records: list[dict]) -> list[str]:
    headers = ["#", "issue", "hoad", "hoad result", "baseline", "baseline result", "measured", "target", "met"]
    met = sum(1 for r in records if r["met"])
    return ["## Targets from the issues", "", TARGETS_LEGEND, "",
            tabulate(target_rows(records), headers, tablefmt="github", disable_numparse=True), "",
            f"{met} of {len(records)} targets met.", "", *(f"- {line}" for line in target_notes(records))]


def memory_rows(records: list[dict]) -> list[list[str]]:
    """Peak memory of one training step, per training workload that measured it."""
    rows = []
    for r in records:
        memory = r.get("memory")
        if not memory:
            continue
        cells = [f"{m['peak_mb']:.0f}" if m.get("status") == "ok" else f"{m.get('status')}: {m.get('note', '')}"[:80]
                 for m in memory.values()]
        mb = [m.get("peak_mb") for m in memory.values()]
        ratio = f"{mb[0] / mb[1]:.2f}" if len(mb) == 2 and None not in mb and mb[1] else ""
        rows.append([r["label"], *cells, ratio, next(iter(memory.values())).get("what", "")])
    return rows


def render(results: dict) -> str:
    """The whole report as Markdown (github tables read well in a terminal too)."""
    m = results["machine"]
    jax = f"JAX {m['jax']}" if m["jax"] else "JAX not installed"
    peers = ", ".join(f"{name} {m[name]}" if m.get(name) else f"{name} not installed" for name in ("folx", "torch-jet")
                      if name in m)
    pinned = f", pinned to {m['pinned_cores']} core" if m.get("pinned_cores") and not m.get("gpu") else ""
    gpu = (f"; GPU {m['gpu']} ({m['gpu_memory_gib']} GiB, CUDA {m['cuda']}, JAX devices: {m.get('jax_devices')}), "
           f"--dtype {results.get('dtype')}") if m.get("gpu") else ""
    threads = f"{m['threads']} thread" if not m.get("gpu") else f"{m['threads']} CPU threads"
    out = [f"Machine: {m['cpu']}, {m['cores']} cores{pinned}, {threads}{gpu}; Python {m['python']}, "
           f"torch {m['torch']}, {jax}{', ' + peers if peers else ''}; hoad {m['hoad']} ({m['commit']}); {m['date']}. "
           f"`{results['command']}` took {results['seconds'] / 60:.1f} min."]
    if results.get("targets"):
        out += ["", *render_targets(results["targets"])]
    if results["workloads"]:
        out += ["", LEGEND]
    groups: dict[str, list[dict]] = {}
    for r in results["workloads"]:
        groups.setdefault(r["group"], []).append(r)
    for group, records in groups.items():
        peers = peer_columns(records)
        headers = ["workload", "hoad config", "hoad ms", *(f"{p} ms" for p in peers), "hoad / best"]
        out += ["", f"## {group}", "", tabulate(steady_state_rows(records, peers), headers, tablefmt="github",
                                                  disable_numparse=True)]
    memory = memory_rows(results["workloads"])
    if memory:
        names = list(next(r["memory"] for r in results["workloads"] if r.get("memory")))
        out += ["", "## Peak memory of one training step (fresh process), MB", "",
                tabulate(memory, ["workload", *names, f"{names[0]} / {names[-1]}", "measured as"],
                         tablefmt="github", disable_numparse=True)]
    if results["workloads"]:
        out += ["", "## First call (trace + compile), seconds", "",
                tabulate(first_call_rows(results["workloads"]), ["workload", *first_call_columns(results["workloads"])],
                         tablefmt="github", disable_numparse=True)]
    lines = problems(results["workloads"])
    if lines:
        out += ["", "## Failures, fallbacks, workloads hoad did not run", "", *(f"- {line}" for line in lines)]
    return "\n".join(out)


def write_doc(results: dict) -> None:
    """Replace the text between the bench markers of docs/benchmarks.md with this run's report."""
    text = DOC.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"docs/benchmarks.md has no {BEGIN} ... {END} section to replace")
    section = f"{BEGIN}\n{render(results)}\n{END}"
    DOC.write_text(pattern.sub(lambda _: section, text, count=1))
