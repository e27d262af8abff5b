"""What the end-to-end adaptivity figure (fig_e2e_adaptivity.py) concludes from its runs' traces: pure
functions over the result JSON, so they are tested on hand-made traces.

Definitions (each one stated because a short run makes it matter):

* A run's trace has one record per finished iteration (the trainer's metrics). An iteration "compiled" when
  `compile/programs` grew since the run's previous record (the first record always did): new programs were
  compiled or loaded from the persistent cache, so its time is not the layout's throughput alone.
* Phases are the turn-token schedule's stages; a record belongs to the phase of its `rollout/turn_tokens`.
* A phase's throughput for a run is token-weighted: sum(tokens) / sum(iteration seconds) / devices over its
  compile-free iterations of that phase; when every iteration of the phase compiled, over all of them, and
  the row says `compile_free: false`. Rollout throughput likewise from generated tokens and rollout seconds.
* Whole run: auto against each static run over the iterations both finished, in two versions: compile-free
  iterations only (the one to judge layouts by: closer to a long run's throughput), and every iteration
  (compiles included: what the short run cost; with a persistent compile cache this depends on the order of
  the runs, since a later run loads the programs an earlier one compiled on the same mesh). The best single static
  plan is the eligible static run auto gains least against;
  static runs that died (out of memory, error) are not eligible: they cannot run the whole schedule.
* Compile-excluded ("net") throughput: every iteration of the phase (or run), each with the foreground seconds the
  trainer spent tracing, lowering and compiling or loading programs (`time/trace_s` + `time/lower_s` +
  `time/compile_s`, the most of any process) taken off its iteration time: what the layout would have run at with
  its programs in memory. It compares runs where a phase has no compile-free iteration (one 32K iteration costs
  minutes) and where one run found its programs in the persistent cache and the other compiled them. None when a
  trace lacks those keys (runs before they were kept).
* Dispatch share: auto's dispatch seconds / iteration seconds over all its iterations.

Targets (from the issue): auto within 3% of the best static run in every phase; >= 15% more whole-run
tokens per GPU per second than the best single static plan; dispatch share <= 2%; no OOM in auto while a
static plan dies of it. Each is reported as measured, met or not.
"""

from __future__ import annotations

from typing import Any, Sequence

PHASE_TARGET_PCT = -3.0  # auto's phase throughput at most 3% below the best static run's
WHOLE_RUN_TARGET_PCT = 15.0
DISPATCH_TARGET = 0.02
DIED = ("out_of_memory", "error")


def mark_compiles(trace: list[dict[str, Any]]) -> list[bool]:
    """Per record: whether new programs appeared in that iteration (compile/programs grew)."""
    out, last = [], None
    for r in trace:
        n = r.get("compile/programs")
        out.append(last is None or n is None or n > last)
        last = n if n is not None else last
    return out


COMPILE_KEYS = ("time/trace_s", "time/lower_s", "time/compile_s")  # foreground seconds no layout is judged by


def _rate(records: Sequence[dict[str, Any]], tokens: str, seconds: str, n_dev: int) -> float | None:
    s = sum(r.get(seconds) or 0.0 for r in records)
    return sum(r.get(tokens) or 0 for r in records) / s / n_dev if records and s > 0 else None


def net_seconds(r: dict[str, Any]) -> float | None:
    """An iteration's seconds without its foreground tracing, lowering and compiling; None if not recorded."""
    if r.get("time/iteration_s") is None or any(r.get(k) is None for k in COMPILE_KEYS):
        return None
    return r["time/iteration_s"] - sum(r[k] for k in COMPILE_KEYS)


def _net_rate(records: Sequence[dict[str, Any]], n_dev: int) -> float | None:
    net = [net_seconds(r) for r in records]
    if not records or any(s is None for s in net) or sum(net) <= 0:
        return None
    return sum(r.get("rollout/tokens") or 0 for r in records) / sum(net) / n_dev


