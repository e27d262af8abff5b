"""Build a base policy from expert games: generate them, train on them (the SFT stage), measure, export.

    python experiments/pretrain.py connect4 --out experiments/bases/connect4
    python experiments/pretrain.py tictactoe --out experiments/bases/tictactoe
    python experiments/pretrain.py connect4 --expert-only        # the expert's results and speed, no training

The job flags after the script's own (any of connect4.py's / tictactoe.py's: `--model small`, `--seed 1`,
`--env.prompt-style chat`, `--rollout.constrain-moves false`) choose the model, the prompt style, the move mode and
the rollout limits the transcripts follow. With none, the game's CPU default job (experiments/configs/<game>/
tiny-cpu.toml): the base then speaks exactly what that job's rollout writes, and the job starts from it with
`--model.hf-checkpoint DIR`.

Steps: expert games (rl/supervised/expert_games.py; deduplicated, split by game into train and held-out), `--sft-steps`
supervised steps of `--sft-games` games each through the SFT stage (rl/supervised/sft.py run_sft, on the planner's "sft"
layout), held-out move accuracy against the expert every `--accuracy-every` steps, greedy games against the game's
evaluation opponents, then the Hugging Face folder (models/export.py; with --dtype bfloat16 the evaluation and the
accuracy are of the rounded weights that ship). Writes experiments/results/pretrain_<game><--name>.{json,png}.
The same command and seed build the same base on the same machine (tests/scripts/test_pretrain.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from earl_jax.rl.supervised.expert_games import (  # noqa: E402
    ExpertGames,
    ExpertSpec,
    concat_games,
    dedup_games,
    expert_games,
    split_games,
    unseen_turns,
)

GAMES = {"connect4": ("connect_four", ("random", "alphabeta:1", "alphabeta:2", "alphabeta:3")),
         "tictactoe": ("tic_tac_toe", ("random", "solver"))}
ACCURACY_ROWS = 64  # held-out games per forward pass (one compiled shape)


def options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Other flags are the job's (see connect4.py --help).")
    p.add_argument("game", choices=sorted(GAMES))
    p.add_argument("--games", type=int, default=16384, help="expert games to play (before deduplication)")
    p.add_argument("--depth", type=int, default=5, help="Connect Four: the expert's alpha-beta depth")
    p.add_argument("--solver", type=int, default=0,
                   help="Connect Four: the expert is the near-exact solver, this many thousand nodes a move "
                        "(envs/connect_four_solver.py; 0: alpha-beta at --depth)")
    p.add_argument("--opening-plies", type=int, default=None,
                   help="random plies opening a game, at most (default: the game's, rl/supervised/expert_games.py)")
    p.add_argument("--held-out", type=float, default=0.05, help="share of the games held out for move accuracy")
    p.add_argument("--sft-steps", type=int, default=600, help="supervised steps")
    p.add_argument("--sft-minutes", type=float, default=0.0,
                   help="stop the supervised steps after this many minutes, fewer than --sft-steps if need be (0: no "
                        "limit; the learning-rate schedule still spans --sft-steps)")
    p.add_argument("--sft-games", type=int, default=16, help="games per step (a multiple of the devices)")
    p.add_argument("--sft-lr", type=float, default=2e-3, help="AdamW peak learning rate (cosine to 0.1x)")
    p.add_argument("--transcript-steps", type=int, default=0,
                   help="the first this many steps learn the whole transcript (observations too, not the random "
                        "turns' answers), the rest the expert's moves only")
    p.add_argument("--tactics-steps", type=int, default=0,
                   help="the first this many steps learn only the expert's moves where a win or a block is due, "
                        "from games that have one")
    p.add_argument("--sft-warmup", type=int, default=50, help="linear warm-up steps of the learning rate")
    p.add_argument("--accuracy-every", type=int, default=100, help="held-out accuracy every this many steps")
    p.add_argument("--accuracy-games", type=int, default=512, help="held-out games the accuracy reads, at most")
    p.add_argument("--eval-games", type=int, default=512, help="greedy games per evaluation opponent (0: none)")
    p.add_argument("--out", type=Path, default=None, help="the base's folder (default: experiments/bases/<game>)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights as stored")
    p.add_argument("--name", default="", help="suffix of the results' file names")
    p.add_argument("--results", type=Path, default=ROOT / "experiments" / "results", help="where results go")
    p.add_argument("--games-cache", type=Path, default=None, help=".npz file of the expert games: read when it holds "
                                                                  "games of these settings, else written")
    p.add_argument("--games-from", type=Path, nargs="+", default=None,
                   help=".npz expert games of any prompt style or limits (--games-cache files; several are joined, "
                        "e.g. parts searched in parallel with different --run.seed), played again in this job's "
                        "(rl/supervised/expert_replay.py): no search")
    p.add_argument("--mirror", action="store_true", help="add the mirror image of every train game (not the held-out)")
    p.add_argument("--sft-target", choices=["move", "best"], default="move",
                   help="what an expert turn teaches: the move played, or its set of equally best moves (the "
                        "probability of any of them; constrained moves)")
    p.add_argument("--expert-only", action="store_true", help="play the expert games, report them, stop")
    args, rest = p.parse_known_args(argv)
    for flag, ok, need in (("--games", args.games >= 1, ">= 1"), ("--depth", args.depth >= 1, ">= 1"),
                           ("--solver", args.solver >= 0, ">= 0"), ("--held-out", 0 <= args.held_out < 1, "in [0, 1)"),
                           ("--opening-plies", args.opening_plies is None or args.opening_plies >= 0, ">= 0"),
                           ("--sft-steps", args.sft_steps >= 1, ">= 1"),
                           ("--sft-minutes", args.sft_minutes >= 0, ">= 0"),
                           ("--sft-games", args.sft_games >= 1, ">= 1"), ("--sft-lr", args.sft_lr > 0, "> 0"),
                           ("--transcript-steps", args.transcript_steps >= 0, ">= 0"),
                           ("--tactics-steps", args.tactics_steps >= 0, ">= 0"),
                           ("--sft-warmup", args.sft_warmup >= 0, ">= 0"),
                           ("--accuracy-every", args.accuracy_every >= 1, ">= 1"),
                           ("--accuracy-games", args.accuracy_games >= 1, ">= 1"),
                           ("--eval-games", args.eval_games >= 0, ">= 0")):
        if not ok:
            p.error(f"{flag}: must be {need} (got {getattr(args, flag[2:].replace('-', '_'))})")
    return args, rest


def job_config(args, rest: list[str]):
    from earl_jax.rl.job.entry import parse_job

    _, opponents = GAMES[args.game]
    defaults = ["--eval.opponents", ",".join(opponents), "--run.wandb-mode", "disabled", "--run.progress", "false",
                "--model.hf-checkpoint", ""]  # a base is built from random weights (the CPU defaults start from one)
    defaults += ["--eval.games", str(args.eval_games)] if args.eval_games else []
    return parse_job(defaults + rest, ROOT / "experiments" / "configs" / args.game).config


def make_games(args, cfg, tokenizer, ids) -> tuple[ExpertGames, dict]:
    spec = ExpertSpec(games=args.games, depth=args.depth, solver=args.solver, opening_plies=args.opening_plies,
                      seed=cfg.run.seed)
    spec_dict = dataclasses.asdict(spec) if cfg.env.game == "connect_four" else {  # the solver has no depth
        k: v for k, v in dataclasses.asdict(spec).items() if k != "depth"}
    if not spec.solver:  # the key games cached before the field existed were written with
        spec_dict.pop("solver")
    limits = _limits(cfg)
    key = json.dumps([spec_dict, dataclasses.asdict(cfg.env), limits, tokenizer.to_str()], sort_keys=True)
    if args.games_from is not None:
        return _replayed(args, cfg, tokenizer, ids, limits)
    cache = args.games_cache
    games = ExpertGames.load(cache, key) if cache is not None and cache.exists() else None
    cached, t0 = games is not None, time.perf_counter()
    if games is None:
        from tqdm import tqdm

        with tqdm(total=spec.games, desc="expert games", unit="game", disable=not sys.stderr.isatty()) as bar:
            games = expert_games(spec, cfg.env, tokenizer, eos_id=ids.eos_id, bos_id=ids.bos_id, **limits,
                                 progress=bar.update)
        if cache is not None:
            games.save(cache, key)
    seconds = time.perf_counter() - t0
    timing = {"from_cache": str(cache)} if cached else {"seconds": round(seconds, 1),
                                                        "seconds_per_game": seconds / spec.games}
    return games, {"spec": spec_dict, **timing, **games.stats()}


def _limits(cfg) -> dict:
    """The move mode and rollout limits a transcript follows, as the job's agent loop would cut it."""
    return dict(constrained=cfg.rollout.constrain_moves, max_context=cfg.rollout.max_context,
                max_turns=cfg.rollout.max_turns, max_turn_tokens=cfg.rollout.turn_tokens(0))


