"""The `--preset gpu` of connect4.py and tictactoe.py: a 15-minute game job on one H100.

    python experiments/connect4.py --preset gpu        # or tictactoe.py; any flag after it overrides a field

Measured on one H100 (experiments/results/connect4_gpu_nvidia_h100.json): the first version of this preset
(64 x 8 games, learning rate 1e-3, the group filter on, no entropy term) ran 0.37 s an iteration and
collapsed: entropy 0 by iteration 700, 99% of the groups constant (no gradient for 225 iterations), greedy
0.56 against random at the end (0.86 at its best, iteration 70). The present fields are the second attempt,
after the probe measurements of experiments/results/learning_notes.md: 4x the games an update (update noise,
not capacity, collapses the shared logits), half the learning rate, and the entropy floor with the filter off
(the one lever that prevented a collapse there). The third (present) one inherits constrained moves from the
scripts' defaults (`--constrain-moves`: the move drawn among the legal moves' tokens; the format warm-up is then
skipped): 8 minutes on one H100 gave greedy 0.81 against random, 0.56 against alphabeta:1, 0.09 against alphabeta:2
(free text: 0.70 / 0.45 / 0.00); experiments/results/connect4_gpu_constrained_nvidia_h100.json. Connect Four adds
CONNECT4_GPU_FIELDS (below) on top. The reasoning below is the first version's where not updated.

* Model: the tiny preset (0.8M parameters, random init, the built-in game tokenizer). The one measured GPU
  data point is this model: an earlier session's run with 512 games per iteration and compact prompts on
  one H100 reached a 0.91 greedy win rate against random at iteration 142, after 7 minutes (about 3 s an
  iteration). A 0.5B random-init model would be ~10x slower an iteration with no evidence that it learns
  the game faster from scratch; a pretrained one wants chat prompts (the qwen0.5b preset).
* Batch: 64 groups of 8 = 512 games. Decoding the tiny model is bound by launches, not by rows, so 512 games
  cost little more than 64; groups of 8 give GRPO a finer baseline than the CPU default's 4.
* Prompts: compact (the board every turn). The model need not track the board from its own context,
  which is what the tiny model failed at in the minimal style (results/tictactoe_cpu_ablations).
* Curriculum: the same run reached 0.91 against random with 75% of its groups filtered out (every game of
  the group won: no signal). So the opponent is `--opponent curriculum`: random, then alpha-beta depth 1,
  2, 3 (Tic-Tac-Toe: random, then the perfect solver), promoted at a greedy win rate of 0.8 against the
  current rung, evaluated every 10 iterations on 128 games (a 0.8 estimate from 128 games has a standard
  error of 0.035; 64 games: 0.05). Promoting near 0.8 keeps the sampled training games at a win rate where
  a group of 8 still mixes wins and losses (all 8 won at p = 0.8: 17% of groups; at 0.91: 47%), which is
  what `train/filtered_frac` (the issue's metric, target below ~30% at the end) measures.
* No league by default: it adds a second decode per opponent turn and compiles a second batch size (the
  league's games), which is untested on a GPU; add `--league-size 4 --league-every 25` to try it (Connect
  Four: with `--rehearsal-share 0`, as both take whole groups).
* Format warm-up: 30 steps of 256 random legal games (the answer format only; a few seconds of device time,
  the host builds the games). Checkpoints every 50 iterations; 300 iterations (the learning-rate schedule's
  length: ~3 s each) or 15 minutes of wall time, whichever comes first.
"""

from __future__ import annotations

import dataclasses

from earl_jax.rl.config import RLConfig

GPU_FIELDS = dict(
    model="tiny", groups=256, group_size=8, prompt_style="compact", max_turn_tokens=4, opponent="curriculum",
    curriculum="", promote_at=0.8, eval_every=20, eval_games=128, format_warmup_steps=30, format_warmup_games=256,
    checkpoint_every=100, max_minutes=15.0, steps=800, learning_rate=5e-4,
    entropy_coef=0.05, entropy_floor=0.3, filter_constant_groups=False,
)


# Connect Four's fourth version (2026-11-28; learning_notes.md sections 18-22): 8 updates per batch, per-game seeds
# (the deterministic rungs then still mix wins and losses in a group), a ladder that ends at alphabeta:2 (on
# alphabeta:3 every game is lost and the policy forgot what it had learned), leaving a rung after 3 evaluations
# without progress, and half the groups replaying the rungs below. 14.5 minutes, two resumed parts, greedy against
# random / alphabeta:1 / alphabeta:2: 0.94 / 0.70 / 0.56 on one GPU of 2 x H200 (another run on the other), and
# 0.91 / 0.63 / 0.16 alone on one H200 (it left alphabeta:1 at iteration 380, not 240: learning_notes.md section 23).
# Fifth (2026-11-29, section 24): a budget of 180 iterations per lower rung, so alphabeta:2 gets the last ~60% of a
# 15-minute run (~470 iterations on one H200) however slowly alphabeta:1 goes. The same seed alone on one H200,
# on section 23's course until it left alphabeta:1 at iteration 180 (win rate 0.30 there): 0.92 / 0.67 / 0.56.
# The budget is in iterations, not minutes: a slower GPU gives the last rung a smaller share.
# Tic-Tac-Toe keeps the fields above: none of these were measured on it.
CONNECT4_GPU_FIELDS = dict(
    ppo_mini_batches=8, group_seeds="per_game", curriculum="random,alphabeta:1,alphabeta:2", promote_on_stall=3,
    rehearsal_share=0.5, rung_max_iterations=180,
)


def gpu_preset(base: RLConfig, run_dir: str, **game_fields) -> RLConfig:
    """`base` (the script's CPU default: game, opponent list, turn limits) with the fields above, then the game's."""
    return dataclasses.replace(base, run_dir=run_dir, **{**GPU_FIELDS, **game_fields})
