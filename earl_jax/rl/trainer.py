"""The RL loop: rollout -> experience -> train, each a separately jitted stage on its own mesh.

One iteration:
    plan = selector.plan(last batch's context)          the rollout's mesh
    weights train layout -> rollout layout            (dispatcher, device to device)
    rollout: B groups x G games in lock-step            (agent loop + sampler)
    plan = selector.plan(this batch's context)          experience / train mesh, micro-batch, chunk
    experience: old/ref log-probs in chunks, advantages (experience mesh)
    batch experience layout -> train layout           (dispatcher)
    train: micro-batched PPO-clip update                 (train mesh)
    metrics, evaluation, checkpoint

Everything random derives from (seed, step), so a run killed and resumed from a checkpoint reaches the
same parameters as one that never stopped (bit-exact on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from earl_jax.distributed import global_to_host, host_to_global
from earl_jax.envs import EnvConfig, OpenSpielTextEnv
from earl_jax.models.config import ModelConfig, get_config
from earl_jax.models.init import init_sharded
from earl_jax.models.tokenizer import game_tokenizer, load_tokenizer, special_ids
from earl_jax.parallel.context import use_mesh_rules
from earl_jax.parallel.dispatch import Dispatcher
from earl_jax.parallel.memory import device_memory_stats
from earl_jax.parallel.mesh import STAGE_RULES, mesh_shape_of, state_shardings
from earl_jax.parallel.profile import is_oom_error
from earl_jax.parallel.selector import StageLayout, run_with_oom_fallback
from earl_jax.parallel.stage_plan import StagePlanner
from earl_jax.rl.checkpoint import Checkpointer
from earl_jax.rl.config import RLConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.metrics import MetricsLogger
from earl_jax.rl.stages import ExperienceBatch, experience_stage, make_optimizer, sft_stage, train_stage
from earl_jax.rollout.agent_loop import RolloutConfig, ScriptedPolicy, Trajectories, play_games
from earl_jax.rollout.policy import SamplerPolicy
from earl_jax.rollout.sampler import DEFAULT_LENGTH_BUCKETS, Sampler, SamplingConfig, bucket

_MOVES = re.compile(r"moves:((?: \d+)+)")


def _random_legal_answer(rng: np.random.Generator):
    """A scripted answer: a uniformly random legal move read off the last observation (format warm-up)."""

    def answer(context: str) -> str:
        found = _MOVES.findall(context)
        moves = found[-1].split() if found else ["0"]
        return moves[int(rng.integers(len(moves)))]

    return answer


def _device_memory() -> dict[str, float]:
    """Largest bytes in use / peak / limit over this process's devices, in GiB (GPU, TPU; {} on CPU)."""
    stats = [device_memory_stats(d) for d in jax.local_devices()]
    out = {}
    for key, name in (("bytes_in_use", "in_use_gib"), ("peak_bytes_in_use", "peak_gib"), ("bytes_limit", "limit_gib")):
        vals = [st[key] for st in stats if key in st]
        if vals:
            out[f"memory/{name}"] = max(vals) / 2**30
    return out


def _pad_cols(x: np.ndarray, width: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, width - x.shape[1])))


