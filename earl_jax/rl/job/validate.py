"""Checks of a job's inputs that need more than one field (the game's rules, the model's shape, the run folder), done
before anything is built: each bad input is one `ConfigError` line naming the flag, the value and what is accepted.

Each component config checks its own fields when it is made; this module checks them against each other and the
world: that the game loads, that every opponent exists for it, that the model shape or checkpoint folder is there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from earl_jax.cli import ConfigError
from earl_jax.errors import CheckpointError


def check_game_name(cfg) -> None:
    """A game job's --env.game is a game OpenSpiel knows: said first, before a base made for another game is blamed."""
    if cfg.env.task:
        return
    import difflib

    import pyspiel

    from earl_jax.envs.games import game_names

    name = cfg.env.game.split("(")[0].strip()
    known = pyspiel.registered_names()
    if name in known:
        return
    near = difflib.get_close_matches(name, known, n=3)  # load_game would print all ~120 names
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise ConfigError(f"--env.game: unknown game {cfg.env.game!r} ({hint}batched here: {', '.join(game_names())}; "
                      "or any two-player OpenSpiel game such as breakthrough or hex)")


def _load_game(name: str):
    import pyspiel

    try:
        game = pyspiel.load_game(name)
    except Exception as e:  # pyspiel.SpielError is not a ValueError: e.g. a parameter the game does not take
        raise ConfigError(f"--env.game: {name!r} does not load ({str(e).splitlines()[0]})") from None
    if game.num_players() != 2:
        raise ConfigError(f"--env.game: {name!r} has {game.num_players()} players; the games here are two-player")
    return game


def _opponent(flag: str, spec: str, game, name: str) -> None:
    from earl_jax.envs.opponents import make_opponent

    try:
        make_opponent(spec, game)
    except ValueError as e:  # its message names the spec and what is accepted for this game
        raise ConfigError(f"{flag}: {str(e).splitlines()[0]}") from None


def check_opponents(flag: str, specs, game_name: str) -> None:
    """Each opponent spec playable in `game_name`, or one line naming `flag`, the spec and what is accepted."""
    game = _load_game(game_name)
    for spec in specs:
        _opponent(flag, spec, game, game_name)


def check_job(cfg, flags=frozenset()) -> None:
    """Every cross-field and outside-world check of a JobConfig (see the module docstring). `flags`: the paths the
    user set by flag (a refusal says whether the flag or the script's preset set the field)."""
    from earl_jax.envs.text import PROMPT_STYLES
    from earl_jax.models.setup import check_spec

    env = cfg.env
    if env.prompt_style not in PROMPT_STYLES:
        raise ConfigError(f"--env.prompt-style: {env.prompt_style!r} is not one of {', '.join(PROMPT_STYLES)}")
    if env.agent_player not in (None, 0, 1):
        raise ConfigError(f"--env.agent-player: must be 0, 1 or none (got {env.agent_player!r})")
    if cfg.loss.behaviour == "sampler" and cfg.rollout.temperature != 1.0:
        # the train stage scores at temperature 1: a tempered sampler's log-probs are another policy's
        raise ConfigError(f"--loss.behaviour sampler: the sampler's log-probs are at --rollout.temperature "
                          f"{cfg.rollout.temperature}, the trainer's at 1.0; use --loss.behaviour recompute")
    game = None
    if env.task:
        _check_task_job(cfg, flags)
    else:
        game = _check_game_job(cfg)
    try:
        check_spec(cfg.model)
    except (CheckpointError, ValueError) as e:
        msg = str(e).split("\n")[0]
        raise ConfigError(msg if msg.startswith("--") else f"--model.name: {msg}") from None
    if game is not None and cfg.rollout.constrain_moves:
        _check_moves(cfg, game)
    _check_chat(cfg)


def _check_moves(cfg, game) -> None:
    """Constrained moves need one token per action in the model's tokenizer: checked here, not after the model loads."""
    from earl_jax.models.tokenizer import game_tokenizer, load_tokenizer, special_ids
    from earl_jax.rollout.moves import MoveTokens

    folder = cfg.model.hf_checkpoint
    try:
        tokenizer = load_tokenizer(folder) if folder else game_tokenizer()  # as the trainer: the checkpoint's, or ours
        MoveTokens.build(tokenizer, game.num_distinct_actions(), special_ids(tokenizer).eos_id)
    except ValueError as e:  # MoveTokens' message names the flag, the game's actions and why
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{msg} (--env.game {cfg.env.game})" if msg.startswith("--")
                          else f"--model.hf-checkpoint {folder}: {msg}") from None


