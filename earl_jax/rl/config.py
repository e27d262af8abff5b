"""The RL job's configuration: one flat dataclass, every field a command-line flag (see earl_jax/cli.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Literal


def _f(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class RLConfig:
    # --- run
    game: str = _f("connect_four", "OpenSpiel game: connect_four, tic_tac_toe, or any two-player game name")
    steps: int = _f(150, "RL iterations (rollout -> experience -> train)")
    seed: int = _f(0, "seed for weights, sampling and games")
    run_dir: str = _f("runs/connect4", "folder for config, metrics, checkpoints and plots")
    resume: bool = _f(False, "continue from the newest checkpoint in --run-dir")
    max_minutes: float = _f(0.0, "stop after this many minutes of wall time (0: no limit); a checkpoint is written")
    stall_minutes: float = _f(30.0, "end the process (exit code 75; resume with --resume) when no iteration or "
                                    "evaluation finishes for this many minutes: a device out of memory inside a "
                                    "multi-device program can leave the others waiting forever (earl_jax/watchdog.py); "
                                    "0: off")
    gc_every: int = _f(0, "Python garbage collection: 0 = automatic; N > 0 = automatic collection off, a full "
                          "collection every N iterations on every process at once, its survivors frozen "
                          "(earl_jax/rl/gc_control.py: one process's pause stalls the others in a multi-process job)")
    compile_cache: str = _f("", "persistent JAX compilation cache folder (\"\" = default under the user's cache dir, "
                                "$XDG_CACHE_HOME/earl_jax/jax_compile; \"off\" to disable; $EARL_COMPILE_CACHE if unset)")
    # --- model
    model: str = _f("tiny", "model preset: tiny, qwen2.5-0.5b, ... qwen2.5-72b")
    hf_checkpoint: str | None = _f(None, "local Hugging Face folder (config.json, *.safetensors, tokenizer.json)")
    dtype: Literal["auto", "float32", "bfloat16"] = _f("auto", "compute dtype; auto = float32 on CPU, bfloat16 on GPU")
    # --- games
    opponent: str = _f("random", "training opponent: random, mcts:N, solver, alphabeta:D, or curriculum (the "
                                 "ladder of --curriculum, climbed by --promote-at)")
    curriculum: str = _f("", "opponent ladder for --opponent curriculum, easiest first, e.g. "
                             "'random,alphabeta:1,alphabeta:2,alphabeta:3' (empty: the game's default ladder, "
                             "rl/curriculum.py)")
    promote_at: float = _f(0.8, "curriculum: the next rung once the greedy evaluation win rate against the current "
                                "rung reaches this, in (0, 1]; every evaluation plays the current rung")
    promote_on_stall: int = _f(0, "curriculum: also the next rung after this many evaluations in a row that did not "
                                  "beat the rung's best by 0.02, once that best is >= 0.5 (0: off; rl/curriculum.py)")
    rung_max_iterations: int = _f(0, "curriculum: also the next rung at the first evaluation at least this many "
                                     "iterations after the rung began, whatever its win rate: the last rung's "
                                     "share of a fixed budget (0: off; rl/curriculum.py)")
    mix_opponent: str = _f("", "a second scripted opponent (random, alphabeta:D, solver) for --mix-share of each "
                               "iteration's groups, the rest playing --opponent (or the curriculum's rung); empty: "
                               "none (rl/matchmaking.py)")
    mix_share: float = _f(0.5, "share of the groups that play --mix-opponent, in (0, 1)")
    rehearsal_share: float = _f(0.0, "curriculum: share of the groups that replay the rungs below the current one, "
                                     "one rung an iteration in turn, in [0, 1) (0: off; rl/matchmaking.py)")
    league_size: int = _f(0, "K: frozen snapshots of the policy kept in host memory as self-play opponents "
                             "(0: no league)")
    league_every: int = _f(10, "N: iterations between league snapshots (the first right after the warm-up)")
    league_share: float = _f(0.25, "share of each iteration's groups played against a league snapshot, in (0, 1] "
                                   "(the rest play --opponent); the agent's seat is drawn per game")
    eval_opponents: tuple[str, ...] = _f(("random",), "comma-separated opponents for greedy evaluation")
    prompt_style: Literal["compact", "minimal", "chat", "labeled"] = _f(
        "minimal", "observation text: minimal (board once, then the opponent's replies: short contexts for the "
                   "CPU default), compact (board every turn), labeled (compact, the cell each legal move fills "
                   "shows the move's id), chat (English, for a pretrained LLM)")
    agent_player: int | None = _f(None, "0 = agent moves first, 1 = second, none = random per game")
    invalid_retries: int = _f(2, "retries after an invalid move (the observation says so) before it forfeits the "
                                 "game; evaluation plays by the same rule")
    retry_reward: float = _f(-0.1, "reward for an invalid answer that still has a retry left")
    # --- rollout
    groups: int = _f(16, "B: groups of games per iteration (each group shares a start seed)")
    group_size: int = _f(4, "G: games per group (GRPO / RLOO baselines compare within a group)")
    group_seeds: Literal["shared", "per_game"] = _f(
        "shared", "shared: a group's games share one seed (seat, opponent stream); per_game: each game its own "
                  "seed with the group's seat, so a confident policy against a near-deterministic opponent does "
                  "not replay one game G times (earl_jax/rl/game_seeds.py)")
    max_turn_tokens: int = _f(4, "max tokens the policy may generate per turn")
    constrain_moves: bool = _f(False, "the policy picks each move among the legal moves' tokens (a masked softmax; "
                                      "the experience and train stages score it the same way), then the turn ends: "
                                      "no invalid answers, one scored token per turn, no decode loop "
                                      "(earl_jax/rollout/moves.py); false: free-text answers, invalid ones forfeit")
    stop_at_eos: bool = _f(True, "a turn ends at the end token; false: every answer uses its whole turn budget "
                                 "(fixed-length thinking; the move is the first number in it)")
    turn_tokens_schedule: str = _f("", "length curriculum: 'ITER:TOKENS,...' sets the per-turn token budget from "
                                       "iteration ITER on, e.g. '0:16,4:64,8:256' (empty: --max-turn-tokens throughout)")
    max_turns: int = _f(32, "max agent turns per game (then truncated)")
    rollout_groups: int = _f(0, "groups of games that take turns on the device, so the host steps one group's games "
                                "while the device decodes another's (0: auto = 1; see Trainer._pipeline_groups)")
    rollout_device_groups: bool = _f(False, "on a data-parallel rollout mesh (one process, weights replicated) each "
                                            "device decodes its share of the games as its own group, from its own "
                                            "thread (earl_jax/rollout/device_groups.py); off by default: on 4 H100s, "
                                            "tiny model, 2048 games it was slower than one SPMD decode (0.60 vs 0.48 s)")
    rollout_split_processes: bool = _f(True, "in a multi-process job whose rollout mesh holds a whole model replica "
                                             "per process, each process plays only its share of the games (its host "
                                             "work is not repeated elsewhere) and keeps their tokens, which the "
                                             "experience stage places from there (earl_jax/rollout/process_split.py). "
                                             "On by default since call 58: 4 processes on 4 H100s, 2048 games, tiny "
                                             "model, rollout 1.64x and iteration 1.48x one GPU's in the same call, "
                                             "where the unsplit rollout (every process steps every game) had 0.83x "
                                             "and 1.42x in call 31; a job it does not apply to runs unsplit")
    compact_finished: Literal["auto", "true", "false"] = _f(
        "auto", "finished games leave the decode batch (gathered into a smaller batch bucket): auto = on the CPU "
                "always, on accelerators from the second training rollout on (a cold first rollout spends longer "
                "compiling the smaller batches' programs than they save)")
    max_context: int = _f(2048, "max tokens per episode (then truncated, recorded)")
    compile_ahead: Literal["auto", "true", "false"] = _f(
        "auto", "compile the rollout's next decode programs (next cache size, next compacted batch), the experience "
                "/ train programs of deferred micro-batch widths and the optimizer update on background threads before "
                "they are needed: auto = on accelerators, the rollout's from the second rollout on (in the first they "
                "only compete with the foreground's compiles; on a 2-core CPU with the rollout)")
    rollout_cache_growth: float = _f(0.0, "KV cache sizes as a game grows: 0 = the default buckets (x1.33-1.5 steps, "
                                          "least padded attention); 2 or 4 = fewer, larger sizes, so fewer decode "
                                          "programs compile (a real-size model's first iteration is mostly compiles)")
    temperature: float = _f(1.0, "sampling temperature during rollouts")
    top_k: int = _f(0, "top-k sampling (0: off)")
    top_p: float = _f(1.0, "nucleus sampling threshold (1: off)")
    # --- algorithm
    algorithm: Literal["grpo", "reinforce_pp", "rloo"] = _f("grpo", "advantage estimator (the loss is PPO-clip for all; no critic)")
    clip_eps_low: float = _f(0.2, "PPO ratio clip, lower side")
    clip_eps_high: float = _f(0.28, "PPO ratio clip, upper side")
    dual_clip: float | None = _f(3.0, "dual-clip constant for negative advantages (none: off)")
    kl_coef: float = _f(0.0, "KL-to-reference coefficient (0: no reference model)")
    kl_estimator: Literal["k1", "k3"] = _f("k3", "KL estimator")
    entropy_coef: float = _f(0.0, "entropy bonus over the whole vocabulary (0.01 pushed the tiny model towards invalid tokens)")
    entropy_floor: float | None = _f(None, "if set, the entropy bonus acts only while the mean entropy per generated "
                                           "token is below this (nats): it stops a collapse without flattening")
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = _f(
        "token_mean", "how token losses are averaged")
    gamma: float = _f(1.0, "discount for REINFORCE++ returns")
    turn_discount: float = _f(1.0, "grpo/rloo: a token's advantage x this ** (turns after its own): later moves of a "
                                   "game get more of its outcome's credit (1: every turn the same)")
    filter_constant_groups: bool = _f(True, "drop groups whose rewards do not vary (no signal, guards collapse)")
    between_group_weight: float = _f(0.0, "grpo/rloo: add this x (group mean - batch mean) / batch std to the "
                                          "advantages (constant groups then still teach; needs the filter off)")
    win_reward: float = _f(1.0, "reward for a win")
    draw_reward: float = _f(0.0, "reward for a draw")
    loss_reward: float = _f(-1.0, "reward for a loss")
    invalid_reward: float = _f(-1.0, "reward for an invalid move")
    blunder_penalty: float = _f(0.0, "minus this x the outcome classes (win / open / loss) a move gives away, on that "
                                     "move's reward: a missed win or block costs even when a weak opponent does not "
                                     "punish it (Tic-Tac-Toe: exact values; Connect Four: --blunder-depth plies; "
                                     "envs/vector/blunders.py). 0: the outcome alone")
    blunder_depth: int = _f(1, "Connect Four: plies searched to judge a move for --blunder-penalty (1: immediate wins "
                               "and blocks; each ply ~7x the cost)")
    # --- optimizer
    learning_rate: float = _f(1e-3, "AdamW peak learning rate")
    warmup_steps: int = _f(5, "linear warm-up iterations of the learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    grad_clip: float = _f(1.0, "global gradient-norm clip")
    ppo_epochs: int = _f(1, "passes over each iteration's batch")
    ppo_mini_batches: int = _f(1, "optimizer updates per pass, each on 1/N of the iteration's games in whole GRPO "
                                  "groups (veRL's ppo_mini_batch_size = games / N): N times the updates for the same "
                                  "compute, later ones off-policy within the PPO clip")
    length_split: bool = _f(True, "experience / train: split a batch into more (length-grouped) micro-batches "
                                  "than the plan's memory bound when that cuts the padded tokens by more than "
                                  "packing.SPLIT_GAIN")
    new_widths_per_iteration: int = _f(1, "experience / train: at most this many micro-batch widths not compiled yet "
                                          "per stage and iteration; the other new ones run padded to a wider one "
                                          "(same results, fewer compiles at once); 0: no limit")
    micro_batch_tokens: int = _f(32768, "cap on tokens per batch shard in one experience / train micro-batch; the "
                                        "selector picks the micro-batch (rows per shard) below it from the memory model")
    remat: Literal["auto", "none", "full"] = _f(
        "auto", "per-layer rematerialization in training (the memory model assumes the same): "
                "auto = full on accelerators, none on CPU")
    logprob_chunk: int = _f(256, "cap on the sequence positions per vocabulary chunk of the log-probs; the selector "
                                 "picks the chunk below it from the memory model")
    # --- warm start (the tiny model starts from random weights and knows no answer format)
    format_warmup_steps: int = _f(20, "supervised steps on uniformly random LEGAL moves before RL (0: off); "
                                      "teaches the answer format only, no game skill; skipped with --constrain-moves")
    format_warmup_games: int = _f(8, "random legal games per warm-up step (0: the RL batch, --groups x --group-size); "
                                     "20 x 8 leaves the greedy policy 0.28 invalid against 0.16 for 60 x 64, in a "
                                     "fraction of the time (experiments/results/warmup_tradeoff_cpu.json)")
    # --- parallelism (EARL's Parallelism Selector; every stage gets its own mesh)
    devices: int = _f(0, "devices to use (0: all)")
    selector_mode: Literal["auto", "static"] = _f(
        "auto", "auto: each stage's layout follows the context (selector, OOM fallback); static: the first "
                "iteration's layouts (mesh, micro-batch, chunk) for the whole run, no fallback (a baseline)")
    selector_edges: tuple[int, ...] = _f((), "context-length bucket edges (empty: 1K..32K, or 32..1K for the tiny model)")
    selector_margin: float = _f(0.10, "hysteresis: pass a bucket edge by this fraction before switching layouts")
    selector_ema: float = _f(0.5, "weight of the newest context length in the moving average")
    rollout_thresholds: str = _f("", "direct rollout layouts, e.g. '0:d8f1t1,1024:d4f1t2' (context:mesh; empty: select)")
    experience_thresholds: str = _f("", "direct experience layouts, same format")
    train_thresholds: str = _f("", "direct train layouts, same format (meshes dAfBtC)")
    selector_table: str | None = _f(None, "profile table JSON (from experiments/profile_selector.py) to select by")
    memory_budget_gib: float = _f(0.0, "per-device memory budget for the memory model (0: the device's; CPU 4 GiB)")
    # --- evaluation, checkpoints, logging
    eval_every: int = _f(10, "iterations between greedy evaluations (0: only at the end)")
    eval_games: int = _f(64, "games per evaluation opponent")
    checkpoint_every: int = _f(25, "iterations between checkpoints (and one at the end)")
    keep_checkpoints: int = _f(3, "checkpoints kept (0: none are written, e.g. benchmark runs thrown away after; "
                                  "a 3B model's checkpoint is ~45 GB)")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = _f(
        "auto", "auto = online with WANDB_API_KEY set, else offline")
    wandb_project: str = _f("earl-jax", "wandb project")
    progress: bool = _f(True, "rich progress display")
    # --- multi-process (jax.distributed; none = from the environment: EARL_*, SLURM_*, else one process)
    coordinator: str | None = _f(None, "coordinator HOST:PORT of a multi-process job (process 0 listens there)")
    num_processes: int | None = _f(None, "processes in the job (one per host)")
    process_id: int | None = _f(None, "this process's index in [0, num_processes)")

    def __post_init__(self):
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"--{name.replace('_', '-')}: {msg} (got {getattr(self, name)!r})")

        for name in ("steps", "groups", "group_size", "max_turn_tokens", "max_turns", "max_context",
                     "ppo_epochs", "ppo_mini_batches", "micro_batch_tokens", "logprob_chunk", "eval_games"):
            need(getattr(self, name) > 0, name, "must be positive")
        for name in ("warmup_steps", "format_warmup_steps", "eval_every", "checkpoint_every", "invalid_retries",
                     "rollout_groups", "top_k", "max_minutes", "stall_minutes", "kl_coef", "entropy_coef", "weight_decay",
                     "keep_checkpoints", "format_warmup_games", "gc_every", "new_widths_per_iteration"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.learning_rate > 0, "learning_rate", "must be > 0")
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(0 < self.gamma <= 1, "gamma", "must be in (0, 1]")
        need(0 < self.turn_discount <= 1, "turn_discount", "must be in (0, 1]")
        need(0 <= self.selector_margin < 1, "selector_margin", "must be in [0, 1)")
        need(0 < self.selector_ema <= 1, "selector_ema", "must be in (0, 1]")
        need(self.devices >= 0 and self.memory_budget_gib >= 0, "devices", "must be >= 0")
        need(self.entropy_floor is None or (self.entropy_floor > 0 and self.entropy_coef > 0), "entropy_floor",
             "must be > 0, with --entropy-coef > 0 (the bonus it bounds)")
        need(self.between_group_weight >= 0, "between_group_weight", "must be >= 0")
        need(self.blunder_penalty >= 0, "blunder_penalty", "must be >= 0")
        need(self.blunder_depth >= 1, "blunder_depth", "must be >= 1")
        need(not (self.between_group_weight and self.filter_constant_groups), "filter_constant_groups",
             "drops the constant groups that --between-group-weight gives an advantage: turn one of them off")
        need(self.groups % self.ppo_mini_batches == 0, "ppo_mini_batches",
             f"must divide --groups ({self.groups}): a mini-batch holds whole GRPO groups")
        need(self.agent_player in (None, 0, 1), "agent_player", "must be 0, 1 or none")
        need(0 < self.promote_at <= 1, "promote_at", "must be in (0, 1]")
        need(self.promote_on_stall >= 0, "promote_on_stall", "must be >= 0 (0: off)")
        need(not self.promote_on_stall or self.opponent == "curriculum", "promote_on_stall",
             "needs --opponent curriculum")
        need(self.rung_max_iterations >= 0, "rung_max_iterations", "must be >= 0 (0: off)")
        need(not self.rung_max_iterations or self.opponent == "curriculum", "rung_max_iterations",
             "needs --opponent curriculum")
        need(0 < self.mix_share < 1, "mix_share", "must be in (0, 1)")
        need(not self.mix_opponent or self.groups >= 2, "mix_opponent", "needs --groups >= 2 (one per opponent)")
        need(not (self.mix_opponent and self.league_size), "mix_opponent",
             "and --league-size both take whole groups from the scripted opponent: use one of them")
        if self.mix_opponent:
            from earl_jax.rl.curriculum import parse_ladder  # the same check a rung gets

            try:
                parse_ladder(self.mix_opponent, self.game)
            except ValueError as e:
                raise ValueError(f"--mix-opponent: {e} (got {self.mix_opponent!r})") from None
            need("," not in self.mix_opponent, "mix_opponent", "takes one opponent")
        need(0 <= self.rehearsal_share < 1, "rehearsal_share", "must be in [0, 1) (0: off)")
        if self.rehearsal_share:
            need(self.opponent == "curriculum", "rehearsal_share", "needs --opponent curriculum (rungs to replay)")
            need(self.groups >= 2, "rehearsal_share", "needs --groups >= 2 (one for the current rung)")
            need(not (self.mix_opponent or self.league_size), "rehearsal_share",
                 "takes whole groups from the current rung as --mix-opponent and --league-size do: use one of them")
        need(self.league_size >= 0, "league_size", "must be >= 0")
        need(self.league_every > 0, "league_every", "must be positive")
        need(0 < self.league_share <= 1, "league_share", "must be in (0, 1]")
        need(not self.curriculum or self.opponent == "curriculum", "curriculum", "needs --opponent curriculum")
        if self.opponent == "curriculum":
            from earl_jax.rl.curriculum import parse_ladder

            try:
                parse_ladder(self.curriculum, self.game)
            except ValueError as e:
                raise ValueError(f"--curriculum: {e} (got {self.curriculum!r})") from None
        need(not (self.resume and self.keep_checkpoints == 0), "keep_checkpoints",
             "--resume needs checkpoints: 0 writes none")
        need(self.max_context > self.max_turn_tokens, "max_context", "must exceed --max-turn-tokens")
        need(self.rollout_cache_growth == 0 or self.rollout_cache_growth >= 1.5, "rollout_cache_growth",
             "must be 0 (default buckets) or >= 1.5")
        try:
            schedule = parse_schedule(self.turn_tokens_schedule)
        except ValueError as e:
            raise ValueError(f"--turn-tokens-schedule: {e} (got {self.turn_tokens_schedule!r})") from None
        need(all(t < self.max_context for _, t in schedule), "max_context", "must exceed every scheduled turn budget")
        if self.constrain_moves:
            need(self.top_k == 0 and self.top_p == 1.0, "constrain_moves", "samples the legal moves' softmax whole: "
                 "top-k / top-p do not apply, leave them off")
            need(not self.turn_tokens_schedule, "constrain_moves", "answers are one move token: a turn-token "
                 "schedule has nothing to schedule")
            need(self.max_turn_tokens >= 2, "max_turn_tokens", "constrained moves take 2 tokens a turn (move, stop)")
        need(self.group_size > 1 or self.algorithm == "reinforce_pp", "group_size",
             f"{self.algorithm} compares games within a group: use at least 2")

    @property
    def batch_size(self) -> int:
        return self.groups * self.group_size

    def turn_tokens(self, iteration: int) -> int:
        """The per-turn token budget at `iteration` (the schedule's last entry at or before it)."""
        budget = self.max_turn_tokens
        for start, tokens in parse_schedule(self.turn_tokens_schedule):
            if iteration >= start:
                budget = tokens
        return budget


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """'0:16,4:64' -> [(0, 16), (4, 64)]: iterations strictly ascending from 0, budgets positive."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{item!r} is not ITER:TOKENS")
        out.append((int(parts[0]), int(parts[1])))
    if out and (out[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(out, out[1:]))):
        raise ValueError("iterations must start at 0 and strictly ascend")
    if any(t <= 0 for _, t in out):
        raise ValueError("token budgets must be positive")
    return out