class Trainer:
    def __init__(self, cfg: RLConfig, *, log: bool = True, env_factory: Callable[[EnvConfig], Any] | None = None):
        """`env_factory(env_config)` makes one game (default: an OpenSpiel text environment); tests and
        research forks pass their own environments with the same reset/step interface."""
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.is_main = jax.process_index() == 0
        self.dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(
            cfg.dtype, jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)

        # Model and tokenizer: a local Hugging Face folder, or a preset with the built-in game tokenizer.
        if cfg.hf_checkpoint:
            self.model_cfg = ModelConfig.from_hf_json(Path(cfg.hf_checkpoint) / "config.json")
        else:
            # A preset without a checkpoint is a random-init model of that shape that speaks the built-in
            # game tokenizer (its vocabulary replaces the preset's 152K: sampled ids must decode).
            self.tokenizer = game_tokenizer()
            self.model_cfg = get_config(cfg.model, vocab_size=self.tokenizer.get_vocab_size())
        self.remat = cfg.remat if cfg.remat != "auto" else ("none" if jax.default_backend() == "cpu" else "full")
        self.planner = StagePlanner.from_config(cfg, self.model_cfg, remat=self.remat != "none")
        train_mesh = self.planner.mesh("train")
        if cfg.hf_checkpoint:
            from earl_jax.models.loader import from_pretrained

            model, self.tokenizer = from_pretrained(cfg.hf_checkpoint, mesh=train_mesh, rules=STAGE_RULES["train"],
                                                    dtype=self.dtype, param_dtype=jnp.float32)
            if self.tokenizer is None:
                raise ValueError(f"--hf-checkpoint {cfg.hf_checkpoint}: no tokenizer.json in the folder")
        else:
            model = init_sharded(self.model_cfg, train_mesh, STAGE_RULES["train"], seed=cfg.seed, dtype=self.dtype)
        self.ids = special_ids(self.tokenizer)
        model.remat = self.remat == "full"  # a static attribute: part of the graphdef the stages merge
        self.graphdef, self.params = nnx.split(model)
        self.dispatcher = Dispatcher()
        # A frozen copy: the train stage donates (overwrites) the policy's buffers.
        self.ref_params = jax.tree.map(jnp.copy, self.params) if cfg.kl_coef > 0 else None

        self.loss_cfg = LossConfig(
            algorithm=cfg.algorithm, clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high,
            dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator if cfg.kl_coef > 0 else None,
            entropy_coef=cfg.entropy_coef, aggregation=cfg.aggregation, gamma=cfg.gamma,
            between_group_weight=cfg.between_group_weight, entropy_floor=cfg.entropy_floor,
            turn_discount=cfg.turn_discount)
        self.optimizer = make_optimizer(cfg.learning_rate, cfg.warmup_steps, cfg.steps * cfg.ppo_epochs,
                                        cfg.weight_decay, cfg.grad_clip)
        self.opt_state = jax.jit(self.optimizer.init)(self.params)
        self.opt_state = self.dispatcher(self.opt_state, self._train_layout(train_mesh)[1])
        self.sft_optimizer = make_optimizer(3e-3, 5, max(cfg.format_warmup_steps, 6), 0.0, cfg.grad_clip)
        self.step = 0
        self._no_signal = 0  # consecutive iterations without a gradient (see iteration())
        self._samplers: dict[int, Sampler] = {}  # one per rollout mesh: each keeps its compiled programs
        self.sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
        self.rollout_cfg = RolloutConfig(cfg.max_turn_tokens, cfg.max_turns, cfg.max_context)
        env_cfg = EnvConfig(game=cfg.game, opponent=cfg.opponent, agent_player=cfg.agent_player,
                            prompt_style=cfg.prompt_style, max_retries=cfg.invalid_retries,
                            win_reward=cfg.win_reward, loss_reward=cfg.loss_reward, draw_reward=cfg.draw_reward,
                            invalid_reward=cfg.invalid_reward, retry_reward=cfg.retry_reward)
        self.env_cfg = env_cfg
        make_env = env_factory or OpenSpielTextEnv
        self.envs = [make_env(env_cfg) for _ in range(cfg.batch_size)]
        self.eval_envs = {o: [make_env(dataclasses.replace(env_cfg, opponent=o))
                              for _ in range(cfg.eval_games)] for o in cfg.eval_opponents}
        self._compiled: set[tuple] = set()
        self._jit_cache: dict[tuple, Any] = {}

        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints)
        if cfg.resume:
            self._restore()
        elif self.checkpointer.latest_step() is not None:
            raise ValueError(f"--run-dir {self.run_dir} already holds checkpoints: pass --resume to continue it, "
                             f"or choose a new --run-dir (refusing to overwrite a run)")
        self.logger = MetricsLogger(self.run_dir, dataclasses.asdict(cfg), wandb_mode=cfg.wandb_mode,
                                    project=cfg.wandb_project, resume=cfg.resume, enabled=log and self.is_main)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

    # ---------------------------------------------------------------- checkpoints
    def _state(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state,
                # a global (replicated) array: orbax cannot save a single-device array over several processes
                "rng": host_to_global(jax.random.key_data(jax.random.key(self.cfg.seed)),
                                      NamedSharding(self.planner.mesh("train"), P()))}

    def save(self) -> None:
        self.checkpointer.save(self.step, self._state(), {"step": self.step, "planner": self.planner.state_dict()})

    def _restore(self) -> None:
        step, state, meta = self.checkpointer.restore(self._state())
        self.params, self.opt_state, self.step = state["params"], state["opt_state"], step
        self.planner.load_state_dict(meta.get("planner", {}))

    # ---------------------------------------------------------------- stages
    def _rollout(self, envs, seeds, group_ids, rng, sampling: SamplingConfig) -> Trajectories:
        mesh = self.planner.mesh("rollout")
        t0 = time.perf_counter()
        params = self.dispatcher(self.params, state_shardings(self.params, mesh, STAGE_RULES["rollout"]))
        dispatch_s = time.perf_counter() - t0
        if id(mesh) not in self._samplers:
            self._samplers[id(mesh)] = Sampler(self.graphdef, self.model_cfg, mesh=mesh, rules=STAGE_RULES["rollout"])
        turn_tokens = self.cfg.turn_tokens(self.step)
        stops = (self.ids.eos_id,) if self.cfg.stop_at_eos else ()
        policy = SamplerPolicy(self._samplers[id(mesh)], params, sampling, stops, turn_tokens)
        rollout_cfg = dataclasses.replace(self.rollout_cfg, max_turn_tokens=turn_tokens)
        traj = play_games(policy, envs, self.tokenizer, rollout_cfg, rng, seeds, group_ids, bos_id=self.ids.bos_id)
        traj.stats["dispatch_s"] = dispatch_s
        return traj

    def _batch_arrays(self, traj: Trajectories) -> dict[str, np.ndarray]:
        width = max(64, bucket(traj.tokens.shape[1], DEFAULT_LENGTH_BUCKETS))  # bounded set of train shapes
        return {"tokens": _pad_cols(traj.tokens, width), "loss_mask": _pad_cols(traj.loss_mask, width),
                "rewards": _pad_cols(traj.rewards, width), "group_ids": traj.group_ids}

    def _to_stage(self, arrays: dict[str, np.ndarray], stage: str, mesh=None) -> dict[str, jax.Array]:
        """Host arrays (built by the agent loop) onto a stage's mesh, rows over the batch axes."""
        mesh = self.planner.mesh(stage) if mesh is None else mesh
        rows = ("data", "fsdp") if stage == "train" else ("data",)
        return {k: host_to_global(v, NamedSharding(mesh, P(rows))) for k, v in arrays.items()}  # all processes

    def _experience(self, arrays: dict[str, np.ndarray], layout: StageLayout) -> tuple[ExperienceBatch, dict]:
        mesh = self.planner.mesh_of(layout.mesh)
        params = self.dispatcher(self.params, state_shardings(self.params, mesh, STAGE_RULES["experience"]))
        ref = None if self.ref_params is None else self.dispatcher(
            self.ref_params, state_shardings(self.ref_params, mesh, STAGE_RULES["experience"]))
        x = self._to_stage(arrays, "experience", mesh)
        fn = self._jit("experience", mesh, partial(
            experience_stage, self.graphdef, num_groups=self.cfg.groups, loss_cfg=self.loss_cfg,
            chunk=min(layout.logprob_chunk, self.cfg.logprob_chunk),
            filter_constant_groups=self.cfg.filter_constant_groups), x["tokens"].shape)
        return fn(params, ref, x["tokens"], x["loss_mask"], x["rewards"], x["group_ids"])

    def _train_layout(self, mesh, opt_state: Any = None) -> tuple[Any, Any]:
        """Targets for params and optimizer state on a train mesh: moments follow their parameters,
        scalars (the step count) are replicated."""
        params_target = state_shardings(self.params, mesh, STAGE_RULES["train"])
        replicated = NamedSharding(mesh, P())
        opt_target = jax.tree.map(lambda sub: params_target if isinstance(sub, nnx.State) else replicated,
                                  self.opt_state if opt_state is None else opt_state,
                                  is_leaf=lambda x: isinstance(x, nnx.State))
        return params_target, opt_target

    def _train(self, batch: ExperienceBatch, layout: StageLayout) -> dict[str, Any]:
        mesh = self.planner.mesh_of(layout.mesh)
        rows_sharding = NamedSharding(mesh, P(("data", "fsdp")))
        t0 = time.perf_counter()
        # The selector may have moved training to another mesh: weights and optimizer state follow.
        params_target, opt_target = self._train_layout(mesh)
        self.params = self.dispatcher(self.params, params_target)
        self.opt_state = self.dispatcher(self.opt_state, opt_target)
        batch = self.dispatcher(batch, jax.tree.map(lambda _: rows_sharding, batch))
        jax.block_until_ready(batch)
        dispatch_s = time.perf_counter() - t0
        n, t = batch.tokens.shape
        micro_batches = self._micro_batches(n, t, layout.micro_batch)
        fn = self._jit("train", mesh, partial(train_stage, self.graphdef, optimizer=self.optimizer,
                                              loss_cfg=self.loss_cfg, micro_batches=micro_batches,
                                              chunk=self.cfg.logprob_chunk), (n, t), donate=(0, 1))
        metrics = {}
        for _ in range(self.cfg.ppo_epochs):
            try:
                self.params, self.opt_state, metrics = fn(self.params, self.opt_state, batch)
            except Exception as e:
                if any(x.is_deleted() for x in jax.tree.leaves(self.params)):  # donated buffers are gone
                    raise RuntimeError("the train stage failed after donating the weights; resume from the "
                                       "last checkpoint (--resume)") from e
                raise
        metrics = global_to_host(metrics)
        metrics["dispatch_s"] = dispatch_s
        return metrics

    def _with_oom_fallback(self, stage: str, fn: Callable[[StageLayout], Any]) -> Any:
        if self.cfg.selector_mode == "static":  # the baseline: an out-of-memory error ends the run
            layout = self.planner.layout(stage)
            try:
                return fn(layout)
            except Exception as e:
                if is_oom_error(e):
                    raise RuntimeError(f"{stage} stage ran out of memory on the static layout {layout.describe()} "
                                       f"(--selector-mode static keeps the first plan; auto adapts it)") from e
                raise
        # An OOM first halves the micro-batch on the same mesh, then gives the mesh up (for this bucket);
        # train updates (and donates) the weights, so it is never rerun on a process where it succeeded.
        result, plan = run_with_oom_fallback(stage, fn, self.planner.current, self.planner.selector,
                                             shrink_first=True, rerun_after_success=stage != "train")
        self.planner.current = plan
        return result

    def _micro_batches(self, n: int, t: int, selector_rows: int | None) -> int:
        """Micro-batches for n rows of t tokens: within the token budget and the selector's micro-batch."""
        rows = max(1, min(n, self.cfg.micro_batch_tokens // t, selector_rows or n))
        return n // max(d for d in range(1, rows + 1) if n % d == 0)

    def _jit(self, stage: str, mesh, fn: partial, shape, donate=()):
        """The stage's program traced under its mesh and rules; one jit per (stage, mesh, static settings).
        Compiled variants are counted per (stage, mesh shape, length bucket): the compile/programs metric."""
        self._compiled.add((stage, str(mesh_shape_of(mesh)), tuple(shape)))
        key = (stage, id(mesh), tuple(sorted(fn.keywords.items())))
        if key not in self._jit_cache:
            rules = STAGE_RULES[stage]

            def traced(*args):
                with use_mesh_rules(mesh, rules):
                    return fn(*args)

            self._jit_cache[key] = jax.jit(traced, donate_argnums=donate)
        return self._jit_cache[key]

    # ---------------------------------------------------------------- warm-up, evaluation
    def format_warmup(self) -> dict[str, float]:
        """Supervised steps on uniformly random legal moves: teaches the answer format, not the game."""
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + 12345)
        policy = ScriptedPolicy(_random_legal_answer(rng), self.tokenizer, self.ids.eos_id)
        opt_state = jax.jit(self.sft_optimizer.init)(self.params)
        opt_state = self.dispatcher(opt_state, self._train_layout(self.planner.mesh("train"), opt_state)[1])
        sft = {}
        metrics = {}
        for i in range(cfg.format_warmup_steps):
            seeds = [10_000_000 + i * len(self.envs) + j for j in range(len(self.envs))]
            traj = play_games(policy, self.envs, self.tokenizer, self.rollout_cfg, jax.random.key(i), seeds,
                              bos_id=self.ids.bos_id)
            arrays = self._to_stage(self._batch_arrays(traj), "train")
            n, t = arrays["tokens"].shape
            mb = self._micro_batches(n, t, self.planner.layout("train").micro_batch)
            if mb not in sft:
                sft[mb] = jax.jit(partial(sft_stage, self.graphdef, optimizer=self.sft_optimizer, micro_batches=mb,
                                          chunk=cfg.logprob_chunk), donate_argnums=(0, 1))
            self.params, opt_state, metrics = sft[mb](self.params, opt_state, arrays["tokens"], arrays["loss_mask"])
        return {k: float(v) for k, v in global_to_host(metrics).items()}

    def evaluate(self) -> dict[str, float]:
        """Greedy games against each evaluation opponent (fixed seeds, so evaluations are comparable)."""
        out: dict[str, float] = {}
        greedy = SamplingConfig(greedy=True)
        for name, envs in self.eval_envs.items():
            seeds = [20_000_000 + i for i in range(len(envs))]
            traj = self._rollout(envs, seeds, None, jax.random.key(0), greedy)
            prefix = "eval" if name == self.cfg.eval_opponents[0] else f"eval_{name}"
            for k in ("win_rate", "draw_rate", "loss_rate", "invalid_rate"):
                out[f"{prefix}/{k}"] = traj.stats[k]
        return out

    # ---------------------------------------------------------------- the loop
    def iteration(self) -> dict[str, Any]:
        cfg = self.cfg
        self.planner.plan()  # the rollout's layout, from the last batch's statistics
        rng = jax.random.fold_in(jax.random.key(cfg.seed), self.step)
        seeds = [(cfg.seed * 1_000_003 + self.step * cfg.groups + g) % (2**31) for g in range(cfg.groups)
                 for _ in range(cfg.group_size)]
        group_ids = np.repeat(np.arange(cfg.groups), cfg.group_size)

        n_dispatch = len(self.dispatcher.history)
        traj = self._rollout(self.envs, seeds, group_ids, rng, self.sampling)
        # Experience and train are planned for the batch they process (its longest context is known now);
        # the OOM fallback may still change their layouts.
        s = traj.stats
        self.planner.observe(s["turn_context_len_mean"], s["context_len_max"], traj.num_games,
                             s["prompt_tokens"], s["first_cache_len"], s["observation_tokens"])
        self.planner.plan()
        t0 = time.perf_counter()
        arrays = self._batch_arrays(traj)
        # An out-of-memory error marks that mesh infeasible for this context bucket and reruns the stage
        # on the next candidate, with the same batch.
        batch, exp_metrics = self._with_oom_fallback(
            "experience", lambda layout: jax.block_until_ready(self._experience(arrays, layout)))
        t1 = time.perf_counter()
        train_metrics = self._with_oom_fallback("train", lambda layout: self._train(batch, layout))
        plan = self.planner.current
        t2 = time.perf_counter()
        self.step += 1
        # A zero gradient means every advantage was 0 (every group constant or filtered): the weights do not move
        # until some group's rewards vary again, so a collapsed policy stays collapsed. Say so (first, every 10th).
        self._no_signal = self._no_signal + 1 if train_metrics["grad_norm"] == 0.0 else 0
        if self._no_signal % 10 == 1:
            warnings.warn(f"iteration {self.step}: no learning signal for {self._no_signal} iteration(s) in a row (zero "
                          f"gradient; {float(exp_metrics.get('filtered_frac', 0.0)):.0%} of games in constant groups); "
                          "see --entropy-floor and --between-group-weight", RuntimeWarning, stacklevel=2)

        record = {
            "step": self.step,
            "episode/return_mean": float(traj.returns.mean()),
            "episode/win_rate": s["win_rate"], "episode/invalid_rate": s["invalid_rate"],
            "episode/turns_mean": s["turns_mean"], "episode/truncated_rate": s["truncated_rate"],
            "rollout/context_len_mean": s["context_len_mean"], "rollout/context_len_max": s["context_len_max"],
            "rollout/turn_tokens": cfg.turn_tokens(self.step - 1),
            "rollout/turn_context_len_mean": s["turn_context_len_mean"],
            "rollout/tokens": s["tokens"], "rollout/generated_tokens": s["generated_tokens"],
            "rollout/env_frac": s["env_s"] / max(s["rollout_s"], 1e-9),
            "time/rollout_s": s["rollout_s"], "time/experience_s": t1 - t0, "time/train_s": t2 - t1,
            "time/dispatch_s": s["dispatch_s"] + train_metrics.pop("dispatch_s"),
            "train/loss": train_metrics["loss"], "train/kl": train_metrics.get("kl", 0.0),
            "train/entropy": train_metrics.get("entropy", 0.0), "train/grad_norm": train_metrics["grad_norm"],
            "train/clip_frac": train_metrics.get("clip_frac", 0.0), "train/skipped": train_metrics["skipped"],
            "train/filtered_frac": float(exp_metrics.get("filtered_frac", 0.0)),
            "train/no_signal_iters": self._no_signal,
            "dispatch/bytes": sum(h.bytes for h in self.dispatcher.history[n_dispatch:]),
            "compile/programs": len(self._compiled),
            **plan.log_dict(), **_device_memory(),
        }
        return record

    def run(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train to cfg.steps (or cfg.max_minutes). `stop_after` ends the process's work after that many
        iterations without the end-of-run evaluation or checkpoint, as a kill would (resume tests)."""
        from earl_jax.rl.progress import Progress

        cfg = self.cfg
        start = time.perf_counter()
        history = []
        last_eval: dict[str, float] = {}
        with Progress(cfg.steps, enabled=cfg.progress and self.is_main) as bar:
            if self.step == 0 and cfg.format_warmup_steps:
                bar.status("format warm-up (random legal moves)")
                warm = self.format_warmup()
                last_eval = self.evaluate()
                self.logger.log({"step": 0, **{f"warmup/{k}": v for k, v in warm.items()}, **last_eval,
                                 "eval/fresh": True})
            elif self.step == 0:
                last_eval = self.evaluate()
            bar.advance_to(self.step)
            while self.step < cfg.steps:
                if stop_after is not None and len(history) >= stop_after:
                    return history
                record = self.iteration()
                last_step = self.step == cfg.steps
                out_of_time = cfg.max_minutes and (time.perf_counter() - start) / 60 > cfg.max_minutes
                evaluated = bool((cfg.eval_every and self.step % cfg.eval_every == 0) or last_step or out_of_time)
                if evaluated:
                    last_eval = self.evaluate()
                record.update(last_eval)  # carried between evaluations; eval/fresh marks a new one
                record["eval/fresh"] = evaluated
                record["time/elapsed_s"] = time.perf_counter() - start
                self.logger.log(record)
                history.append(record)
                bar.update(self.step, record)
                if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last_step or out_of_time:
                    self.save()
                if out_of_time:
                    break
        self.logger.close()
        self.checkpointer.close()
        return history