def _check_chat(cfg) -> None:
    """--env.chat-template: a task's template loads and is prefix-stable; a game has none to render."""
    from earl_jax.models.tokenizer import game_tokenizer, load_tokenizer, special_ids
    from earl_jax.tasks.chat import task_chat

    env, folder = cfg.env, cfg.model.hf_checkpoint
    if not env.task:
        if env.chat_template == "on":
            raise ConfigError("--env.chat-template on: chat templates render a text task's turns (--env.task); a "
                              "game's text is --env.prompt-style")
        return
    try:
        tokenizer = load_tokenizer(folder) if folder else game_tokenizer()
        task_chat(env.chat_template, folder, tokenizer.id_to_token(special_ids(tokenizer).eos_id))
    except ValueError as e:
        msg = str(e).splitlines()[0]
        raise ConfigError(msg if msg.startswith("--") else f"--env.chat-template {env.chat_template}: {msg}") from None


def _check_task_job(cfg, flags=frozenset()) -> None:
    """A task: it loads and resets; the game-only features are refused; answers are free text."""
    from earl_jax.cli import flag_of
    from earl_jax.envs.env_config import EnvConfig
    from earl_jax.rl.loop.job_config import EvalConfig
    from earl_jax.tasks import check_task

    try:
        check_task(cfg.env.task, cfg.env.task_args)
    except Exception as e:  # the user's module: any error in import, factory or reset is a one-line input error
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--env.task {cfg.env.task}: {msg.removeprefix('task: ')}") from None
    for path, on in ((("curriculum", "league_size"), cfg.curriculum.league_size),
                     (("curriculum", "mix_opponent"), cfg.curriculum.mix_opponent),
                     (("curriculum", "rehearsal_share"), cfg.curriculum.rehearsal_share),
                     (("env", "opponent"), cfg.env.opponent != EnvConfig.opponent),  # the default: unused
                     (("eval", "opponents"), cfg.eval.opponents not in ((), EvalConfig.opponents)),
                     (("rollout", "constrain_moves"), cfg.rollout.constrain_moves),
                     (("env", "blunder_penalty"), cfg.env.blunder_penalty)):
        if on:
            flag = flag_of(path) + {"opponent": f" {cfg.env.opponent}",
                                    "opponents": f" {','.join(cfg.eval.opponents)}"}.get(path[1], "")
            # not typed: a game script's preset set it (connect4.py --env.task ...)
            where = "" if path in flags else " (set by the script's preset: text tasks run with experiments/train.py)"
            raise ConfigError(f"{flag}: a game feature{where}; --env.task {cfg.env.task} is a text task (free-text "
                              "answers, no opponents)")


# the curriculum's fields that mean nothing without --env.opponent curriculum
CURRICULUM_ONLY = ("ladder", "promote_on_stall", "rung_max_iterations", "rung_max_share", "rehearsal_share")


def _check_game_job(cfg):
    from earl_jax.cli import flag_of
    from earl_jax.envs.env_config import parse_task_args
    from earl_jax.rl.matchups.curriculum import parse_ladder

    for name in CURRICULUM_ONLY:
        if getattr(cfg.curriculum, name) and cfg.env.opponent != "curriculum":
            raise ConfigError(f"{flag_of(('curriculum', name))}: needs --env.opponent curriculum")
    if cfg.sft.answers != "expert":
        raise ConfigError("--sft.answers: a text task's choice; a game's warm-up always plays random legal moves")
    if parse_task_args(cfg.env.task_args):
        raise ConfigError("--env.task-args: a text task's keyword arguments, and --env.task is not set (a game's "
                          "settings are --env.* flags)")
    env = cfg.env
    check_game_name(cfg)
    game = _load_game(env.game)
    if env.opponent != "curriculum":
        _opponent("--env.opponent", env.opponent, game, env.game)
    for name in cfg.eval.opponents:
        _opponent("--eval.opponents", name, game, env.game)
    mix = cfg.curriculum.mix_opponent
    for flag, text, needed in (("--curriculum.ladder", cfg.curriculum.ladder, env.opponent == "curriculum"),
                               ("--curriculum.mix-opponent", mix, bool(mix))):
        if needed:
            try:
                parse_ladder(text, env.game)
            except ValueError as e:
                raise ConfigError(f"{flag}: {e} (got {text!r})") from None
    return game