def _replayed(args, cfg, tokenizer, ids, limits: dict) -> tuple[ExpertGames, dict]:
    """The games of --games-from, played again in this job's prompt style and limits."""
    from earl_jax.rl.supervised.expert_replay import replay_games

    named = " ".join(map(str, args.games_from))
    parts = []
    for path in args.games_from:
        if not path.exists():
            raise SystemExit(f"pretrain: --games-from {path}: no such file")
        try:
            parts.append(ExpertGames.load(path))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # not an .npz of expert games
            raise SystemExit(f"pretrain: --games-from {path}: not a games file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if len({(p.opponents, p.constrained) for p in parts}) > 1:
        raise SystemExit(f"pretrain: --games-from {named}: the files were played "
                         f"against different opponents or move modes")
    source = concat_games(parts)
    t0 = time.perf_counter()
    try:
        games = replay_games(source, cfg.env, tokenizer, eos_id=ids.eos_id, bos_id=ids.bos_id, **limits)
    except (ValueError, IndexError) as e:  # games of another game, or of other rules
        raise SystemExit(f"pretrain: --games-from {named}: its games do not replay as "
                         f"{cfg.env.game} ({str(e).splitlines()[0]})") from None
    def one_or_all(values: list):  # one file is recorded as before several could be joined
        return values[0] if len(values) == 1 else values

    return games, {"replayed_from": one_or_all([str(path) for path in args.games_from]),
                   "replay_seconds": round(time.perf_counter() - t0, 1),
                   "spec": one_or_all([_source_spec(path) for path in args.games_from]), **games.stats()}


def _source_spec(path: Path) -> dict:
    """The expert spec a games cache was written with (its key's first entry), {} if it has none."""
    try:
        return json.loads(str(np.load(path, allow_pickle=False)["key"]))[0]
    except (KeyError, ValueError, IndexError, TypeError):
        return {}


def move_token_ids(tokenizer, num_actions: int) -> np.ndarray:
    """The token of each move's text (both move modes answer with it first)."""
    ids = [tokenizer.encode(str(a), add_special_tokens=False).ids for a in range(num_actions)]
    if any(len(i) != 1 for i in ids):
        raise ValueError("move accuracy needs every move to be one token in this tokenizer")
    return np.array([i[0] for i in ids])


class Accuracy:
    """Held-out move accuracy: at each expert move of the held-out games, is the model's argmax over the legal
    moves' tokens (the greedy constrained move; in free text the legal move it ranks first) one of the expert's best
    moves? Reported over all held-out expert moves, over those whose history no train game reaches, over those with a
    win or a block due (`tactics`), with chance, and the held-out loss (minus the log-probability of the expert's move
    among the legal moves)."""

    def __init__(self, policy, num_actions: int, train: ExpertGames, held: ExpertGames, limit: int):
        self.graphdef = policy.graphdef
        self.held = held.take(np.arange(min(limit, len(held))))
        self.unseen = unseen_turns(train, self.held)
        rows, cols = self.held.expert_turns()
        self.rows, self.cols = rows, cols
        self.legal, self.best = self.held.legal[rows, cols], self.held.best[rows, cols]
        self.tactical = self.held.tactics[rows, cols] != 0
        self.move_ids = jnp.asarray(move_token_ids(policy.tokenizer, num_actions))
        self.width = int(self.held.tokens.shape[1])
        graphdef, move_ids = self.graphdef, self.move_ids

        def logits(params, tokens):
            model = nnx.merge(graphdef, params)
            h, _ = model.hidden(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape))
            return model.logits(h)[..., move_ids]

        self._logits = jax.jit(logits)
        bits = lambda m: ((m[:, None] >> np.arange(len(move_ids))) & 1).astype(bool)  # noqa: E731
        self.legal_m, self.best_m = bits(self.legal), bits(self.best)

    def __call__(self, params) -> dict[str, float]:
        picks, nll = np.zeros(len(self.rows), np.int64), np.zeros(len(self.rows))
        for start in range(0, len(self.held), ACCURACY_ROWS):
            tokens = np.zeros((ACCURACY_ROWS, self.width), np.int32)
            chunk = self.held.tokens[start:start + ACCURACY_ROWS]
            tokens[:len(chunk)] = chunk
            move_logits = np.asarray(self._logits(params, jnp.asarray(tokens)), np.float64)
            sel = (self.rows >= start) & (self.rows < start + ACCURACY_ROWS)
            at = move_logits[self.rows[sel] - start, self.cols[sel] - 1]  # the position before the move predicts it
            at = np.where(self.legal_m[sel], at, -np.inf)
            picks[sel] = at.argmax(1)
            played = self.held.tokens[self.rows[sel], self.cols[sel]][:, None] == np.asarray(self.move_ids)
            log_z = np.log(np.exp(at - at.max(1, keepdims=True)).sum(1)) + at.max(1)
            nll[sel] = log_z - at[played]  # the SFT loss of the expert's move, legal moves only
        hit = self.best_m[np.arange(len(picks)), picks]
        chance = self.best_m.sum(1) / self.legal_m.sum(1)
        return {"accuracy": float(hit.mean()), "accuracy_unseen": float(hit[self.unseen].mean()) if self.unseen.any()
                else float("nan"), "accuracy_tactical": float(hit[self.tactical].mean()) if self.tactical.any()
                else float("nan"), "chance": float(chance.mean()), "loss": float(nll.mean()), "moves": int(len(hit)),
                "unseen_moves": int(self.unseen.sum()), "tactical_moves": int(self.tactical.sum())}


