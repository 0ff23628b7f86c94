"""The single-controller RL trainer: rollout -> reward/reference/critic -> advantages -> updates -> sync.

One step, each a component of its own that reads and fills the step's typed
:class:`~verl_core.trainer.rl.step_state.StepState`:

1. take ``prompts_per_step`` prompts: the next rows of the user's dataset (``data.train``, in a
   seeded order that checkpoints keep), or the built-in task's (a deterministic function of seed
   and step) (:class:`~verl_core.trainer.rl.prompt_source.PromptSource`);
2. ``RolloutEngine.generate`` ``n`` responses per prompt (with ``[agent]``: ``n`` multi-turn
   episodes per prompt, :mod:`verl_core.trainer.rl.episodes`) (and, for ReMax, a greedy baseline), then
   concurrently, through :class:`~verl_core.trainer.pipeline.HybridPipeline`: reward scores,
   reference log-probs, the actor's ``old_log_probs`` and entropy, the critic's values; DAPO's
   dynamic sampling drops groups whose scores are all equal
   (:class:`~verl_core.trainer.rl.generation.GenerationStage`);
3. advantages on the global batch (:class:`verl_core.algorithms.Algorithm`), then mini-batches from
   the replay buffer; per mini-batch ``forward_backward`` over micro-batches picked by the
   :class:`~verl_core.trainer.batching.scheduler.DynamicBatchScheduler`, then ``optimizer_step`` (actor,
   and critic when the algorithm has one) (:class:`~verl_core.trainer.rl.update.UpdateStage`);
4. weight sync actor -> rollout (:class:`~verl_core.trainer.rl.weight_sync.WeightSyncStage`);
5. evaluation when due (:class:`~verl_core.trainer.rl.evaluation.Evaluator`) and the step's metrics
   (:mod:`verl_core.trainer.rl.step_metrics`).

Engines are built by backend name through :mod:`verl_core.kernel.registry`, placed by the executor of the
config key ``executor`` (:mod:`verl_core.trainer.executor`: this process, or Ray worker groups); nothing
here knows which backend it talks to or where it runs. The reward is the user's reward functions
(``reward.functions``, :mod:`verl_core.trainer.inputs.rewards`), a reward-model backend, or the task's rule.
The run folder, metric sinks (``logging.sinks``), checkpoints and the loop are the
:class:`~verl_core.trainer.run.context.RunContext`'s, shared with ``verl sft``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import IO, Any

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.weights import StreamWeightSync, WeightSync
from verl_core.trainer.batching.budget import make_schedulers
from verl_core.trainer.batching.replay import HybridReplayBuffer
from verl_core.trainer.batching.scheduler import DynamicBatchScheduler, MemoryProbe, PeakProbe
from verl_core.trainer.config import RunConfig
from verl_core.trainer.executor import Executor, make_executor
from verl_core.trainer.inputs.tasks import get_task
from verl_core.trainer.pipeline import StageError, StageThreads
from verl_core.trainer.rl.algorithm_setup import AlgorithmSetup, build_algorithm
from verl_core.trainer.rl.engines import RLEngines
from verl_core.trainer.rl.episodes import EpisodeRollout
from verl_core.trainer.rl.evaluation import Evaluator
from verl_core.trainer.rl.generation import GenerationStage
from verl_core.trainer.rl.producer import RolloutProducer, producer_slots, release_limit
from verl_core.trainer.rl.prompt_source import PromptSource
from verl_core.trainer.rl.stages import stage_backend
from verl_core.trainer.rl.step_metrics import (
    SchedulerPlanLog,
    finish_metrics,
    plot_metrics,
    rollout_metrics,
)
from verl_core.trainer.rl.step_state import RunProgress, StepState
from verl_core.trainer.rl.update import UpdateStage
from verl_core.trainer.rl.weight_sync import SleepPolicy, WeightSyncStage
from verl_core.trainer.run.backends import check_backends
from verl_core.trainer.run.checkpoints import latest_checkpoint
from verl_core.trainer.run.context import RunContext, StepFailedError
from verl_core.trainer.run.folder import RunDir
from verl_core.trainer.run.memory_plan import MemoryPlan, plan_run_memory
from verl_core.trainer.run.model import check_model_folders, engine_spec
from verl_core.trainer.sinks import MetricSinks

__all__ = ["Trainer", "build_algorithm", "latest_checkpoint", "plot_metrics"]


def _delegate(owner: str, name: str, doc: str, *, settable: bool = True) -> Any:
    """A property of :class:`Trainer` that reads (and sets) ``name`` of the component in attribute ``owner``."""

    def get(self: Trainer) -> Any:
        return getattr(getattr(self, owner), name)

    def put(self: Trainer, value: Any) -> None:
        setattr(getattr(self, owner), name, value)

    return property(get, put if settable else None, doc=doc)


log = logging.getLogger(__name__)

class Trainer:
    """Runs an RL training loop from a :class:`RunConfig`.

    Args:
        config: The run.
        memory_probe: Memory probe of the micro-batch scheduler (default: the device's real memory).
        peak_probe: Allocator peak probe whose reading of the first update refines the micro-batch
            budget once (default: the CUDA allocator on a CUDA device, none on the CPU).
        stream: Where the progress bar and its messages go (default stderr).
        base_dir: The config file's folder: relative paths of datasets, reward-function files and
            callback files are looked up there first, then in the working directory (default:
            the working directory only).

    Use :meth:`train` (optionally resuming from the newest checkpoint of the output dir); engines
    are built on first use and released by :meth:`close`. The output dir is claimed for one run
    before anything is written there (:class:`~verl_core.trainer.run.folder.RunDir`): a fresh run
    needs a new or empty folder, a resumed one the run's marker, and the trainer deletes only
    files of its own run.
    """

    # the engines (built by setup; replacing one here replaces it for every component)
    actor: TrainingEngine = _delegate("engines", "actor", "The policy being trained.")
    rollout: RolloutEngine = _delegate("engines", "rollout", "The engine that samples responses.")
    reward: RewardEngine = _delegate("engines", "reward", "Scores the responses.")
    reference: TrainingEngine | None = _delegate("engines", "reference", "The reference policy (None: not used).")
    critic: TrainingEngine | None = _delegate("engines", "critic", "The value model (None: not used).")
    sync: WeightSync = _delegate("engines", "sync", "Sends the actor's weights to the rollout engine.")
    executor: Executor = _delegate("engines", "executor", "Where the engines run.")
    # the counters and the run's records, shared with the components
    step: int = _delegate("progress", "step", "Steps completed.")
    weight_version: int = _delegate("progress", "weight_version", "Weight syncs done (the rollout samples from it).")
    history: list[dict[str, Any]] = _delegate("ctx", "history", "The metrics of every step.", settable=False)
    run_dir: RunDir | None = _delegate("ctx", "run_dir", "The claim on the output folder.", settable=False)
    sinks: MetricSinks | None = _delegate("ctx", "sinks", "The open metric sinks (None: closed).", settable=False)

    def __init__(
        self, config: RunConfig, *, memory_probe: MemoryProbe | None = None, stream: IO[str] | None = None,
        base_dir: str | os.PathLike[str] | None = None, peak_probe: PeakProbe | None = None,
    ) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self._probe = memory_probe
        self._peak_probe = peak_probe
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.task = get_task(config.task.name, config.task.digits)
        setup = AlgorithmSetup.from_config(config)
        self.algorithm = setup.algorithm
        self.use_critic = setup.use_critic
        self.use_reference = setup.use_reference
        self.dynamic_sampling = setup.dynamic_sampling
        self.on_policy_old_log_probs = setup.on_policy_old_log_probs
        self.progress = RunProgress()
        self.ctx = RunContext(config, runner="rl", stream=stream, base_dir=self.base_dir)
        self.source = PromptSource(config, self.task, base_dir=self.base_dir, say=self.ctx.say, warn=self.ctx.warn)
        self.engines = RLEngines()
        self.schedulers: dict[str, DynamicBatchScheduler] = {}
        self.plan = SchedulerPlanLog(self.out, self.schedulers)
        self._stage_threads = StageThreads()  # every step's pipeline runs on these (per-thread caches)
        # the producer's samples pipelines (async) run on threads of their own, one set per step sampled
        # at once: a StageThreads runs one pipeline at a time, and the trainer's forwards (other
        # engines) must not wait for a rollout
        self._producer_threads = [StageThreads(name_prefix=f"verl-producer{k}") for k in range(producer_slots(config))]
        self._failed: StepFailedError | None = None
        self._built = False
        self.memory_plan: MemoryPlan | None = None  # made at setup, before any engine is built
        self.buffer: HybridReplayBuffer
        self.generation: GenerationStage
        self._producer_generation: list[GenerationStage]  # the same stages on each producer slot's threads
        self.updater: UpdateStage
        self.weights: WeightSyncStage
        self.evaluator: Evaluator
        self.producer: RolloutProducer | None = None  # async_training.mode = "async": made at the first step

    # ------------------------------------------------------------------ setup
    def _response_limit(self) -> int:
        """Longest response the training engines see: one turn, or a whole episode with ``[agent]``."""
        agent = self.config.agent
        return agent.max_total_tokens if agent.enabled else self.config.rollout.max_new_tokens

    def model_path(self) -> str:
        """The policy model folder (built as a tiny random model when ``model.path`` is empty)."""
        longest = self.source.prompt_limit() + self._response_limit()
        return self.ctx.model_path(max_position=max(64, longest + 8))

    def backend_roles(self) -> dict[str, str]:
        """Role -> backend of every engine the run builds: the actor and rollout, the reference and
        critic when the algorithm uses them (no reference engine with ``model.lora``: it is the
        actor's base), and the reward when ``backends.reward`` is a backend rather than ``rule``."""
        b = self.config.backends
        roles = {"actor": b.actor, "rollout": b.rollout}
        if self.use_reference and not self.config.model.lora.enabled:
            roles["reference"] = b.reference
        if self.use_critic:
            roles["critic"] = b.critic
        if b.reward != "rule":
            roles["reward"] = b.reward
        return roles

    def _say_backends(self) -> None:
        """One line naming the backend of each role of :meth:`backend_roles` (the reward's when it
        is not ``rule``) when the roles do not all use one backend.

        A role left unset runs on ``hf`` (the default of every ``backends.*`` key), which a run
        whose other roles name another backend would not show otherwise. The line is printed
        whatever ``logging.progress`` says (:meth:`~verl_core.trainer.run.context.RunContext.warn`:
        above the progress bar, or with the bar off a WARNING of the ``verl_core.trainer.rl.trainer``
        logger, which Python prints on stderr when logging is not configured).
        """
        roles = self.backend_roles()
        if len(set(roles.values())) < 2:
            return
        self.ctx.warn("backends: " + ", ".join(f"{role} {name}" for role, name in roles.items()))

    def _spec(self, role: str, path: str, optim: Any = None) -> EngineSpec:
        config = self.memory_plan.apply(self.config) if self.memory_plan is not None else self.config
        prompt, response = self.source.prompt_limit(), self._response_limit()
        if role == "rollout" and self.config.agent.enabled:
            # each turn is sampled after the episode so far: the prompt and up to max_total_tokens
            prompt, response = prompt + response, self.config.rollout.max_new_tokens
        return engine_spec(
            config, role, path, optim=optim,  # type: ignore[arg-type]
            max_prompt_len=prompt, max_response_len=response,
        )

    def setup(self, *, resume: bool | None = None) -> None:
        """Check the datasets and reward functions, claim the output folder, then build the model
        (if tiny) and every engine.

        Args:
            resume: True to continue the run the output folder holds (its ``verl_run.json`` must
                be there), False to start a fresh run (the folder must be new or empty, unless
                ``overwrite``), None to open the run the folder holds or else start one.
                :meth:`train` passes its own ``resume``.

        Raises:
            ConfigError: a dataset, column, reward function or callback is refused (see
                :mod:`verl_core.trainer.inputs.data`, :mod:`verl_core.trainer.inputs.rewards`), before anything
                is written; the output folder may not be used so (see
                :mod:`verl_core.trainer.run.folder`), before any engine is built.
        """
        if self._built:
            return
        cfg = self.config
        if not self.source.checked:  # a trainer set up again after close() has its data already
            self.source.load()
            self.source.checked = True
        # a backend that is missing or declares less than the config asks fails before the folder is claimed
        check_backends(cfg, self.backend_roles())
        check_model_folders(cfg, use_critic=self.use_critic)  # so does a critic_model or reward_model that is no folder
        run = self.ctx.prepare(resume)
        try:
            self._build(run)
        except BaseException:
            # the engines built before the failure are released (their processes and device memory),
            # and a run that never started gives its folder back (the corrected run may use it)
            engines, self.engines = self.engines, RLEngines()
            try:
                engines.close()
            except Exception as e:  # the failure being raised is the one to report
                log.warning("closing the engines of a setup that failed raised %s: %s", type(e).__name__, e)
            self.ctx.abandon()
            raise
        self._built = True

    def _build(self, run: RunDir) -> None:
        """The rest of :meth:`setup` once the output folder is claimed: the model, the memory plan,
        every engine and the stages."""
        cfg = self.config
        path = self.model_path()
        # what the engines will hold on the device: printed, and refused before any model loads when it cannot fit
        self.memory_plan = plan_run_memory(cfg, path, max_prompt_len=self.source.prompt_limit(),
                                           use_reference=self.use_reference, use_critic=self.use_critic,
                                           say=self.ctx.say)
        b = cfg.backends
        self._say_backends()
        # engines are placed by the executor (this process, or Ray worker groups) and called alike
        ex = make_executor(cfg.executor, cfg.ray, device=cfg.model.device,
                           rollout_during_update=cfg.async_training.lookahead > 0)
        e = self.engines
        e.build(cfg, ex, self._spec, path, use_reference=self.use_reference, use_critic=self.use_critic)
        tokenizer = e.rollout.tokenizer
        self.source.bind(tokenizer)
        e.build_reward(cfg, self._spec("reward", cfg.reward_model or path), self.task, columns=self.source.columns,
                       base_dir=self.base_dir, say=self.ctx.warn)  # shown whatever logging.progress says
        e.sync = ex.weight_sync(b.actor, b.rollout)
        log.info("weight sync from the actor (%s) to the rollout (%s): %s", b.actor, b.rollout,
                 "the weight stream (StreamWeightSync)" if isinstance(e.sync, StreamWeightSync)
                 else type(e.sync).__name__)
        bc = cfg.batch
        # free memory is read once per run (the budget refined once by the first update) and
        # checkpoints carry the budget, so a resumed run splits its steps (and sums their
        # gradients) exactly like an uninterrupted one
        self.schedulers.update(make_schedulers(
            self.memory_plan.apply(cfg) if self.memory_plan is not None else cfg,  # the engines' options
            ("actor", "reference", "critic"), model_path=path,
            training=("actor", "critic") if self.use_critic else ("actor",),
            gradient_checkpointing=e.actor.spec.gradient_checkpointing, probe=self._probe, peak_probe=self._peak_probe,
        ))
        self.buffer = HybridReplayBuffer(memory_bytes=bc.buffer_memory_bytes or None, spill_dir=run.spill_root)
        p = self.progress
        episodes = (EpisodeRollout(self.source.agent, e, max_restarts=cfg.async_training.max_restarts)
                    if self.source.agent is not None else None)

        def generation(threads: StageThreads) -> GenerationStage:
            return GenerationStage(
                e, self.schedulers, p, threads, baseline="greedy_baseline" in self.algorithm.needs,
                dynamic_sampling=self.dynamic_sampling, dense_only=cfg.task.reward == "token",
                actor_forward=not self.on_policy_old_log_probs, episodes=episodes,
            )

        self.generation = generation(self._stage_threads)
        self._producer_generation = [generation(t) for t in self._producer_threads]  # the samples half
        self.updater = UpdateStage(cfg, e, self.algorithm, self.schedulers, self.buffer, p,
                                   dynamic_sampling=self.dynamic_sampling,
                                   on_policy_old_log_probs=self.on_policy_old_log_probs)
        self.weights = WeightSyncStage(e, p, SleepPolicy.for_run(cfg))
        partial = cfg.async_training.partial_rollouts
        if partial != "finish" and not e.rollout.capabilities.concurrent_weight_update:
            raise ConfigError(
                f"async_training.partial_rollouts={partial!r} sends new weights while the producer's rollout is under "
                f"way, but the rollout backend {cfg.backends.rollout!r} does not declare "
                "RolloutCapabilities.concurrent_weight_update (a weight update that waits for the generate call in "
                "flight); use partial_rollouts='finish' or a rollout backend that declares it (hf, vllm)")
        if cfg.model.lora.enabled and (cfg.model.lora.init_path or cfg.model.lora.sync == "adapter"):
            # the actor starts from the adapter folder, not from B = 0, while a rollout given merged
            # weights was built on the base folder alone: send the actor's weights before the first
            # rollout; an adapter sync's first sync also lets a colocated rollout take the actor's
            # frozen base instead of its own copy (hf), before any generate call holds it
            self.weights.resync()
        self.evaluator = Evaluator(cfg, e, self.source, p, episodes=episodes)

    # ------------------------------------------------------------------ one step
    def sampling_params(self) -> SamplingParams:
        """Sampling parameters of a step (the seed makes every sample reproducible)."""
        return self.source.sampling_params(self.step)

    def prompts(self, step: int) -> TensorBatch:
        """The prompt batch of ``step`` (group ids unique for the run).

        With ``data.train``: the next rows of the data order, every other column as a per-sample
        extra (each call advances the order; checkpoints save its position). Otherwise the built-in
        task's prompts, a deterministic function of seed and step, with their answers.
        """
        return self.source.batch(step, self.rollout.tokenizer, weight_version=self.weight_version)

    def train_step(self) -> dict[str, Any]:
        """Run one step and return its metrics (also appended to :attr:`history`).

        Raises:
            StepFailedError: a stage raised; it names the stage and its backend. Nothing of the step
                is saved and this trainer refuses further steps: resume from the last checkpoint
                with a new Trainer (``verl train CONFIG --resume``).
            TrainingDivergedError: ``max_consecutive_skips`` optimizer steps in a row were skipped
                for a non-finite loss or gradient; a checkpoint was written first.
        """
        self.setup()
        if self._failed is not None:
            raise ConfigError(
                f"this Trainer cannot run more steps after a failed one ({self._failed}); close it and "
                "resume from the last checkpoint with a new Trainer"
            )
        self.progress.stage = "prompts"
        try:
            metrics = self._train_step()
        except Exception as e:
            stage, cause = (e.stage, e.__cause__ or e) if isinstance(e, StageError) else (self.progress.stage, e)
            self._failed = StepFailedError(
                stage, stage_backend(self.config, stage), self.step + 1, cause, latest_checkpoint(self.out)
            )
            raise self._failed from cause
        self.ctx.check_diverged(self.step, self.progress.consecutive_skips, self.save_checkpoint,
                                check="the reward and the data")
        return metrics

    def _train_step(self) -> dict[str, Any]:
        started = time.perf_counter()
        asynchronous = self.config.async_training.mode == "async"
        if asynchronous:  # the samples come from the producer thread; the forwards use the weights training now
            state = self._produced_state()
            self.generation.run(state, "forwards")
        else:
            state = StepState(self.step, self.prompts(self.step), self.sampling_params())
            self.generation.run(state)  # rollout -> reward -> select -> reference / actor / critic forwards
        if self.config.async_training.lookahead == 0:
            self.weights.sleep(state)  # the update needs the rollout's device memory
            if state.metrics["rollout/slept"] and (self._probe is not None
                                                   or torch.device(self.config.model.device).type == "cuda"):
                self._reread_budgets(state)  # the probe sees what the sleep freed
        else:
            state.metrics["rollout/slept"] = 0  # the producer samples the next steps during the update
        rollout_metrics(state, eos_token_id=self.rollout.tokenizer.eos_token_id, reward=self.reward,
                        loader=self.source.loader)
        state.metrics.update(self.source.stats())  # data/rows, data/dropped_long_prompts, ...
        if state.batch.batch_size == 0:  # dynamic sampling kept no group: nothing to learn from
            state.metrics["update/skipped"] = 1
        else:
            with state.timed("advantages"):
                self.updater.advantages(state)
            with state.timed("update"):
                self.updater.run(state)
        if self.producer is not None and (self.config.async_training.partial_rollouts == "finish"
                                          or self.evaluator.due_after(self.step)):
            # "finish": no rollout in flight while weights arrive (nor while evaluation samples); with
            # "continue" and "restart" the rollout's own lock orders the sync after the generate call in flight
            self.producer.wait_idle()
        if state.batch.batch_size:
            self.weights.sync(state)  # the next step samples from the new policy
        else:
            self.weights.restore(state)  # the same policy, in a rollout that may have dropped its weights
        finish_metrics(state, started, self.schedulers, weight_version=self.weight_version)
        state.metrics.update(self.executor.metrics())  # the Ray executor's ray/rollout_restarts
        if self.memory_plan is not None:
            state.metrics.update(self.memory_plan.metrics())
        self.evaluator.on_step(state)
        self.step += 1
        self.ctx.log_step(self.step, state.metrics)
        self.plan.append()
        return state.metrics

    def _reread_budgets(self, state: StepState) -> None:
        """Before the run's first update, with the rollout asleep: read the free memory again for
        the training roles' micro-batch budgets (fixed at setup, while the rollout's weights were
        still on the device; a no-op once a role trained, or where its budget came from a checkpoint
        or ``batch.micro_batch_tokens``). Sets ``scheduler/<role>/budget_reread`` where it changed."""
        for role, scheduler in self.schedulers.items():
            if role in ("actor", "critic"):
                before = scheduler.fixed_budget
                after = scheduler.reread_budget()
                if after == before:
                    continue
                log.info("micro-batch budget of the %s: %s -> %d tokens, read again with the rollout asleep "
                         "(%s bytes available)", role, before, after, f"{scheduler.available_bytes:,}")
                state.metrics[f"scheduler/{role}/budget_reread"] = after

    def _draw(self, step: int) -> StepState:
        """Step ``step``'s prompts (drawn by the producer in step order in ``async`` mode)."""
        state = StepState(step, self.source.batch(step, self.rollout.tokenizer, weight_version=self.weight_version),
                          self.source.sampling_params(step))
        if self.source.loader is not None:  # read when this step's rows are drawn, not when it trains
            state.metrics["data/epoch"] = self.source.loader.epoch
        return state

    def _sample(self, state: StepState, slot: int) -> None:
        """The samples of a drawn step, on producer slot ``slot``'s stage threads."""
        self._producer_generation[slot].run(state, "samples")

    def _produced_state(self) -> StepState:
        """Release the steps the staleness bound allows and take this step's samples from the producer."""
        cfg = self.config
        if self.producer is None:
            loader = self.source.loader
            self.producer = RolloutProducer(self._draw, self._sample, first=self.step, parallel=producer_slots(cfg),
                                            snapshot=lambda: loader.state_dict() if loader is not None else None)
        self.producer.release(release_limit(self.step, max_staleness=cfg.async_training.max_staleness,
                                            checkpoint_every=cfg.checkpoint.every, steps=cfg.steps))
        state, waited = self.producer.take(self.step)
        # the oldest version that sampled the step (its prompts' draw version under "finish")
        state.metrics["async/staleness"] = self.weight_version - state.samples.meta.weight_version
        state.metrics["async/wait_s"] = waited
        state.metrics["async/ahead"] = self.producer.ahead
        return state

    def evaluate(self) -> dict[str, float]:
        """Evaluate on every row of ``data.eval`` and/or the task's fixed prompts; keys start with ``eval/``.

        ``data.eval``: ``data.eval_n`` responses per prompt (one greedy response by default), scored
        by the run's reward: ``eval/reward/mean``, ``eval/reward/<function>/mean`` of each reward
        function and ``eval/response/length_mean``, averaged over every response. The task's
        ``task.eval_prompts`` (when the task supplies the training prompts): ``eval/reward_mean``
        and ``eval/exact_match`` of greedy responses.
        """
        self.setup()
        return self.evaluator.evaluate()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write an atomic checkpoint of every trainable engine and the trainer state; returns its folder."""
        self.setup()
        state: dict[str, Any] = {
            "weight_version": self.weight_version,
            "schedulers": {r: s.state_dict() for r, s in self.schedulers.items()},
            "algorithm": self.algorithm.state_dict(),
        }
        loader = self.source.loader
        if loader is not None:  # a resumed run continues the data order exactly
            ahead = self.producer.data_state(self.step) if self.producer is not None else None
            state["data"] = ahead if ahead is not None else loader.state_dict()  # not the steps drawn ahead
        final = self.ctx.checkpoints.save(self.step, self.engines.trainable(), state,
                                          consecutive_skips=self.progress.consecutive_skips)
        return self.ctx.saved(self.step, final)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` and sync the rollout engine.

        Nothing is restored unless the folder matches its manifest, ``trainer_state.json`` passes
        its field checks and the saved config differs from the current one only in keys of
        :data:`~verl_core.trainer.run.checkpoints.RESUME_SAFE_KEYS` (those changes are logged). A run
        on ``data.train`` continues the data order from the saved position. The metric logs are
        cut back to the checkpoint's step when the sinks open (:class:`MetricSinks`).

        Raises:
            CheckpointError: the manifest, a file, or a field of ``trainer_state.json`` (named).
            ConfigError: config keys that change the math differ from the checkpoint's (all listed),
                or the dataset now has another number of rows than when the checkpoint was written.
        """
        self.setup()
        loader = self.source.loader
        restored = self.ctx.checkpoints.load(
            Path(path), self.engines.trainable(), self.schedulers, algorithm_state=self.algorithm.state_dict(),
            sampler=loader.sampler if loader is not None else None,
        )
        self.step = restored.step
        self.weight_version = int(restored.state["weight_version"])
        self.algorithm.load_state_dict(restored.state["algorithm"])
        self.progress.consecutive_skips = restored.consecutive_skips
        self.ctx.resumed(self.step)
        self.ctx.checkpoints.restore_rng()
        self.weights.resync()
        self.plan.restore(self.step)  # the metrics are cut by the sinks

    # ------------------------------------------------------------------ the loop
    def train(self, *, resume: bool = False) -> list[dict[str, Any]]:
        """Run until ``config.steps``; with ``resume`` continue from the newest checkpoint.

        Returns the metrics of every step (including those before a resume).

        Raises:
            ConfigError: a fresh run in a folder holding a run or other files (without
                ``overwrite``), ``resume`` without the run's marker, or an output folder another
                process is running in; see :mod:`verl_core.trainer.run.folder`.
        """
        self.setup(resume=resume)
        ckpt = self.ctx.begin(resume)
        if ckpt is not None:
            self.load_checkpoint(ckpt)
            self.ctx.say(f"resumed from {ckpt} at step {self.step}")
        else:
            self.plan.reset()  # metrics.jsonl: the sinks start it afresh
        self.ctx.write_config()
        self.ctx.run_steps(self.train_step, self.save_checkpoint, current=lambda: self.step,
                           final=self.config.checkpoint.final)
        if self.config.logging.plot:
            self.ctx.say(plot_metrics(self.history, self.out / "curves.png"))
        return self.history

    def close(self) -> None:
        """Close the metric sinks; release every engine, the stage threads, the buffer's spill files and
        the claim on the output folder."""
        try:
            self.ctx.close_sinks(failed=self._failed is not None, step=self.step)
        finally:
            if self.producer is not None:
                self.producer.close()  # a rollout under way ends first
                self.producer = None
            self._stage_threads.close()  # a stage still running (a step abandoned by a signal) ends first
            for threads in self._producer_threads:
                threads.close()
            if self._built:
                self.engines.close()
                self.buffer.close()
                self._built = False
            self.ctx.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

