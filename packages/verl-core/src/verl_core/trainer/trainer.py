"""The single-controller RL trainer: rollout -> reward/reference/critic -> advantages -> updates -> sync.

One step:

1. take ``prompts_per_step`` prompts: the next rows of the user's dataset (``data.train``, in a
   seeded order that checkpoints keep), or the built-in task's (a deterministic function of seed
   and step);
2. ``RolloutEngine.generate`` ``n`` responses per prompt (and, for ReMax, a greedy baseline);
3. concurrently, through :class:`~verl_core.trainer.pipeline.HybridPipeline`: reward scores,
   reference log-probs, the actor's ``old_log_probs`` and entropy, the critic's values;
4. (optional) DAPO dynamic sampling drops groups whose scores are all equal;
5. advantages on the global batch (:class:`verl_core.algorithms.Algorithm`);
6. mini-batches from the replay buffer; per mini-batch ``forward_backward`` over micro-batches
   picked by the :class:`~verl_core.trainer.scheduler.DynamicBatchScheduler`, then
   ``optimizer_step`` (actor, and critic when the algorithm has one);
7. weight sync actor -> rollout.

Engines are built by backend name through :mod:`verl_core.kernel.registry`, placed by the executor of the
config key ``executor`` (:mod:`verl_core.trainer.executor`: this process, or Ray worker groups); nothing
here knows which backend it talks to or where it runs. The reward is the user's reward functions
(``reward.functions``, :mod:`verl_core.trainer.rewards`), a reward-model backend, or the task's rule.
Every step's metrics go to the sinks of ``logging.sinks`` (:mod:`verl_core.trainer.sinks`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from verl_core.enginekit.hf_tokenizer import HFTokenizer
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.engine import EngineSpec
from verl_core.kernel.errors import CheckpointError, ConfigError, VerlError, describe
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine, SamplingParams
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.kernel.training import GlobalBatchStats, LossFn, TrainingEngine
from verl_core.kernel.weights import WeightSync
from verl_core.trainer.config import RunConfig, check_device_here, config_to_dict
from verl_core.trainer.data import PromptDataset, PromptLoader, PromptSampler
from verl_core.trainer.executor import Executor, make_executor
from verl_core.trainer.pipeline import HybridPipeline, Stage, StageError, StageThreads
from verl_core.trainer.reliability import (
    StepFailedError,
    TrainingDivergedError,
    resume_config_changes,
    verify_checkpoint,
)
from verl_core.trainer.replay import HybridReplayBuffer, remove_stale_spill
from verl_core.trainer.rewards import RewardFunctions
from verl_core.trainer.rundir import Mode, RunDir
from verl_core.trainer.runstate import (
    STATE_FILE,
    build_run_model,
    engine_spec,
    latest_checkpoint,
    load_engine_checkpoint,
    read_state,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from verl_core.trainer.scheduler import (
    Decision,
    DynamicBatchScheduler,
    MemoryProbe,
    SchedulerConfig,
)
from verl_core.trainer.sinks import MetricSinks, ProgressBar, read_json_lines, write_text_atomic
from verl_core.trainer.tasks import DigitTask, TaskReward, get_task, prompt_batch
from verl_core.trainer.usercode import import_object, resolve_path

__all__ = ["Trainer", "build_algorithm", "latest_checkpoint"]

_log = logging.getLogger(__name__)
_NOT_COMPARABLE = "not comparable"
_EVAL_GROUP_BASE = 1 << 48


def build_algorithm(name: str, options: Mapping[str, Any]) -> Any:
    """The :class:`verl_core.algorithms.Algorithm` preset ``name`` with ``options``.

    ``dapo`` is GRPO with clip-higher (``clip_high=0.28``) and no KL loss; the trainer turns on
    dynamic sampling for it. ``grpo_token`` is GRPO's loss with the per-position estimator of
    :mod:`verl_core.trainer.estimators` (it needs dense ``token_scores``: ``task.reward="token"``).

    Raises:
        ConfigError: an option the preset does not take (naming ``algorithm.options.<key>``).
    """
    import inspect

    from verl_core.algorithms import PRESETS, Algorithm

    opts = dict(options)
    preset = name
    if name == "grpo_token":
        from verl_core.trainer.estimators import register

        register()
        preset = "grpo"
    if name == "dapo":
        preset = "grpo"
        opts = {"clip_high": 0.28, "kl_loss_coef": 0.0, **opts}
    if preset not in PRESETS:
        raise ConfigError(
            f"config key 'algorithm.name': unknown algorithm {name!r}; choices: "
            f"{', '.join((*PRESETS, 'dapo', 'grpo_token'))}"
        )
    factory = getattr(Algorithm, preset)
    params = [p for p in inspect.signature(factory).parameters if p not in ("cls", "self", "kwargs")]
    if preset == "reinforce_pp_baseline":
        params = [p for p in inspect.signature(Algorithm.reinforce_pp).parameters if p != "baseline"]
    unknown = sorted(set(opts) - set(params))
    if unknown:
        raise ConfigError(
            f"config key 'algorithm.options.{unknown[0]}' is not an option of algorithm {name!r}; "
            f"valid options: {', '.join(params)}"
        )
    try:
        algo = factory(**opts)
        if name == "grpo_token":
            algo = algo.replace(name="grpo_token", estimator="grpo_token")
        return algo
    except VerlError as e:
        raise ConfigError(f"config section 'algorithm.options' of {name!r}: {e}") from e
    except TypeError as e:
        raise ConfigError(f"config section 'algorithm.options' of {name!r}: {e}") from e


def _read_data_state(ckpt: Path, state: Mapping[str, Any], loader: PromptLoader | None) -> dict[str, Any] | None:
    """The data-order position of ``trainer_state.json`` (``data``), checked against the run's loader.

    A run reading ``data.train`` saves the position of its :class:`PromptSampler`; a run on the
    built-in task saves none. Nothing is changed here: the caller restores it once every check passed.

    Raises:
        CheckpointError: the field is missing (or present for a run without data) or malformed.
        ConfigError: the position was saved for another number of rows, seed or shuffle setting
            (the dataset changed since the checkpoint).
    """
    saved = state.get("data", ...)
    if loader is None and saved is ...:
        return None
    if loader is None or saved is ... or not isinstance(saved, dict):
        expected = "absent (this run takes its prompts from the built-in task)" if loader is None else (
            "the data order's position (epoch, index, size, seed, shuffle)"
        )
        got = "it is missing" if saved is ... else f"got {describe(saved)}"
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {STATE_FILE} field 'data' must be {expected}, {got}; the file is "
            "damaged or was not written by Trainer.save_checkpoint: resume from another checkpoint or start a new run"
        )
    for key, kind in (("epoch", int), ("index", int), ("size", int), ("seed", int), ("shuffle", bool)):
        v = saved.get(key, ...)
        if not isinstance(v, kind) or (kind is int and (isinstance(v, bool) or v < 0)):
            got = "it is missing" if v is ... else f"got {describe(v)}"
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r}: {STATE_FILE} field 'data.{key}' must be "
                f"{'true or false' if kind is bool else 'an integer >= 0'}, {got}; the file is damaged or was "
                "not written by Trainer.save_checkpoint: resume from another checkpoint or start a new run"
            )
    sampler = loader.sampler
    PromptSampler(sampler.size, seed=sampler.seed, shuffle=sampler.shuffle).load_state_dict(saved)  # a dry run
    return saved


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float((values * mask).sum() / n) if n else 0.0


class Trainer:
    """Runs an RL training loop from a :class:`RunConfig`.

    Args:
        config: The run.
        memory_probe: Memory probe of the micro-batch scheduler (default: the device's real memory).
        stream: Where the progress bar and its messages go (default stderr).
        base_dir: The config file's folder: relative paths of datasets, reward-function files and
            callback files are looked up there first, then in the working directory (default:
            the working directory only).

    Use :meth:`train` (optionally resuming from the newest checkpoint of the output dir); engines
    are built on first use and released by :meth:`close`. The output dir is claimed for one run
    before anything is written there (:class:`~verl_core.trainer.rundir.RunDir`): a fresh run
    needs a new or empty folder, a resumed one the run's marker, and the trainer deletes only
    files of its own run.
    """

    def __init__(
        self, config: RunConfig, *, memory_probe: MemoryProbe | None = None, stream: IO[str] | None = None,
        base_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self._probe = memory_probe
        self._stream = stream if stream is not None else sys.stderr
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.task: DigitTask = get_task(config.task.name, config.task.digits)
        self.algorithm = build_algorithm(config.algorithm.name, config.algorithm.options)
        self.use_critic = (
            config.algorithm.use_critic if config.algorithm.use_critic is not None else self.algorithm.uses_critic
        )
        if self.use_critic and not self.algorithm.uses_critic:
            raise ConfigError(
                f"config key 'algorithm.use_critic' is true but algorithm {config.algorithm.name!r} has no "
                "critic loss; use algorithm.name='ppo' or set use_critic=false"
            )
        if not self.use_critic and self.algorithm.estimator == "gae":
            raise ConfigError("config key 'algorithm.use_critic' is false, but the gae estimator needs a critic")
        if self.algorithm.estimator == "grpo_token" and config.reward.functions:
            raise ConfigError(
                "algorithm 'grpo_token' needs dense token scores, but the reward functions of 'reward.functions' "
                "give one score per response; use algorithm 'grpo'"
            )
        if self.algorithm.estimator == "grpo_token" and config.task.reward != "token" and config.backends.reward == "rule":
            raise ConfigError(
                "algorithm 'grpo_token' needs dense token scores: set config key 'task.reward' to 'token' "
                f"(it is {config.task.reward!r})"
            )
        data = config.data
        if (data.train_paths or data.eval_paths) and not config.reward.functions and config.backends.reward == "rule":
            raise ConfigError(
                f"config key 'data.{'train' if data.train_paths else 'eval'}' is set but the run has no reward "
                "for its prompts: list functions in 'reward.functions' (e.g. "
                "['verl_core.trainer.reward_functions:exact_match']) or name a reward-model backend in "
                "'backends.reward'"
            )
        self.use_reference = config.algorithm.use_reference or self.algorithm.uses_reference
        self.dynamic_sampling = config.algorithm.dynamic_sampling or config.algorithm.name == "dapo"
        self.step = 0
        self.weight_version = 0
        self.history: list[dict[str, Any]] = []
        self._built = False
        self.actor: TrainingEngine
        self.rollout: RolloutEngine
        self.reward: RewardEngine
        self.reference: TrainingEngine | None = None
        self.critic: TrainingEngine | None = None
        self.sync: WeightSync
        self.executor: Executor
        self.schedulers: dict[str, DynamicBatchScheduler] = {}
        self._plan_written: dict[str, int] = {}
        self._stage = "prompts"  # the stage running outside the pipeline, named when it fails
        self._stage_threads = StageThreads()  # every step's pipeline runs on these (per-thread caches)
        self._failed: StepFailedError | None = None
        self._consecutive_skips = 0
        self._on_disk_step = -1  # the step whose checkpoint this trainer wrote or loaded last
        self.run_dir: RunDir | None = None
        self.sinks: MetricSinks | None = None
        self._logs_from: int | None = None  # the step the metric logs continue from (None: start afresh)
        self._bar: ProgressBar | None = None
        self._train_data: PromptDataset | None = None
        self._eval_data: PromptDataset | None = None
        self._loader: PromptLoader | None = None
        self._longest_prompt: int | None = None  # measured by setup() when a dataset is used
        self._columns: list[str] = ["answer"]  # per-sample extras the reward functions may ask for
        self._data_checked = False

    # ------------------------------------------------------------------ setup
    def model_path(self) -> str:
        """The policy model folder (built as a tiny random model when ``model.path`` is empty)."""
        m = self.config.model
        if m.path:
            return m.path
        run = self._claim(None)  # the model is built inside the run's folder
        longest = self._prompt_limit() + self.config.rollout.max_new_tokens
        return build_run_model(self.config, run, max_position=max(64, longest + 8))

    def _spec(self, role: str, path: str, optim: Any = None) -> EngineSpec:
        return engine_spec(
            self.config, role, path, optim=optim,  # type: ignore[arg-type]
            max_prompt_len=self._prompt_limit(), max_response_len=self.config.rollout.max_new_tokens,
        )

    def _prompt_limit(self) -> int:
        """Longest prompt, in tokens, that the engines are built for.

        The longest kept prompt of the datasets once :meth:`setup` measured them (and the task's
        when the task supplies the training prompts); before that ``data.max_prompt_len`` or the
        task's (e.g. for the spec of an export, which runs no prompt).
        """
        if self._longest_prompt is not None:
            return self._longest_prompt
        d = self.config.data
        return d.max_prompt_len if d.train_paths and d.max_prompt_len else self.task.max_prompt_len()

    def _model_tokenizer(self) -> Tokenizer:
        """The policy model's tokenizer, read without building an engine (every backend loads this one)."""
        m = self.config.model
        if importlib.util.find_spec("transformers") is None:
            raise ConfigError(
                "reading data.train / data.eval and checking reward.functions needs the model's tokenizer, "
                "which needs transformers: pip install verl-hf (or transformers)"
            )
        if not m.path:
            from verl_core.trainer.tiny_model import char_tokenizer

            return HFTokenizer(char_tokenizer(m.vocab_size), m.vocab_size)
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(m.path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"config key 'model.path' = {m.path!r}: cannot load its tokenizer with transformers "
                f"({type(e).__name__}: {e}); expected a transformers folder with a tokenizer"
            ) from e
        return HFTokenizer(tok)

    def _load_data(self) -> None:
        """Read and check ``data.train`` / ``data.eval``, the reward functions and callback imports.

        Runs before the output folder is claimed and before the model or any engine is built, so a
        bad dataset, column, reward function or callback is refused with nothing written. Prompts
        are measured with the model folder's tokenizer; the engines are built for the longest one.
        """
        cfg = self.config
        d = cfg.data
        for spec in cfg.logging.sink_config().callbacks:  # imported (modules are cached) but not built yet
            import_object(spec, what="config key 'logging.sinks': callback", base_dir=self.base_dir)
        if not (d.train_paths or d.eval_paths or cfg.reward.functions):
            return
        tok = self._model_tokenizer()

        def load(split: str, paths: list[str]) -> PromptDataset | None:
            if not paths:
                return None
            return PromptDataset.load(
                [str(resolve_path(p, self.base_dir)) for p in paths], tok, prompt_key=d.prompt_key,
                chat_template=d.chat_template, max_prompt_len=d.max_prompt_len, long_prompts=d.long_prompts,
                where=f"data.{split}",
            )

        train, evals = load("train", d.train_paths), load("eval", d.eval_paths)
        columns = train.column_names if train is not None else ["answer"]  # the task's prompts carry answers
        if evals is not None:
            columns = [c for c in columns if c in evals.column_names]
        if cfg.reward.functions:
            RewardFunctions.from_config(cfg.reward, tok, columns=columns, base_dir=self.base_dir)  # refused here
        lengths = [ds.longest_prompt for ds in (train, evals) if ds is not None]
        if train is None:
            lengths.append(self.task.max_prompt_len())
        self._train_data, self._eval_data, self._columns = train, evals, columns
        self._longest_prompt = max(lengths)
        for split, ds in (("train", train), ("eval", evals)):
            if ds is not None:
                left_out = f"; {ds.dropped} longer than data.max_prompt_len left out" if ds.dropped else ""
                self._say(
                    f"data.{split}: {len(ds)} prompts from {', '.join(ds.sources)} (longest {ds.longest_prompt} "
                    f"tokens{left_out})"
                )

    def _bind_data(self, tokenizer: Tokenizer) -> None:
        """Give the datasets the rollout engine's tokenizer, checking that every prompt still fits the engines."""
        for split in ("train", "eval"):
            ds: PromptDataset | None = getattr(self, f"_{split}_data")
            if ds is None:
                continue
            ds = PromptDataset(ds.prompts, ds.columns, tokenizer, dropped=ds.dropped, sources=ds.sources)
            if ds.longest_prompt > self._prompt_limit():
                raise ConfigError(
                    f"data.{split}: the rollout engine's tokenizer (backend {self.config.backends.rollout!r}) encodes "
                    f"a prompt to {ds.longest_prompt} tokens, but the model folder's tokenizer, which the engines "
                    f"were sized with, to at most {self._prompt_limit()}; use a backend that tokenizes with the "
                    "model folder's tokenizer"
                )
            setattr(self, f"_{split}_data", ds)
        if self._train_data is None:
            return
        if self._loader is None:
            self._loader = PromptLoader(self._train_data, seed=self.config.seed, shuffle=self.config.data.shuffle)
        else:  # set up again after close(): the data order goes on from where it was
            self._loader.dataset = self._train_data


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
                :mod:`verl_core.trainer.data`, :mod:`verl_core.trainer.rewards`), before anything
                is written; the output folder may not be used so (see
                :mod:`verl_core.trainer.rundir`), before any engine is built.
        """
        if self._built:
            return
        cfg = self.config
        if not self._data_checked:  # a trainer set up again after close() has its data already
            self._load_data()
            self._data_checked = True
        check_device_here(self.config)  # before the run folder is claimed or any engine is built
        run = self._claim(resume)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        path = self.model_path()
        b = cfg.backends
        # engines are placed by the executor (this process, or Ray worker groups) and called alike
        ex = self.executor = make_executor(cfg.executor, cfg.ray, device=cfg.model.device)
        self.actor = ex.training_engine("actor", b.actor, self._spec("actor", path, cfg.optim.to_optim(cfg.steps)))
        self.rollout = ex.rollout_engine(b.rollout, self._spec("rollout", path))
        if self.use_reference:
            self.reference = ex.training_engine("reference", b.reference, self._spec("reference", path))
        if self.use_critic:
            critic_path = cfg.critic_model or path
            self.critic = ex.training_engine(
                "critic", b.critic, self._spec("critic", critic_path, cfg.critic_optim.to_optim(cfg.steps))
            )
        tokenizer = self.rollout.tokenizer
        self._bind_data(tokenizer)
        model = None if b.reward == "rule" else ex.reward_engine(b.reward, self._spec("reward", path))
        if cfg.reward.functions:
            self.reward = RewardFunctions.from_config(
                cfg.reward, tokenizer, model=model, columns=self._columns, base_dir=self.base_dir
            )
        elif model is not None:
            self.reward = model
        else:
            self.reward = TaskReward(self.task, tokenizer, mode=cfg.task.reward)
        self.sync = ex.weight_sync(b.actor, b.rollout)
        bc = cfg.batch
        if bc.micro_batch_tokens:
            sched_cfg = SchedulerConfig(min_tokens=bc.micro_batch_tokens, max_tokens=bc.micro_batch_tokens)
        else:
            sched_cfg = SchedulerConfig(min_tokens=bc.min_tokens, max_tokens=bc.max_tokens)
        for role in ("actor", "reference", "critic"):
            self.schedulers[role] = DynamicBatchScheduler(sched_cfg, probe=self._probe, device=cfg.model.device)
            # free memory is read once per run and checkpoints carry the budget, so a resumed run
            # splits its steps (and sums their gradients) exactly like an uninterrupted one
            self.schedulers[role].fix_budget()
        self.buffer = HybridReplayBuffer(memory_bytes=bc.buffer_memory_bytes or None, spill_dir=run.spill_root)
        self._built = True

    def _claim(self, resume: bool | None) -> RunDir:
        """The run's claim on the output folder (made on first use; see :class:`RunDir`)."""
        run = self.run_dir
        if run is None:
            mode: Mode = "any" if resume is None else "resume" if resume else "fresh"
            run = self.run_dir = RunDir.claim(self.config.output_dir, self.config, mode=mode)
            if run.moved_aside is not None:
                self._say(f"overwrite=true: moved what {str(self.out)!r} held to {str(run.moved_aside)!r}")
            if not run.created:
                remove_stale_spill(run.spill_root)  # left by a killed process of this run (the claim locks it)
        elif not run.held:
            run.acquire()  # set up again after close()
        return run

    # ------------------------------------------------------------------ one step
    def sampling_params(self) -> SamplingParams:
        """Sampling parameters of a step (the seed makes every sample reproducible)."""
        r = self.config.rollout
        return SamplingParams(
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
            n=r.n, seed=self.config.seed * 1_000_003 + self.step,
        )

    def prompts(self, step: int) -> TensorBatch:
        """The prompt batch of ``step`` (group ids unique for the run).

        With ``data.train``: the next rows of the data order, every other column as a per-sample
        extra (each call advances the order; checkpoints save its position). Otherwise the built-in
        task's prompts, a deterministic function of seed and step, with their answers.
        """
        n = self.config.batch.prompts_per_step
        tok = self.rollout.tokenizer
        r = self.config.rollout
        meta = BatchMeta(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                         pad_token_id=tok.pad_token_id, weight_version=self.weight_version, step=step)
        if self._loader is not None:
            return self._loader.batch(step, n, meta=meta)
        examples = self.task.examples(n, seed=self.config.seed, step=step)
        return prompt_batch(
            [p for p, _ in examples], tok, group_ids=[step * n + i for i in range(n)],
            extras={"answer": [a for _, a in examples]}, meta=meta,
        )

    def _forward(self, role: str, engine: TrainingEngine, batch: TensorBatch, outputs: tuple[str, ...]) -> TensorBatch:
        def fn(mb: TensorBatch) -> TensorBatch:
            return engine.forward(mb, outputs)  # type: ignore[arg-type]

        return self.schedulers[role].run_forward(batch, fn, key=f"step{self.step}/{role}/forward")

    def _pipeline(self) -> HybridPipeline:
        params = self.sampling_params()

        def rollout(prompts: TensorBatch) -> Mapping[str, Any]:
            self.rollout.wake()
            return {"samples": self.rollout.generate(prompts, params)}

        def baseline(prompts: TensorBatch) -> Mapping[str, Any]:
            greedy = dataclasses.replace(params, n=1, greedy=True)
            scored = self.reward.score(self.rollout.generate(prompts, greedy))
            return {"baseline": scored["scores"].repeat_interleave(params.n)}

        def reward(samples: TensorBatch) -> Mapping[str, Any]:
            scored = self.reward.score(samples)
            return {"scores": scored["scores"], "token_scores": scored.get("token_scores"),
                    "reward_terms": RewardFunctions.metrics(scored)}

        dense_only = isinstance(self.reward, TaskReward) and self.config.task.reward == "token"

        def select(samples: TensorBatch, scores: torch.Tensor, token_scores: torch.Tensor | None) -> Mapping[str, Any]:
            # the task's dense scores sum to its sequence score: the algorithm gets them alone, so the
            # score is not counted twice (once spread over the tokens, once on the last token)
            batch = samples if dense_only else samples.update(scores=scores)
            if token_scores is not None:
                batch = batch.update(token_scores=token_scores)
            if not self.dynamic_sampling:
                return {"batch": batch, "dropped_groups": 0}
            keep = _groups_with_signal(samples["group_ids"], scores)
            dropped = int(torch.unique(batch["group_ids"]).numel()) - int(torch.unique(batch["group_ids"][keep]).numel())
            return {"batch": batch.index(keep.nonzero()[:, 0]), "dropped_groups": dropped}

        def reference(batch: TensorBatch) -> Mapping[str, Any]:
            if self.reference is None or batch.batch_size == 0:
                return {"ref_log_probs": None}
            return {"ref_log_probs": self._forward("reference", self.reference, batch, ("log_probs",))["log_probs"]}

        def actor(batch: TensorBatch) -> Mapping[str, Any]:
            if batch.batch_size == 0:
                return {"old_log_probs": None, "entropy": None}
            out = self._forward("actor", self.actor, batch, ("log_probs", "entropy"))
            return {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}

        def critic(batch: TensorBatch) -> Mapping[str, Any]:
            if self.critic is None or batch.batch_size == 0:
                return {"values": None}
            return {"values": self._forward("critic", self.critic, batch, ("values",))["values"]}

        stages = [
            Stage("rollout", rollout, ("prompts",), ("samples",)),
            Stage("reward", reward, ("samples",), ("scores", "token_scores", "reward_terms")),
            Stage("select", select, ("samples", "scores", "token_scores"), ("batch", "dropped_groups")),
            Stage("reference", reference, ("batch",), ("ref_log_probs",)),
            Stage("actor_forward", actor, ("batch",), ("old_log_probs", "entropy")),
            Stage("critic_forward", critic, ("batch",), ("values",)),
        ]
        if self.algorithm.estimator == "remax":
            stages.append(Stage("baseline", baseline, ("prompts",), ("baseline",), after=("rollout",)))
        return HybridPipeline(stages, inputs=("prompts",), threads=self._stage_threads)

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
        self._stage = "prompts"
        try:
            metrics = self._train_step()
        except Exception as e:
            stage, cause = (e.stage, e.__cause__ or e) if isinstance(e, StageError) else (self._stage, e)
            self._failed = StepFailedError(
                stage, self._backend_of(stage), self.step + 1, cause, latest_checkpoint(self.out)
            )
            raise self._failed from cause
        limit = self.config.max_consecutive_skips
        if limit and self._consecutive_skips >= limit:
            ckpt = self.save_checkpoint()
            raise TrainingDivergedError(
                f"step {self.step}: {self._consecutive_skips} optimizer steps in a row were skipped because "
                f"the loss or gradient was NaN/inf (max_consecutive_skips={limit}); the weights are those of "
                f"the last finite update, saved in {str(ckpt)!r}. Lower optim.lr, check the reward and the "
                "data, then resume with `verl train CONFIG --resume`"
            )
        return metrics

    def _backend_of(self, stage: str) -> str:
        b = self.config.backends
        reward = b.reward
        if self.config.reward.functions:
            reward = "reward.functions" + (f" + {b.reward}" if b.reward != "rule" else "")
        return {
            "rollout": b.rollout, "baseline": b.rollout, "reward": reward, "reference": b.reference,
            "actor_forward": b.actor, "actor_update": b.actor, "critic_forward": b.critic,
            "critic_update": b.critic, "weight_sync": f"{b.actor} -> {b.rollout}", "evaluation": b.rollout,
        }.get(stage, "trainer")

    def _train_step(self) -> dict[str, Any]:
        t_step = time.perf_counter()
        params = self.sampling_params()
        res = self._pipeline().run(prompts=self.prompts(self.step))
        t = time.perf_counter()
        self.rollout.sleep()  # frees the rollout's device memory for the update (woken by the weight sync)
        timings: dict[str, float] = dict(res.timings)
        timings["time/rollout_sleep"] = time.perf_counter() - t
        samples: TensorBatch = res["samples"]
        batch: TensorBatch = res["batch"]
        metrics: dict[str, Any] = {"step": self.step + 1}
        scores: torch.Tensor = res["scores"]
        rmask = samples["response_mask"]
        lengths = rmask.sum(1).float()
        eos = self.rollout.tokenizer.eos_token_id
        ended = (samples["response_ids"] == eos) & rmask
        metrics.update({
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
            "reward/max": float(scores.max()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/eos_fraction": float(ended.any(1).float().mean()),
            "response/truncated_fraction": float(samples["truncated"].float().mean()) if "truncated" in samples else 0.0,
            "samples": samples.batch_size,
            **res["reward_terms"],  # reward/<function>/mean of each reward function
        })
        if isinstance(self.reward, TaskReward):
            metrics["reward/exact_match"] = float(self.reward.exact_match(samples).mean())
        if self._loader is not None:
            metrics["data/epoch"] = self._loader.epoch  # epochs completed by the rows drawn so far
        if self.dynamic_sampling:
            metrics["dynamic_sampling/dropped_groups"] = res["dropped_groups"]
            metrics["dynamic_sampling/kept_samples"] = batch.batch_size
        if batch.batch_size == 0:
            metrics["update/skipped"] = 1
            return self._finish_step(metrics, timings, t_step, samples)
        batch = batch.update(old_log_probs=res["old_log_probs"])
        entropy = res["entropy"]
        metrics["actor/entropy"] = _masked_mean(entropy, batch["response_mask"])
        if res["ref_log_probs"] is not None:
            batch = batch.update(ref_log_probs=res["ref_log_probs"])
            metrics["actor/kl_ref"] = _masked_mean(batch["old_log_probs"] - batch["ref_log_probs"],
                                                   batch["response_mask"])
        if res["values"] is not None:
            batch = batch.update(values=res["values"], old_values=res["values"])
        if "baseline" in res.outputs:
            baseline = res["baseline"]
            if self.dynamic_sampling:
                baseline = baseline[_groups_with_signal(samples["group_ids"], res["scores"])]
            batch = batch.update(baseline_scores=baseline)
        # rollout vs training log-prob mismatch (only meaningful when the rollout's are exact)
        if "rollout_log_probs" in batch and self.rollout.log_probs_exact(params):
            delta = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * batch["response_mask"]
            n = int(batch["response_mask"].sum())
            metrics["logprob_mismatch/mean"] = float(delta.sum() / n) if n else 0.0
            metrics["logprob_mismatch/max"] = float(delta.max()) if n else 0.0
        else:
            metrics["logprob_mismatch/mean"] = _NOT_COMPARABLE
            metrics["logprob_mismatch/max"] = _NOT_COMPARABLE
        t = time.perf_counter()
        self._stage = "advantages"
        batch, adv_metrics = self.algorithm.compute_advantages_with_metrics(batch)
        timings["time/advantages"] = time.perf_counter() - t
        metrics.update({f"algorithm/{k}": float(v) for k, v in adv_metrics.items()})
        metrics["algorithm/advantage_abs_mean"] = _masked_mean(batch["advantages"].abs(), batch["response_mask"])
        t = time.perf_counter()
        metrics.update(self._update(batch))
        timings["time/update"] = time.perf_counter() - t
        t = time.perf_counter()
        self._stage = "weight_sync"
        self.rollout.wake()
        report = self.sync.sync(self.actor, self.rollout, version=self.weight_version + 1)
        self.weight_version += 1
        self._stage = "logging"
        timings["time/weight_sync"] = time.perf_counter() - t
        metrics["weight_sync/bytes"] = report.bytes
        return self._finish_step(metrics, timings, t_step, samples)

    def evaluate(self) -> dict[str, float]:
        """Evaluate on every row of ``data.eval`` and/or the task's fixed prompts; keys start with ``eval/``.

        ``data.eval``: ``data.eval_n`` responses per prompt (one greedy response by default), scored
        by the run's reward: ``eval/reward/mean``, ``eval/reward/<function>/mean`` of each reward
        function and ``eval/response/length_mean``, averaged over every response. The task's
        ``task.eval_prompts`` (when the task supplies the training prompts): ``eval/reward_mean``
        and ``eval/exact_match`` of greedy responses.
        """
        self.setup()
        out: dict[str, float] = {}
        if self._eval_data is not None:
            out.update(self._evaluate_dataset(self._eval_data))
        if self.config.task.eval_prompts and self._loader is None:
            out.update(self._evaluate_task())
        return out

    def _evaluate_dataset(self, ds: PromptDataset) -> dict[str, float]:
        r, n = self.config.rollout, self.config.data.eval_n
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, n=n, greedy=n == 1, seed=0)
        meta = BatchMeta(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                         pad_token_id=ds.tokenizer.pad_token_id, weight_version=self.weight_version, step=self.step)
        sums: dict[str, float] = {}
        count = 0
        self.rollout.wake()
        # ids far above any training group (rows drawn so far, or step * prompts_per_step + i)
        for prompts in ds.batches(self.config.batch.prompts_per_step, group_id_base=_EVAL_GROUP_BASE, meta=meta):
            scored = self.reward.score(self.rollout.generate(prompts, params))
            size = scored.batch_size
            means = {
                "reward/mean": float(scored["scores"].mean()),
                **RewardFunctions.metrics(scored),
                "response/length_mean": float(scored["response_mask"].sum(1).float().mean()),
            }
            for k, v in means.items():
                sums[k] = sums.get(k, 0.0) + v * size
            count += size
        return {f"eval/{k}": v / count for k, v in sums.items()}

    def _evaluate_task(self) -> dict[str, float]:
        n = self.config.task.eval_prompts
        examples = self.task.examples(n, seed=-1, step=0)  # the same set for every seed and step
        tok = self.rollout.tokenizer
        r = self.config.rollout
        prompts = prompt_batch(
            # ids far above any training group (step * prompts_per_step + i), so they never collide
            [p for p, _ in examples], tok, group_ids=[_EVAL_GROUP_BASE + i for i in range(n)],
            extras={"answer": [a for _, a in examples]},
            meta=BatchMeta(temperature=r.temperature, pad_token_id=tok.pad_token_id, step=self.step),
        )
        params = SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens, greedy=True, seed=0)
        self.rollout.wake()
        out = self.reward.score(self.rollout.generate(prompts, params))
        metrics = {"eval/reward_mean": float(out["scores"].mean())}
        if isinstance(self.reward, TaskReward):
            metrics["eval/exact_match"] = float(self.reward.exact_match(out).mean())
        return metrics

    def _update(self, batch: TensorBatch) -> dict[str, float]:
        cfg = self.config.batch
        fields_drop = [f for f in ("log_probs", "entropy", "values") if f in batch]
        batch = batch.drop(*fields_drop)
        self.buffer.add(batch)
        spilled = self.buffer.samples_on_disk
        size = cfg.mini_batch_size or batch.batch_size
        sums: dict[str, float] = {}
        updates = 0
        skipped_updates = 0

        def add(prefix: str, values: Mapping[str, float]) -> None:
            for k, v in values.items():
                sums[f"{prefix}/{k}"] = sums.get(f"{prefix}/{k}", 0.0) + float(v)

        try:
            seed = self.config.seed * 1_000_003 + self.step
            for i, mb in enumerate(self.buffer.mini_batches(size, epochs=cfg.epochs, seed=seed)):
                stats = GlobalBatchStats.of(mb)
                actor_m = self._train_engine("actor", self.actor, mb, self.algorithm.actor_loss, stats, i)
                add("actor", actor_m)
                skipped = actor_m["skipped"] > 0
                if self.critic is not None and self.algorithm.critic_loss is not None:
                    critic_m = self._train_engine("critic", self.critic, mb, self.algorithm.critic_loss, stats, i)
                    add("critic", critic_m)
                    skipped = skipped or critic_m["skipped"] > 0
                updates += 1
                # an engine skips a non-finite update on every rank (docs/architecture.md, "Loss and distribution")
                skipped_updates += skipped
                self._consecutive_skips = self._consecutive_skips + 1 if skipped else 0
        finally:
            self.buffer.clear()
        out = {k: v / max(updates, 1) for k, v in sums.items()}
        out["buffer/spilled_samples"] = float(spilled)
        out["update/optimizer_steps"] = float(updates)
        out["update/nonfinite_skips"] = float(skipped_updates)
        out["update/consecutive_nonfinite_skips"] = float(self._consecutive_skips)
        return out

    def _train_engine(
        self, role: str, engine: TrainingEngine, mb: TensorBatch, loss: LossFn, stats: GlobalBatchStats, index: int
    ) -> dict[str, float]:
        def fn(budget: int) -> Mapping[str, float]:
            # the engine micro-batches the whole mini-batch under the scheduler's budget
            return engine.forward_backward(mb, loss, stats, max_tokens=budget)

        self._stage = f"{role}_update"
        metrics = self.schedulers[role].run(mb, fn, key=f"step{self.step}/{role}/update{index}")
        total = {k: float(v) for k, v in metrics.items()}
        step = engine.optimizer_step()
        total["grad_norm"] = step.grad_norm
        total["lr"] = step.lr
        total["skipped"] = float(step.skipped)
        return total

    def _finish_step(
        self, metrics: dict[str, Any], timings: dict[str, float], t_step: float, samples: TensorBatch
    ) -> dict[str, Any]:
        wall = time.perf_counter() - t_step
        timings["time/step"] = wall
        metrics.update(timings)
        tokens = int(samples["response_mask"].sum())
        metrics["throughput/response_tokens"] = tokens
        metrics["throughput/tokens_per_s"] = tokens / wall if wall > 0 else 0.0
        rollout_t = timings.get("time/rollout", 0.0)
        metrics["throughput/rollout_tokens_per_s"] = tokens / rollout_t if rollout_t > 0 else 0.0
        prefix = f"step{self.step}/"
        for role, sched in self.schedulers.items():
            decisions = [d for d in sched.plan if d.key.startswith(prefix)]
            if decisions:
                metrics[f"scheduler/{role}/micro_batches"] = sum(len(d.groups) for d in decisions)
                metrics[f"scheduler/{role}/ooms"] = sum(d.ooms for d in decisions)
                metrics[f"scheduler/{role}/budget"] = decisions[-1].budget
        metrics["weight_version"] = self.weight_version
        tc, d = self.config.task, self.config.data

        def due(every: int) -> bool:  # the last step is always evaluated
            return self.step + 1 == self.config.steps or bool(every and (self.step + 1) % every == 0)

        on_data = self._eval_data if due(d.eval_every) else None
        on_task = bool(tc.eval_prompts) and self._loader is None and due(tc.eval_every)
        if on_data is not None or on_task:
            t = time.perf_counter()
            self._stage = "evaluation"
            if on_data is not None:
                metrics.update(self._evaluate_dataset(on_data))
            if on_task:
                metrics.update(self._evaluate_task())
            metrics["time/eval"] = time.perf_counter() - t
        self.step += 1
        self.history.append(metrics)
        self._open_sinks().log_step(self.step, metrics)
        self._write_plan()
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _write_plan(self) -> None:
        with open(self.out / "scheduler_plan.jsonl", "a") as fh:
            for role, sched in self.schedulers.items():
                plan = sched.plan
                for d in plan[self._plan_written.get(role, 0):]:
                    fh.write(json.dumps({"role": role, **d.to_json()}) + "\n")
                self._plan_written[role] = len(plan)

    def save_checkpoint(self) -> Path:
        """Write an atomic checkpoint of every trainable engine and the trainer state; returns its folder."""
        self.setup()
        state = {
            "step": self.step,
            "weight_version": self.weight_version,
            "rng": rng_state(),
            "schedulers": {r: s.state_dict() for r, s in self.schedulers.items()},
            "algorithm": self.algorithm.state_dict(),
            "config": config_to_dict(self.config),
            "consecutive_nonfinite_skips": self._consecutive_skips,
        }
        if self._loader is not None:
            state["data"] = self._loader.state_dict()  # a resumed run continues the data order exactly
        engines = {"actor": self.actor} if self.critic is None else {"actor": self.actor, "critic": self.critic}
        final = write_checkpoint(self.out / "checkpoints", self.step, engines, state, keep=self.config.checkpoint.keep)
        self._on_disk_step = self.step
        if self.sinks is not None:
            self.sinks.checkpoint(self.step, final)
        return final

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint` and sync the rollout engine.

        Nothing is restored unless the folder matches its manifest, ``trainer_state.json`` passes
        its field checks and the saved config differs from the current one only in keys of
        :data:`~verl_core.trainer.reliability.RESUME_SAFE_KEYS` (those changes are logged). A run
        on ``data.train`` continues the data order from the saved position. The metric logs are
        cut back to the checkpoint's step when the sinks open (:class:`MetricSinks`).

        Raises:
            CheckpointError: the manifest, a file, or a field of ``trainer_state.json`` (named).
            ConfigError: config keys that change the math differ from the checkpoint's (all listed),
                or the dataset now has another number of rows than when the checkpoint was written.
        """
        self.setup()
        ckpt = Path(path)
        engines = [r for r, e in (("actor", self.actor), ("critic", self.critic)) if e is not None]
        verify_checkpoint(ckpt, required=(STATE_FILE, *engines))
        state, rng = read_state(ckpt, self.schedulers, self.algorithm.state_dict())
        allowed = resume_config_changes(state["config"], config_to_dict(self.config), ckpt)
        data = _read_data_state(ckpt, state, self._loader)
        if allowed:
            self._say("resume: changed keys allowed: " + "; ".join(allowed))
        for role, engine in (("actor", self.actor), ("critic", self.critic)):
            if engine is not None:
                load_engine_checkpoint(ckpt, role, engine, getattr(self.config.backends, role))
        self.step = int(state["step"])
        self.weight_version = int(state["weight_version"])
        for role, s in state["schedulers"].items():
            self.schedulers[role].load_state_dict(s)
        self.algorithm.load_state_dict(state["algorithm"])
        self._consecutive_skips = int(state.get("consecutive_nonfinite_skips", 0))
        if self._loader is not None and data is not None:
            self._loader.load_state_dict(data)
        self._on_disk_step = self.step
        self._logs_from = self.step
        set_rng_state(rng)
        self.rollout.wake()
        self.sync.sync(self.actor, self.rollout, version=self.weight_version)
        self._restore_plan()

    def _restore_plan(self) -> None:
        """Replay the recorded scheduler plan after the checkpoint (the metrics are cut by the sinks)."""
        plan = self.out / "scheduler_plan.jsonl"
        if plan.is_file():
            by_role: dict[str, list[Decision]] = {}
            kept_plan = []
            for ln in read_json_lines(plan):
                d = json.loads(ln)
                step = int(str(d["key"]).split("/")[0].removeprefix("step"))
                if step >= self.step:
                    by_role.setdefault(d.pop("role"), []).append(Decision.from_json(d))
                else:
                    kept_plan.append(ln)
            for role, decisions in by_role.items():
                self.schedulers[role].add_replay(decisions)
            write_text_atomic(plan, "".join(ln + "\n" for ln in kept_plan))

    # ------------------------------------------------------------------ the loop
    def train(self, *, resume: bool = False) -> list[dict[str, Any]]:
        """Run until ``config.steps``; with ``resume`` continue from the newest checkpoint.

        Returns the metrics of every step (including those before a resume).

        Raises:
            ConfigError: a fresh run in a folder holding a run or other files (without
                ``overwrite``), ``resume`` without the run's marker, or an output folder another
                process is running in; see :mod:`verl_core.trainer.rundir`.
        """
        self.setup(resume=resume)
        run = self._claim(resume)
        run.check_owned()
        if not resume:
            run.require_fresh(self.config)  # never restart a run this trainer opened rather than started
        cfg = self.config
        if resume:
            ckpt = latest_checkpoint(self.out)
            if ckpt is None:
                raise ConfigError(
                    f"--resume: no checkpoint under {str(self.out / 'checkpoints')!r}; "
                    "run without --resume to start fresh"
                )
            self.load_checkpoint(ckpt)
            self._say(f"resumed from {ckpt} at step {self.step}")
        else:
            (self.out / "scheduler_plan.jsonl").unlink(missing_ok=True)  # metrics.jsonl: the sinks start it afresh
        # written once the run is known to start (a refused resume leaves the run's config as it was)
        write_text_atomic(self.out / "config.json", json.dumps(config_to_dict(cfg), indent=1))
        self._open_sinks()
        self._bar = ProgressBar(cfg.steps, initial=self.step, enabled=cfg.logging.progress, stream=self._stream)
        try:
            while self.step < cfg.steps:
                self._bar.update(self.train_step())
                every = cfg.checkpoint.every
                if every and self.step % every == 0 and self.step < cfg.steps:
                    self.save_checkpoint()
            if cfg.checkpoint.final and self._on_disk_step != self.step:
                self.save_checkpoint()
        except BaseException:
            try:
                self._close_sinks(failed=True)
            except Exception as e:  # the error that stopped the run is the one to report
                _log.warning("closing the metric sinks after a failed run: %s", e)
            raise
        finally:
            self._bar.close()
            self._bar = None
        self._close_sinks(failed=False)
        if cfg.logging.plot:
            self._say(plot_metrics(self.history, self.out / "curves.png"))
        return self.history

    def _open_sinks(self) -> MetricSinks:
        """The run's metric sinks, opened on first use: afresh, or continuing the logs of a loaded checkpoint."""
        if self.sinks is None:
            cfg = self.config
            self.sinks = MetricSinks.open(
                self.out, cfg.logging.sink_config(), run_name=self.out.name, resume_step=self._logs_from,
                hparams=config_to_dict(cfg), base_dir=self.base_dir,
            )
            if self._logs_from is not None and "jsonl" in self.sinks.names:
                self.history = list(self.sinks.history)  # the steps up to the checkpoint, as logged then
        return self.sinks

    def _close_sinks(self, *, failed: bool) -> None:
        if self.sinks is not None:
            sinks, self.sinks = self.sinks, None
            self._logs_from = self.step  # opened again, the logs continue
            sinks.close(failed=failed)

    def _say(self, text: str) -> None:
        """A message of the run: to the ``verl_core.trainer.trainer`` logger, and above the progress bar."""
        _log.info(text)
        if not self.config.logging.progress:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()

    def close(self) -> None:
        """Close the metric sinks; release every engine, the stage threads, the buffer's spill files and
        the claim on the output folder."""
        try:
            self._close_sinks(failed=self._failed is not None)
        finally:
            if self._built:
                for engine in (self.rollout, self.actor, self.reference, self.critic, self.reward):
                    if engine is not None:
                        close: Callable[[], None] | None = getattr(engine, "close", None)
                        if close is not None:
                            close()
                self.executor.close()
                self.buffer.close()
                self._built = False
            self._stage_threads.close()
            if self.run_dir is not None:
                self.run_dir.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _groups_with_signal(group_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Bool mask of samples whose group's scores are not all equal (DAPO dynamic sampling)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    n = uniq.numel()
    lo = torch.full((n,), math.inf).scatter_reduce(0, inverse, scores.float(), "amin")
    hi = torch.full((n,), -math.inf).scatter_reduce(0, inverse, scores.float(), "amax")
    return (hi > lo)[inverse]


_PLOTTED: tuple[tuple[tuple[str, ...], str], ...] = (
    (("reward/mean", "reward/exact_match"), "reward"),
    (("response/length_mean",), "response length"),
    (("actor/entropy",), "entropy"),
    (("actor/kl_ref",), "KL to reference"),
    (("actor/grad_norm",), "actor grad norm"),
    (("time/step",), "seconds per step"),
)


def plot_metrics(history: list[dict[str, Any]], path: Path) -> str:
    """Write a PNG of the main curves; returns a line saying where (or why not)."""
    if not history:
        return "no steps: no plot written"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'verl-core[plot]')"

    def has(key: str) -> bool:
        return any(isinstance(m.get(key), (int, float)) for m in history)

    panels = [(tuple(k for k in keys if has(k)), title) for keys, title in _PLOTTED]
    panels = [(keys, title) for keys, title in panels if keys]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), squeeze=False)
    for ax, (keys, title) in zip(axes[0], panels):
        for key in keys:
            pts = [(m["step"], m[key]) for m in history if isinstance(m.get(key), (int, float))]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"curves written to {path}"