def train_batches(train: ExpertGames, games_per_step: int, width: int, rng: np.random.Generator, on_step,
                  transcript_steps: int = 0, tactics_steps: int = 0, best_set: bool = False):
    """Batches of `games_per_step` train games, each epoch in a fresh seeded order: the first `transcript_steps` with
    the whole transcript in the loss, the first `tactics_steps` only the tactical moves of the games that have one;
    `on_step(i)` runs before step i (the current weights are in the SFT stage's `TrainState` then)."""
    tactical = np.flatnonzero((train.tactics != 0).any(1))
    orders = {False: np.zeros(0, np.int64), True: np.zeros(0, np.int64)}
    i = 0
    while True:
        on_step(i)
        tactics = i < tactics_steps
        pool = tactical if tactics else np.arange(len(train))
        if len(orders[tactics]) < games_per_step:
            orders[tactics] = np.concatenate([orders[tactics], rng.permutation(pool)])
        rows, orders[tactics] = orders[tactics][:games_per_step], orders[tactics][games_per_step:]
        yield train.batch(rows, width, transcript=i < transcript_steps, tactics_only=tactics, best_set=best_set)
        i += 1


def evaluation(evaluate, opponents) -> dict[str, dict[str, float]]:
    """Win, draw and loss rates per opponent of `evaluate(opponents)` (an `Evaluator`)."""
    out = evaluate(tuple(opponents))
    first = opponents[0]
    return {o: {k: out[f"{'eval' if o == first else 'eval_' + o}/{k}_rate"] for k in ("win", "draw", "loss")}
            for o in opponents}


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = options(argv)
    from earl_jax.envs.games import get_game
    from earl_jax.models.export import save_pretrained
    from earl_jax.progress import show_progress_logs
    from earl_jax.rl.algorithm.optim import make_optimizer
    from earl_jax.rl.stages.evaluation import policy_evaluator
    from earl_jax.rl.stages.policy_setup import build_policy
    from earl_jax.rl.stages.train_stage import TrainState
    from earl_jax.rl.supervised.sft import run_sft

    show_progress_logs(True)
    cfg = job_config(args, rest)
    if args.sft_target == "best" and not cfg.rollout.constrain_moves:  # before minutes of expert games, not after
        raise SystemExit("pretrain: --sft-target best needs constrained moves (a set of right moves is a set of "
                         "tokens); free text learns the move played (--sft-target move)")
    game, opponents = GAMES[args.game]
    command = "python experiments/pretrain.py " + shlex.join(argv)
    policy, params = build_policy(cfg)  # the model, its tokenizer and planner: no RL loop
    num_actions = get_game(game).rules.num_actions
    policy = policy.with_moves(num_actions) if cfg.rollout.constrain_moves else policy
    state = TrainState(params, None)  # the weights the SFT steps update (they keep their own optimizer state)
    n_dev = len(policy.planner.devices)
    if args.sft_games % n_dev:
        raise SystemExit(f"pretrain: --sft-games {args.sft_games} must be a multiple of the {n_dev} devices")
    games, expert = make_games(args, cfg, policy.tokenizer, policy.ids)
    print(f"pretrain: expert: {json.dumps(expert)}", flush=True)
    result: dict = {"command": command, "game": game, "device": _device(), "expert": expert}
    if args.expert_only:
        return _write(args, result, None)
    unique = dedup_games(games)
    train, held = split_games(unique, args.held_out, seed=cfg.run.seed)
    if args.mirror:  # after the split: a held-out game's reflection would be a train game seen from the other side
        from earl_jax.rl.supervised.expert_replay import replay_games

        mirrored = replay_games(train, cfg.env, policy.tokenizer, eos_id=policy.ids.eos_id,
                                bos_id=policy.ids.bos_id, mirror=True, **_limits(cfg))
        train = dedup_games(concat_games([train, mirrored]))
    result["data"] = {"games": len(games), "unique": len(unique), "mirrored": args.mirror, "train": len(train),
                      "held_out": len(held),
                      "train_expert_moves": int((train.best != 0).sum())}
    accuracy = Accuracy(policy, num_actions, train, held, args.accuracy_games)
    width = -(-int(train.lengths.max()) // 32) * 32  # every game whole, one compiled shape, little padding
    curve, t0 = [], time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=args.sft_steps, desc="sft", unit="step", disable=not sys.stderr.isatty())

    def on_step(i: int) -> None:
        bar.update(1 if i else 0)
        if i % args.accuracy_every == 0:
            curve.append({"step": i, "seconds": round(time.perf_counter() - t0, 1),
                          **accuracy(state.params)})
            bar.set_postfix(accuracy=f"{curve[-1]['accuracy']:.3f}")
            if bar.disable:  # a log, not a terminal
                c = curve[-1]
                print(f"pretrain: step {i}: held-out accuracy {c['accuracy']:.3f} (tactical "
                      f"{c['accuracy_tactical']:.3f}), loss {c['loss']:.3f}", flush=True)

    optimizer = make_optimizer(args.sft_lr, args.sft_warmup, args.sft_steps, 0.0, cfg.optim.grad_clip)
    rng = np.random.default_rng(cfg.run.seed)
    batches = train_batches(train, args.sft_games, width, rng, on_step, args.transcript_steps, args.tactics_steps,
                            best_set=args.sft_target == "best")
    if args.sft_minutes > 0:  # a bounded call (a device lease) keeps a base rather than losing it to a timeout
        batches = _until(batches, t0 + 60 * args.sft_minutes)
    history = run_sft(policy, state, batches, steps=args.sft_steps, optimizer=optimizer)
    bar.close()
    sft_s = time.perf_counter() - t0
    if args.dtype == "bfloat16":  # measure what ships
        state.params = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(p.dtype), state.params)
    final = accuracy(state.params)
    curve.append({"step": len(history), "seconds": round(sft_s, 1), **final})
    t1 = time.perf_counter()
    ev = evaluation(policy_evaluator(cfg, policy, state), opponents) if args.eval_games else {}
    result.update({
        "model": {"name": cfg.model.name, "params": policy.model_cfg.num_params()},
        "sft": {"steps": len(history), "steps_planned": args.sft_steps, "games_per_step": args.sft_games,
                "lr": args.sft_lr, "width": width, "target": args.sft_target,
                "transcript_steps": args.transcript_steps, "tactics_steps": args.tactics_steps,
                "seconds": round(sft_s, 1), "loss": [h["sft_loss"] for h in history]},
        "accuracy_curve": curve, "held_out": final, "eval_games": cfg.eval.games,
        "eval_seconds": round(time.perf_counter() - t1, 1), "eval": ev})
    out = args.out or ROOT / "experiments" / "bases" / args.game
    meta = {"game": game, "prompt_style": cfg.env.prompt_style,
            "move_mode": "constrained" if cfg.rollout.constrain_moves else "free", "command": command,
            "seed": cfg.run.seed, "model": result["model"], "expert": expert["spec"],
            "sft": {k: v for k, v in result["sft"].items() if k not in ("loss", "seconds")},
            "held_out_accuracy": final, "eval": {"greedy_games": cfg.eval.games, **ev} if ev else {}}
    save_pretrained(policy.graphdef, state.params, policy.model_cfg, policy.tokenizer, out, meta,
                    dtype=args.dtype)
    result["base"] = {"folder": str(out), "bytes": sum(f.stat().st_size for f in Path(out).iterdir())}
    print(f"pretrain: held-out accuracy {final['accuracy']:.3f} (unseen {final['accuracy_unseen']:.3f}, tactical "
          f"{final['accuracy_tactical']:.3f}, chance "
          f"{final['chance']:.3f}); greedy (win/draw) "
          + ", ".join(f"{o} {r['win']:.2f}/{r['draw']:.2f}" for o, r in ev.items()) + f"; base: {out}", flush=True)
    return _write(args, result, curve)