def _auto_vs_best_static(runs: dict[str, dict[str, Any]], key: str) -> tuple[str | None, float | None]:
    """The static run with the highest `key`, and auto's percentage against it (None without auto's figure)."""
    statics = {n: v[key] for n, v in runs.items() if n != "auto" and v[key]}
    if not statics:
        return None, None
    best = max(statics, key=statics.get)
    auto = runs.get("auto", {}).get(key)
    return best, (auto / statics[best] - 1) * 100 if auto else None


def phase_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per schedule stage: each run's throughput there, the best static run, auto against it."""
    n_dev = result["num_devices"]
    schedule = result["schedule"]
    rows = []
    for k, (start, turn_tokens) in enumerate(schedule):
        end = schedule[k + 1][0] if k + 1 < len(schedule) else result["steps"]
        row: dict[str, Any] = {"phase": k, "turn_tokens": turn_tokens, "iterations": [start + 1, end], "runs": {}}
        for name, run in result["runs"].items():
            trace = run["trace"]
            compiled = mark_compiles(trace)
            mine = [(r, c) for r, c in zip(trace, compiled) if r.get("rollout/turn_tokens") == turn_tokens]
            if not mine:
                continue
            steady = [r for r, c in mine if not c]
            use = steady or [r for r, _ in mine]
            row["runs"][name] = {
                "iteration_tgs": _rate(use, "rollout/tokens", "time/iteration_s", n_dev),
                "iteration_tgs_net": _net_rate([r for r, _ in mine], n_dev),
                "rollout_tgs": _rate(use, "rollout/generated_tokens", "time/rollout_s", n_dev),
                "iterations": len(use), "compile_free": bool(steady),
                "context_max": max(r.get("rollout/context_len_max") or 0 for r, _ in mine),
                "rollout_meshes": sorted({r.get("parallel/rollout_mesh") for r, _ in mine} - {None})}
        best, pct = _auto_vs_best_static(row["runs"], "iteration_tgs")
        if best:
            row["best_static"] = best
            if pct is not None:
                row["auto_vs_best_static_pct"] = round(pct, 2)
                row["within_target"] = pct >= PHASE_TARGET_PCT
        best, pct = _auto_vs_best_static(row["runs"], "iteration_tgs_net")
        if pct is not None:
            row["best_static_net"] = best
            row["auto_vs_best_static_net_pct"] = round(pct, 2)
        rows.append(row)
    return rows


def whole_run(result: dict[str, Any]) -> dict[str, Any]:
    """Auto against each static run over the iterations both finished (all, and compile-free only)."""
    n_dev = result["num_devices"]
    runs = result["runs"]
    if "auto" not in runs or not runs["auto"]["trace"]:
        return {"note": "no auto run yet"}
    auto = runs["auto"]
    auto_by_step = dict(zip((r["step"] for r in auto["trace"]), zip(auto["trace"], mark_compiles(auto["trace"]))))
    out: dict[str, Any] = {"vs_static": {}}
    for name, run in runs.items():
        if name == "auto" or not run["trace"]:
            continue
        mine = dict(zip((r["step"] for r in run["trace"]), zip(run["trace"], mark_compiles(run["trace"]))))
        common = sorted(set(mine) & set(auto_by_step))
        entry: dict[str, Any] = {"status": run["status"], "common_iterations": len(common),
                                 "eligible": run["status"] not in DIED}
        for label, keep in (("all", lambda c: True), ("compile_free", lambda c: not c)):
            a = _rate([auto_by_step[s][0] for s in common if keep(auto_by_step[s][1])], "rollout/tokens",
                      "time/iteration_s", n_dev)
            b = _rate([mine[s][0] for s in common if keep(mine[s][1])], "rollout/tokens", "time/iteration_s", n_dev)
            entry[label] = {"auto_tgs": a, "static_tgs": b,
                            "auto_gain_pct": None if not (a and b) else round((a / b - 1) * 100, 2)}
        a, b = _net_rate([auto_by_step[s][0] for s in common], n_dev), _net_rate([mine[s][0] for s in common], n_dev)
        gain = None if not (a and b) else round((a / b - 1) * 100, 2)
        entry["net"] = {"auto_tgs": a, "static_tgs": b, "auto_gain_pct": gain}
        out["vs_static"][name] = entry
    for label in ("all", "compile_free", "net"):
        gains = {n: e[label]["auto_gain_pct"] for n, e in out["vs_static"].items()
                 if e["eligible"] and e[label]["auto_gain_pct"] is not None}
        if gains:
            best = min(gains, key=gains.get)
            out[f"best_static_{label}"] = best
            out[f"auto_gain_vs_best_static_{label}_pct"] = gains[best]
            out[f"target_met_{label}"] = gains[best] >= WHOLE_RUN_TARGET_PCT
        else:
            out[f"best_static_{label}"] = None  # every static run died (or none ran): nothing to compare with
    return out


