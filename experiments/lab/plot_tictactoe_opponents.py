"""Tic-Tac-Toe on the 2-core CPU by training opponent: the greedy evaluations (64 games every 10 iterations) against
random (non-loss) and against the solver (draws) of the default run (random opponent), `--preset vs-solver`, and
half or three quarters of the groups against the solver (`--curriculum.mix-opponent`, the latter also with
`--env.blunder-penalty 0.5`), with the 512-game evaluation after each run as a marker.

    python experiments/lab/plot_tictactoe_opponents.py   # -> experiments/results/tictactoe_cpu_opponents.png

Reads experiments/results/tictactoe_cpu_default.json and tictactoe_cpu_ablations.json (runs `vs_solver`,
`mix_solver_half`, `mix_solver_three_quarters`, `vs_solver_mix_random_quarter_blunder`); docs/learning.md
says what they show.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
RUNS = (("default: random opponent", None), ("--preset vs-solver", "vs_solver"),
        ("--curriculum.mix-opponent solver --curriculum.mix-share 0.5", "mix_solver_half"),
        ("--preset vs-solver --curriculum.mix-opponent random --curriculum.mix-share 0.25",
         "mix_solver_three_quarters"),
        ("the same, --env.blunder-penalty 0.5", "vs_solver_mix_random_quarter_blunder"))


def load() -> list[tuple[str, list[dict], dict]]:
    ablations = json.loads((RESULTS / "tictactoe_cpu_ablations.json").read_text())["runs"]
    out = []
    for label, key in RUNS:
        run = json.loads((RESULTS / "tictactoe_cpu_default.json").read_text()) if key is None else ablations[key]
        out.append((label, [r for r in run["records"] if r.get("eval/fresh")], run["evaluation"]["opponents"]))
    return out


def main() -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (label, evals, final) in enumerate(load()):
        steps = [r["step"] for r in evals]
        a.plot(steps, [r["eval/win_rate"] + r["eval/draw_rate"] for r in evals], color=f"C{i}", lw=1, label=label)
        b.plot(steps, [r["eval_solver/win_rate"] + r["eval_solver/draw_rate"] for r in evals], color=f"C{i}", lw=1,
               label=label)
        a.plot(steps[-1], final["random"]["win_rate"] + final["random"]["draw_rate"], "o", color=f"C{i}")
        b.plot(steps[-1], final["solver"]["win_rate"] + final["solver"]["draw_rate"], "o", color=f"C{i}")
    a.axhline(0.95, color="gray", ls=":", lw=0.8, label="target 0.95")
    b.axhline(0.5, color="gray", ls=":", lw=0.8, label="target 0.5")
    a.set_title("greedy vs random: non-loss (dot: 512 games at the end)", fontsize=9)
    b.set_title("greedy vs the solver: draws or wins", fontsize=9)
    for ax in (a, b):
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    fig.suptitle("Tic-Tac-Toe, tiny model, 10 minutes on a 2-core CPU, by training opponent", fontsize=10)
    fig.tight_layout()
    path = RESULTS / "tictactoe_cpu_opponents.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    print(main())