def _until(batches, deadline: float):
    """`batches` until the clock passes `deadline` (perf_counter seconds)."""
    for b in batches:
        if time.perf_counter() > deadline:
            return
        yield b


def _device() -> str:
    d = jax.devices()[0]
    return f"{d.platform} x{jax.device_count()}" + (f" ({d.device_kind})" if d.platform != "cpu" else "")


def _write(args, result: dict, curve) -> dict:
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"pretrain_{args.game}{'_' + args.name if args.name else ''}"
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    if curve:
        _plot(result, curve, Path(f"{stem}.png"))
    print(f"pretrain: wrote {stem}.json", flush=True)
    return result


def _plot(result: dict, curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = np.array(result["sft"]["loss"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(loss, alpha=0.3, lw=0.8)
    k = max(1, len(loss) // 50)
    a.plot(np.arange(k - 1, len(loss)), np.convolve(loss, np.ones(k) / k, "valid"), lw=1.5)
    a.plot([c["step"] for c in curve], [c["loss"] for c in curve], "o-", ms=3, label="held-out")
    a.set(xlabel="SFT step", ylabel="loss (expert moves, nats)", title="SFT loss")
    a.legend(["train", "train, smoothed", "held-out"])
    steps = [c["step"] for c in curve]
    b.plot(steps, [c["accuracy"] for c in curve], label="held-out moves")
    b.plot(steps, [c["accuracy_unseen"] for c in curve], label="unseen histories")
    b.plot(steps, [c["accuracy_tactical"] for c in curve], label="a win or a block due")
    b.plot(steps, [c["chance"] for c in curve], ls=":", label="chance")
    b.set(xlabel="SFT step", ylabel="argmax is a best move", title="move accuracy against the expert", ylim=(0, 1))
    b.legend()
    fig.suptitle(f"pretrain {result['game']}: {result['model']['name']} ({result['model']['params'] / 1e6:.1f}M), "
                 f"{result['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