def dispatch_share(trace: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(r.get("time/iteration_s") or 0.0 for r in trace)
    if not total:
        return {}
    share = sum(r.get("time/dispatch_s") or 0.0 for r in trace) / total
    return {"share": round(share, 5),
            "max_iteration_share": round(max(r.get("time/dispatch_share") or 0.0 for r in trace), 5),
            "target_met": share <= DISPATCH_TARGET}


def oom_report(result: dict[str, Any]) -> dict[str, Any]:
    died = {n: {"stage": r.get("oom_stage"), "iteration": r.get("failed_iteration")}
            for n, r in result["runs"].items() if r["status"] == "out_of_memory"}
    auto = result["runs"].get("auto")
    return {"out_of_memory": died, "auto_oom": None if auto is None else auto["status"] == "out_of_memory",
            "a_static_died_of_oom": any(n != "auto" for n in died)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    auto = result["runs"].get("auto")
    return {"phases": phase_rows(result), "whole_run": whole_run(result),
            "dispatch": dispatch_share(auto["trace"]) if auto else {}, "oom": oom_report(result)}


def auto_profile_rows(result: dict[str, Any], bucket_edges: Sequence[int]) -> list[dict[str, Any]]:
    """Rollout throughput the static runs measured per phase, as profile-table entries for the auto run
    (EARL's start-up profile: each rollout layout's TGS per context range; here the static runs paid for it).

    A phase's entries sit at the selector's context bucket of the phase's mean context at a turn's start
    (what the selector smooths; the mean over the static runs): the selector looks the table up at its
    current bucket's upper edge, so a phase is found exactly there, and between phases by the nearest
    bucket. Two phases in one bucket: the later (longer) one is kept. A static run that ran out of memory in
    its rollout stage marks its layout "oom" at the phase where it died."""
    n_dev = result["num_devices"]
    statics = {n: r for n, r in result["runs"].items() if n != "auto"}
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for _, turn_tokens in result["schedule"]:
        ctx = [r.get("rollout/turn_context_len_mean") for run in statics.values() for r in run["trace"]
               if r.get("rollout/turn_tokens") == turn_tokens and r.get("rollout/turn_context_len_mean")]
        if not ctx:
            continue
        mean = sum(ctx) / len(ctx)
        bucket = next((e for e in bucket_edges if mean <= e), bucket_edges[-1])
        for name, run in statics.items():
            mine = [(r, c) for r, c in zip(run["trace"], mark_compiles(run["trace"]))
                    if r.get("rollout/turn_tokens") == turn_tokens]
            steady = [r for r, c in mine if not c] or [r for r, _ in mine]
            tgs = _rate(steady, "rollout/generated_tokens", "time/rollout_s", n_dev)
            died_here = (run["status"] == "out_of_memory" and run.get("oom_stage") == "rollout"
                         and run.get("failed_turn_tokens") == turn_tokens)
            if died_here:
                rows[run["rollout_mesh"], bucket] = {"mesh": run["rollout_mesh"], "context_len": bucket,
                                                     "status": "oom", "tgs": None, "phase_context": round(mean)}
            elif tgs:
                rows[run["rollout_mesh"], bucket] = {"mesh": run["rollout_mesh"], "context_len": bucket,
                                                     "status": "ok", "tgs": tgs, "phase_context": round(mean)}
    return list(rows.values())