def check_run_dir(cfg) -> None:
    """The run folder: not a file, one this process can write; with a plain --resume, one that holds a checkpoint
    (nothing is created)."""
    run_dir = Path(cfg.run.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run.run-dir: {run_dir} is a file, not a folder")
    _check_writable(run_dir)
    if cfg.run.resume == "true":
        ckpt = run_dir / "checkpoints"
        if not ckpt.is_dir() or not any(p.name.isdigit() for p in ckpt.iterdir()):
            raise ConfigError(f"--resume: {run_dir} holds no checkpoint to resume (--resume auto starts a run there "
                              "when it has none)")


def _check_writable(run_dir: Path) -> None:
    """The run folder, or the nearest folder above it that exists (where it would be made), takes a file: one is made
    and gone at once (os.access says yes to root), so a run that could not write checkpoints fails here, not after the
    model is built."""
    import tempfile

    here = run_dir.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise ConfigError(f"--run.run-dir: {run_dir} is under {here}, a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        raise ConfigError(f"--run.run-dir: {run_dir} cannot be written ({here}: {e.strerror})") from None


def apply_base(cfg, typed: Mapping[tuple[str, ...], object], by_preset: frozenset = frozenset()):
    """A base policy (a folder with earl_base.json, made by experiments/pretrain.py) says what it was trained for: its
    game must be the job's, and its prompt style and move mode become the job's unless typed, when they must agree
    (a base trained on constrained moves would answer free text with garbage, and the presets would otherwise take it
    for a chat model). The format warm-up is off: a base knows its answer format. Plain HF folders pass unchanged.
    A --model.name, prompt style or move mode typed (or set by a preset) that the preset's base (the default's, or
    one a file preset names: `by_preset`, Parsed.by_preset) was not made for drops the base: random weights. On random
    weights (so, or `--model.hf-checkpoint ""`) a KL coefficient the preset set is dropped too: the reference is the
    starting policy, and a random one is nothing to stay near."""
    from earl_jax.cli import replace_paths
    from earl_jax.models.export import read_base_info

    def random_weights(folder=None):
        return replace_paths(cfg, {("model", "hf_checkpoint"): folder,
                                   **({} if ("loss", "kl_coef") in typed else {("loss", "kl_coef"): 0.0})})

    if ("model", "hf_checkpoint") in by_preset:  # a preset's base is a default, as the script's own is
        typed = {p: v for p, v in typed.items() if p != ("model", "hf_checkpoint")}
    folder = cfg.model.hf_checkpoint
    if folder and ("model", "name") in typed and ("model", "hf_checkpoint") not in typed:
        # the default preset's base has its own shape: a shape typed (or set by another preset) starts from random
        # weights; typed together, the checkpoint wins as for any Hugging Face folder
        return random_weights()
    if not folder:
        return random_weights(folder) if ("model", "hf_checkpoint") in typed else cfg
    try:
        info = read_base_info(folder)
    except ValueError as e:
        raise ConfigError(f"--model.hf-checkpoint {folder}: {str(e).splitlines()[0]}") from None
    if info is None:
        return cfg
    if info["game"] != cfg.env.game:
        raise ConfigError(f"--model.hf-checkpoint {folder}: a base for {info['game']}, not for --env.game "
                          f"{cfg.env.game}")
    wanted = {("env", "prompt_style"): info["prompt_style"],
              ("rollout", "constrain_moves"): info["move_mode"] == "constrained", ("sft", "steps"): 0}
    changes = {}
    for path, value in wanted.items():
        current = getattr(getattr(cfg, path[0]), path[1])
        if path in typed and current != value and path != ("sft", "steps"):
            if ("model", "hf_checkpoint") not in typed:  # the default preset's base cannot do this: random weights
                return random_weights()
            raise ConfigError(f"--{'.'.join(p.replace('_', '-') for p in path)}: {current!r}, but the base in "
                              f"{folder} was trained with {value!r}")
        if path not in typed:
            changes[path] = value
    return replace_paths(cfg, changes)
