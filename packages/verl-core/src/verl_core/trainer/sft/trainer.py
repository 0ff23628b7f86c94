"""Supervised fine-tuning (``verl sft``): train the policy on prompt/response pairs, then hand it to RL.

:class:`SFTTrainer` runs on the same training engines as ``verl train`` (any backend with an actor
engine, built by the executor of ``executor``), with the same run folder rules
(:class:`~verl_core.trainer.run.folder.RunDir`), checkpoints (:mod:`verl_core.trainer.run.checkpoints`: atomic
``checkpoints/step-N`` folders with a manifest and ``trainer_state.json``), ``--resume`` rules
(:func:`~verl_core.trainer.run.checkpoints.resume_config_changes`) and metric sinks. At the end it
exports the final weights as a transformers folder, ``<output_dir>/model-sft``
(:data:`SFT_MODEL_DIR`), which ``verl train`` takes as ``model.path``.

One step takes the next ``batch.prompts_per_step`` rows of ``data.train`` in the seeded, resumable
data order (:class:`~verl_core.trainer.inputs.data.PromptSampler`, saved in every checkpoint). Each row is
its prompt (text, or chat messages rendered with the chat template and the generation prompt),
then its ``data.response_key`` text followed by EOS, tokenized with the actor's tokenizer into the
batch layout of a rollout: ``prompt_ids``/``prompt_mask`` left-padded, ``response_ids``/
``response_mask`` right-padded. So the engine's log-prob path is the one RL uses, and the loss
(:class:`SFTLoss`) is the negative log-likelihood of the response tokens only, a token mean over
the global mini-batch: results do not depend on the micro-batch split.

A dataset of whole conversations (the prompt column holds chat messages with assistant messages,
tool calls and tool results among them, and there is no ``data.response_key`` column) trains on
the assistant's tokens only: each conversation is rendered with the chat template (and the
schemas of ``agent.tools``) incrementally, token for token as a multi-turn rollout appends them,
and its ``loss_mask`` marks the assistant's tokens (:mod:`verl_core.trainer.sft.conversations`).

Config sections read: ``model``, ``backends.actor`` and ``backends.options.actor``, ``optim``,
``batch`` (``prompts_per_step`` = rows per step, ``mini_batch_size`` = rows per optimizer step
with 0 = the whole step, ``micro_batch_tokens``, ``min_tokens``, ``max_tokens``), ``data`` (every
key), ``steps``, ``seed``, ``output_dir``, ``overwrite``, ``checkpoint`` (``every``, ``keep``; the
final checkpoint is always written, the export reads it), ``logging`` (``progress``, ``sinks`` and
their settings), ``max_consecutive_skips``, ``executor``, ``ray`` and ``agent.tools`` (their
schemas are rendered into conversations). The RL-only keys are ignored:
``task``, ``reward``, ``algorithm``, ``rollout``, ``critic_model``, ``reward_model``, ``critic_optim``, the other
roles of ``backends``, ``batch.epochs``, ``batch.buffer_memory_bytes``, ``logging.plot`` and the
other ``agent`` keys.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final, Literal

import torch

from verl_core.agent.render import chat_tokenizer
from verl_core.algorithms.aggregation import masked_total, token_mean
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.errors import CheckpointError, ConfigError
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.kernel.training import GlobalBatchStats, LossOutput, ModelOutput, TrainingEngine
from verl_core.trainer.batching.budget import make_schedulers
from verl_core.trainer.batching.scheduler import (
    DynamicBatchScheduler,
    MemoryProbe,
    PeakProbe,
    train_mini_batch,
)
from verl_core.trainer.config import RunConfig
from verl_core.trainer.executor import Executor, make_executor
from verl_core.trainer.inputs.agent import resolve_tools
from verl_core.trainer.inputs.data import (
    DataConfig,
    PromptDataset,
    PromptSampler,
    check_dataset_files,
)
from verl_core.trainer.inputs.usercode import resolve_path
from verl_core.trainer.run.checkpoints import latest_checkpoint
from verl_core.trainer.run.context import RunContext
from verl_core.trainer.run.folder import RunDir
from verl_core.trainer.run.model import engine_spec
from verl_core.trainer.sft.conversations import render_conversation

__all__ = ["SFT_MODEL_DIR", "SFTDataset", "SFTLoss", "SFTTrainer"]

SFT_MODEL_DIR: Final = "model-sft"
"""The folder under ``output_dir`` where :meth:`SFTTrainer.train` exports the final weights."""

_TINY_MAX_POSITION: Final = 512  # context of the tiny model built when model.path is empty
_NO_LIMIT: Final = 1 << 20  # engine length limits when the model folder states no context length


class SFTLoss:
    """The SFT :class:`~verl_core.kernel.training.LossFn`: mean negative log-likelihood of the trained tokens.

    The trained tokens are ``TensorBatch.loss_mask``: the response tokens of a prompt/response row,
    the assistant's tokens of a conversation row. ``-(sum of log_probs over them) /
    stats.num_tokens``: prompt, padding and non-assistant positions do not count, and the
    normaliser is the trained-token count of the whole mini-batch, so the
    sum over micro-batches (and ranks) is the mini-batch's token mean whatever the split. The
    log-probs are those of the batch temperature, which SFT batches set to 1.
    """

    @property
    def needs(self) -> frozenset[ModelOutput]:
        """``log_probs`` of the response tokens."""
        return frozenset({"log_probs"})

    def __call__(self, batch: TensorBatch, stats: GlobalBatchStats) -> LossOutput:
        """This micro-batch's share of the mini-batch's mean NLL (metric ``tokens``: its trained tokens)."""
        batch.require("log_probs", "response_mask", where="SFTLoss")
        mask = batch.loss_mask  # response_mask, or the assistant's tokens of a conversation
        loss = token_mean(-batch["log_probs"], mask, stats)
        return LossOutput(loss, {"tokens": mask.sum().float()})


class SFTDataset:
    """Tokenized prompt/response rows, or whole conversations, of ``data.train`` or ``data.eval``.

    Build it with :meth:`from_config`; :meth:`batch` makes the training batch of some rows.

    Attributes:
        prompts: Prompt token ids of every row.
        responses: Response token ids of every row (EOS included for a prompt/response row).
        loss_masks: Per row and response token, whether it is trained (None: every response
            token; conversations train only the assistant's tokens).
        dropped: Rows left out for a prompt longer than ``data.max_prompt_len``.
        pad_token_id: The tokenizer's pad id.
    """

    def __init__(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_token_id: int,
        dropped: int = 0, loss_masks: Sequence[Sequence[bool]] | None = None,
    ) -> None:
        if len(prompts) != len(responses) or not prompts:
            raise ConfigError(f"SFTDataset needs as many responses as prompts (>= 1), got {len(prompts)} and {len(responses)}")
        self.prompts = [tuple(p) for p in prompts]
        self.responses = [tuple(r) for r in responses]
        self.loss_masks = None if loss_masks is None else [tuple(bool(x) for x in m) for m in loss_masks]
        if self.loss_masks is not None and [len(m) for m in self.loss_masks] != [len(r) for r in self.responses]:
            raise ConfigError("SFTDataset needs one loss-mask value per response token of every row")
        self.pad_token_id = pad_token_id
        self.dropped = dropped

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def from_config(
        cls, data: DataConfig, tokenizer: Tokenizer, *, split: Literal["train", "eval"] = "train",
        context: int | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
        base_dir: Path | None = None,
    ) -> SFTDataset:
        """Load ``data.<split>`` with the config's prompt and response columns, or as conversations.

        Prompts are read, rendered and length-checked by
        :meth:`~verl_core.trainer.inputs.data.PromptDataset.from_config`; each response is its text
        followed by the tokenizer's EOS. A dataset without the ``data.response_key`` column whose
        prompt column holds conversations (chat messages with assistant messages) is read as
        conversations: each row is rendered by :func:`~verl_core.trainer.sft.conversations.render_conversation`
        (with ``tools``) and trained on its assistant messages only.

        Args:
            data: The run's ``data`` section.
            tokenizer: The actor's tokenizer.
            split: ``train`` or ``eval``.
            context: The model's longest sequence (None = unknown, not checked).
            tools: JSON tool schemas rendered into conversations (``agent.tools``).
            base_dir: The config file's folder, where relative dataset paths are looked up first.

        Raises:
            ConfigError: every problem of the prompt dataset; no ``data.response_key`` column
                and no conversations (naming the column and the columns there are); a response
                that is not text; a conversation the template cannot render as appended turns; a
                row longer than ``context`` tokens.
        """
        where = f"data.{split}"
        paths = data.train_paths if split == "train" else data.eval_paths
        if not paths:
            raise ConfigError(f"{where} is not set; give a dataset file or folder")
        prompts = PromptDataset.load(
            [str(resolve_path(p, base_dir)) for p in paths], tokenizer, prompt_key=data.prompt_key, chat_template=data.chat_template,
            max_prompt_len=data.max_prompt_len, long_prompts=data.long_prompts, where=where, tools=tools,
        )
        key = data.response_key
        if key not in prompts.columns and all(
            m is not None and any(x.get("role") == "assistant" for x in m) for m in prompts.messages
        ):
            return cls._conversations(prompts, tokenizer, tools=tools, context=context, where=where)
        if key not in prompts.columns:
            raise ConfigError(
                f"{where}: {', '.join(map(repr, prompts.sources))} has no column {key!r} (the response column, "
                f"config key 'data.response_key'); its columns: {', '.join([data.prompt_key, *prompts.columns])}; "
                "set data.response_key to the column holding the responses, or give whole conversations (chat "
                "messages with assistant messages) in the prompt column to train on the assistant's messages"
            )
        eos = tokenizer.eos_token_id
        prompt_ids: list[list[int]] = []
        response_ids: list[list[int]] = []
        for text, response in zip(prompts.prompts, prompts.columns[key]):
            if not isinstance(response, str):
                raise ConfigError(
                    f"{where}: the response of the row with prompt {_short(text)} is {_short(response)}; "
                    f"column {key!r} must hold text"
                )
            p = tokenizer.encode(text)
            r = [*tokenizer.encode(response), eos]
            if context is not None and len(p) + len(r) > context:
                raise ConfigError(
                    f"{where}: the row with prompt {_short(text)} has {len(p)} prompt and {len(r)} response tokens "
                    f"(EOS included), more than the model's {context} positions (max_position_embeddings); "
                    "shorten it, or leave such rows out of the data"
                )
            prompt_ids.append(p)
            response_ids.append(r)
        return cls(prompt_ids, response_ids, pad_token_id=tokenizer.pad_token_id, dropped=prompts.dropped)

    @classmethod
    def _conversations(
        cls, rows: PromptDataset, tokenizer: Tokenizer, *, tools: Sequence[Mapping[str, Any]] | None,
        context: int | None, where: str,
    ) -> SFTDataset:
        chat = chat_tokenizer(tokenizer)
        if chat is None:  # PromptDataset.load already refused chat messages without a template
            raise ConfigError(f"{where}: conversations need a tokenizer with a chat template")
        prompt_ids: list[list[int]] = []
        response_ids: list[list[int]] = []
        masks: list[list[bool]] = []
        for i, messages in enumerate(rows.messages):
            assert messages is not None
            done = render_conversation(chat, messages, tools=tools, where=f"{where}: row {i}")
            if context is not None and len(done.prompt) + len(done.response) > context:
                raise ConfigError(
                    f"{where}: row {i} renders to {len(done.prompt) + len(done.response)} tokens, more than the "
                    f"model's {context} positions (max_position_embeddings); shorten it, or leave such rows out"
                )
            prompt_ids.append(done.prompt)
            response_ids.append(done.response)
            masks.append(done.loss_mask)
        return cls(prompt_ids, response_ids, pad_token_id=tokenizer.pad_token_id, dropped=rows.dropped,
                   loss_masks=masks)

    def batch(self, rows: Sequence[int], *, step: int = 0) -> TensorBatch:
        """The batch of ``rows``: left-padded prompts, right-padded responses (EOS included), temperature 1;
        with ``loss_mask`` for conversations."""
        prompts = [self.prompts[i] for i in rows]
        responses = [self.responses[i] for i in rows]
        n, width_p, width_r = len(rows), max(map(len, prompts)), max(map(len, responses))
        pad = self.pad_token_id
        prompt_ids = torch.full((n, width_p), pad, dtype=torch.int64)
        prompt_mask = torch.zeros((n, width_p), dtype=torch.bool)
        response_ids = torch.full((n, width_r), pad, dtype=torch.int64)
        response_mask = torch.zeros((n, width_r), dtype=torch.bool)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            prompt_ids[i, width_p - len(p):] = torch.tensor(p, dtype=torch.int64)
            prompt_mask[i, width_p - len(p):] = True
            response_ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
            response_mask[i, : len(r)] = True
        fields = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                  "response_ids": response_ids, "response_mask": response_mask}
        if self.loss_masks is not None:
            loss_mask = torch.zeros((n, width_r), dtype=torch.bool)
            for i, row in enumerate(rows):
                loss_mask[i, : len(self.loss_masks[row])] = torch.tensor(self.loss_masks[row], dtype=torch.bool)
            fields["loss_mask"] = loss_mask
        return TensorBatch(fields, meta=BatchMeta(temperature=1.0, pad_token_id=pad, step=step))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _export_latest(out: Path, run: RunDir) -> Path:
    """Export the newest checkpoint under ``out`` to ``out/model-sft`` through a temporary folder of the run."""
    from verl_core.trainer.run.export import export_checkpoint

    ckpt = latest_checkpoint(out)
    if ckpt is None:
        raise CheckpointError(f"{str(out)!r} holds no checkpoint to export; train first")
    dest = out / SFT_MODEL_DIR
    tmp = out / f".{SFT_MODEL_DIR}-{run.run_id}"  # named by the run: only this run's leftovers
    shutil.rmtree(tmp, ignore_errors=True)
    export_checkpoint(ckpt, tmp, run=run)  # the run exports into its own folder
    if dest.exists():  # an export of an earlier end of this run (resumed with more steps)
        old = out / f".{SFT_MODEL_DIR}-old-{run.run_id}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    return dest


def _context_length(model_path: str) -> int | None:
    """``max_position_embeddings`` of the model folder's config.json (None when it states none)."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class SFTTrainer:
    """Runs supervised fine-tuning from a :class:`~verl_core.trainer.config.RunConfig`.

    Args:
        config: The run; see the module docstring for the sections it reads.
        memory_probe: Memory probe of the micro-batch scheduler (default: the device's real memory).
        stream: Where the progress bar and messages go (default stderr).
        peak_probe: Allocator peak probe whose reading of the first update refines the micro-batch
            budget once (default: the CUDA allocator on a CUDA device, none on the CPU).
        base_dir: The config file's folder: relative paths of datasets, tool files and callback
            files are looked up there first, then in the working directory (default: the working
            directory only), as :class:`~verl_core.trainer.rl.trainer.Trainer` does.

    Use :meth:`train` (with ``resume=True`` to continue from the newest checkpoint of the output
    folder); the actor engine is built on first use and released by :meth:`close` (or ``with``).
    The run folder, messages, metric sinks, checkpoints and the loop are the
    :class:`~verl_core.trainer.run.context.RunContext`'s, as in ``verl train``.

    Raises:
        ConfigError: ``data.train`` is not set, or ``data.prompt_key`` equals ``data.response_key``.
    """

    def __init__(
        self, config: RunConfig, *, memory_probe: MemoryProbe | None = None, stream: IO[str] | None = None,
        peak_probe: PeakProbe | None = None, base_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        data = config.data
        if not data.train_paths:
            raise ConfigError(
                "config key 'data.train' is empty; verl sft trains on a dataset: set data.train to a .jsonl, "
                f".json, .parquet or .csv file (or a save_to_disk folder) with the columns {data.prompt_key!r} "
                f"(data.prompt_key) and {data.response_key!r} (data.response_key)"
            )
        if data.prompt_key == data.response_key:
            raise ConfigError(
                f"config keys 'data.prompt_key' and 'data.response_key' are both {data.prompt_key!r}; the "
                "prompt and the response must be different columns"
            )
        self.config = config
        self.out = Path(config.output_dir)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.ctx = RunContext(config, runner="sft", stream=stream, base_dir=self.base_dir)
        self.loss_fn = SFTLoss()
        self.step = 0
        self.model_dir: Path | None = None
        self._probe = memory_probe
        self._peak_probe = peak_probe
        self._built = False
        self._consecutive_skips = 0
        self.actor: TrainingEngine
        self.executor: Executor
        self.scheduler: DynamicBatchScheduler
        self.train_data: SFTDataset
        self.eval_data: SFTDataset | None = None
        self.sampler: PromptSampler

    @property
    def history(self) -> list[dict[str, Any]]:
        """The metrics of every step (with those before a resume, read back when the ``jsonl`` sink is on)."""
        return self.ctx.history

    @property
    def run_dir(self) -> RunDir | None:
        """The claim on the output folder (None until :meth:`setup`)."""
        return self.ctx.run_dir

    # ------------------------------------------------------------------ setup
    def setup(self, *, resume: bool | None = None) -> None:
        """Claim the output folder, build the model (if tiny) and the actor engine, load the data.

        Args:
            resume: True to continue the run the folder holds, False to start a fresh one, None
                to open the run there or else start one (see :meth:`RunDir.claim`).

        Raises:
            ConfigError: the output folder may not be used so, or the data is invalid.
        """
        if self._built:
            return
        cfg = self.config
        for split, paths in (("train", cfg.data.train_paths), ("eval", cfg.data.eval_paths)):
            # what needs no tokenizer, before any model is built
            check_dataset_files([str(resolve_path(p, self.base_dir)) for p in paths], f"data.{split}")
        # the tools' schemas are rendered into conversations as in the multi-turn runs (imported first)
        tools = [t.schema for t in resolve_tools(cfg.agent, base_dir=self.base_dir)] or None
        self.ctx.prepare(resume)
        try:
            self._build(tools)
        except BaseException:
            # the actor and executor built before the failure are released, and a run that never
            # started gives its folder back (the corrected run may use it)
            self._release_engines()
            self.ctx.abandon()
            raise
        self._built = True

    def _release_engines(self) -> None:
        """Close the actor and the executor, those that exist (a setup may fail before either)."""
        actor, executor = getattr(self, "actor", None), getattr(self, "executor", None)
        try:
            if actor is not None:
                actor.close()
        finally:
            if executor is not None:
                executor.close()

    def _build(self, tools: list[dict[str, Any]] | None) -> None:
        """The rest of :meth:`setup` once the output folder is claimed: the model, the actor, the data."""
        cfg = self.config
        path = self.ctx.model_path(max_position=_TINY_MAX_POSITION)
        context = _context_length(path)
        limit = context or _NO_LIMIT
        spec = engine_spec(cfg, "actor", path, optim=cfg.optim.to_optim(cfg.steps),
                           max_prompt_len=limit, max_response_len=limit)
        self.executor = make_executor(cfg.executor, cfg.ray, device=cfg.model.device)
        self.actor = self.executor.training_engine("actor", cfg.backends.actor, spec)
        tokenizer = self.actor.tokenizer
        self.train_data = SFTDataset.from_config(cfg.data, tokenizer, split="train", context=context, tools=tools,
                                                 base_dir=self.base_dir)
        if cfg.data.eval_paths:
            self.eval_data = SFTDataset.from_config(cfg.data, tokenizer, split="eval", context=context,
                                                    tools=tools, base_dir=self.base_dir)
        self.sampler = PromptSampler(len(self.train_data), seed=cfg.seed, shuffle=cfg.data.shuffle)
        # as in verl train: the budget is read once (refined once by the first update) and
        # checkpointed, so a resumed run splits its steps (and sums their gradients) exactly like
        # an uninterrupted one
        self.scheduler = make_schedulers(
            cfg, ("actor",), model_path=path, gradient_checkpointing=spec.gradient_checkpointing, probe=self._probe,
            peak_probe=self._peak_probe,
        )["actor"]

    # ------------------------------------------------------------------ steps
    def train_step(self) -> dict[str, Any]:
        """Train on the next ``batch.prompts_per_step`` rows and return the step's metrics.

        Metrics: ``train/loss`` (mean NLL per response token over the step), ``train/grad_norm``
        (mean over the step's optimizer steps), ``train/lr``, ``train/response_tokens`` (the trained
        tokens: the responses, or the assistant's tokens of conversations),
        ``train/tokens`` (prompt and response), ``data/epoch``, ``data/rows`` and
        ``data/dropped_long_prompts`` (of ``data.train``), ``update/optimizer_steps``,
        ``update/nonfinite_skips``, ``scheduler/actor/micro_batches``, ``time/step`` and
        ``throughput/tokens_per_s`` (prompt and response tokens per second). They are appended
        to :attr:`history` and sent to the metric sinks.

        Raises:
            TrainingDivergedError: ``max_consecutive_skips`` optimizer steps in a row were skipped
                for a non-finite loss or gradient; a checkpoint was written first.
        """
        self.setup()
        cfg = self.config
        t0 = time.perf_counter()
        rows = self.sampler.take(cfg.batch.prompts_per_step)
        batch = self.train_data.batch(rows, step=self.step)
        size = cfg.batch.mini_batch_size or batch.batch_size
        nll = grad_norm = lr = 0.0
        updates = skipped = micro_batches = 0
        for i, start in enumerate(range(0, batch.batch_size, size)):
            mb = batch.index(slice(start, start + size))
            m = train_mini_batch(self.actor, self.scheduler, mb, self.loss_fn, key=f"step{self.step}/actor/update{i}")
            nll += m["loss"] * GlobalBatchStats.of(mb).num_tokens
            micro_batches += len(self.scheduler.plan[-1].groups)
            grad_norm += m["grad_norm"]
            lr = m["lr"]
            updates += 1
            skipped += int(m["skipped"])
            # an engine skips a non-finite update on every rank (docs/architecture.md, "Loss and distribution")
            self._consecutive_skips = self._consecutive_skips + 1 if m["skipped"] else 0
        self.step += 1
        tokens = int(batch.loss_mask.sum())
        all_tokens = int(batch["response_mask"].sum()) + int(batch["prompt_mask"].sum())
        metrics: dict[str, Any] = {
            "step": self.step,
            "train/loss": nll / max(tokens, 1),
            "train/grad_norm": grad_norm / updates,
            "train/lr": lr,
            "train/response_tokens": tokens,
            "train/tokens": all_tokens,
            "data/epoch": self.sampler.epoch,
            "data/rows": len(self.train_data),
            "data/dropped_long_prompts": self.train_data.dropped,
            "update/optimizer_steps": updates,
            "update/nonfinite_skips": skipped,
            "scheduler/actor/micro_batches": micro_batches,
        }
        if self.eval_data is not None and self._eval_due():
            t = time.perf_counter()
            metrics.update(self.evaluate())
            metrics["time/eval"] = time.perf_counter() - t
        wall = time.perf_counter() - t0
        metrics["time/step"] = wall
        metrics["throughput/tokens_per_s"] = all_tokens / wall if wall > 0 else 0.0
        self.ctx.log_step(self.step, metrics)
        self.ctx.check_diverged(self.step, self._consecutive_skips, self.save_checkpoint, check="the data")
        return metrics

    def _eval_due(self) -> bool:
        every = self.config.checkpoint.every
        return self.step == self.config.steps or bool(every and self.step % every == 0)

    def evaluate(self) -> dict[str, float]:
        """Mean NLL per trained token on ``data.eval`` (forward only): ``eval/loss`` and ``eval/response_tokens``.

        Raises:
            ConfigError: ``data.eval`` is not set.
        """
        self.setup()
        if self.eval_data is None:
            raise ConfigError("config key 'data.eval' is not set; give an evaluation dataset to evaluate on")
        n = self.config.batch.prompts_per_step
        total = torch.zeros((), dtype=torch.float64)
        tokens = 0
        for i, start in enumerate(range(0, len(self.eval_data), n)):
            batch = self.eval_data.batch(range(start, min(start + n, len(self.eval_data))), step=self.step)

            def fn(micro: TensorBatch) -> TensorBatch:
                return self.actor.forward(micro, self.loss_fn.needs)

            out = self.scheduler.run_forward(batch, fn, key=f"step{self.step}/actor/eval{i}",
                                             packed=self.actor.capabilities.packed_sequences)
            total += masked_total(out["log_probs"].double(), batch.loss_mask)
            tokens += int(batch.loss_mask.sum())
        return {"eval/loss": float(-total / max(tokens, 1)), "eval/response_tokens": float(tokens)}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write an atomic checkpoint (actor, data order, scheduler, RNG states); returns its folder."""
        self.setup()
        state = {
            "weight_version": self.step,
            "schedulers": {"actor": self.scheduler.state_dict()},
            "algorithm": {},
            "data": self.sampler.state_dict(),
        }
        final = self.ctx.checkpoints.save(self.step, {"actor": self.actor}, state,
                                          consecutive_skips=self._consecutive_skips)
        return self.ctx.saved(self.step, final)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`.

        Nothing is restored unless the folder matches its manifest, ``trainer_state.json`` passes
        its field checks, the data order continues (same rows, seed and shuffle) and the saved
        config differs from the current one only in keys of
        :data:`~verl_core.trainer.run.checkpoints.RESUME_SAFE_KEYS`.

        Raises:
            CheckpointError: the manifest, a file, or a field of ``trainer_state.json`` (named), or
                a checkpoint of ``verl train``.
            ConfigError: the data changed, or config keys that change the math differ (all listed).
        """
        self.setup()
        restored = self.ctx.checkpoints.load(
            Path(path), {"actor": self.actor}, {"actor": self.scheduler}, sampler=self.sampler
        )
        self.step = restored.step
        self._consecutive_skips = restored.consecutive_skips
        self.ctx.resumed(self.step)
        self.ctx.checkpoints.restore_rng()

    def export(self) -> Path:
        """Export the newest checkpoint to ``<output_dir>/model-sft`` (replacing an earlier export).

        Returns:
            The transformers folder, a ``model.path`` for ``verl train``.

        Raises:
            CheckpointError: the run has no checkpoint.
        """
        self.model_dir = _export_latest(self.out, self.ctx.claim(None))
        return self.model_dir

    # ------------------------------------------------------------------ the loop
    def train(self, *, resume: bool = False) -> list[dict[str, Any]]:
        """Run until ``config.steps``, checkpoint, and export the final weights (:attr:`model_dir`).

        With ``resume`` the run continues from the newest checkpoint of the output folder. Returns
        the metrics of every step (including those before a resume, read back from
        ``metrics.jsonl`` when the ``jsonl`` sink is on).

        Raises:
            ConfigError: the output folder may not be used so (see :mod:`verl_core.trainer.run.folder`),
                ``resume`` without a checkpoint, or a resume that changes the math.
        """
        self.setup(resume=resume)
        ckpt = self.ctx.begin(resume)
        if ckpt is not None:
            self.load_checkpoint(ckpt)
        self.ctx.write_config()
        cfg = self.config
        for split, data in (("train", self.train_data), ("eval", self.eval_data)):
            if data is not None and data.dropped:
                self.ctx.warn(
                    f"data.{split}: {data.dropped} rows left out: their prompts are longer than data.max_prompt_len "
                    f"= {cfg.data.max_prompt_len} tokens (data.long_prompts = 'drop'); {len(data)} rows kept"
                )
        report = max(1, cfg.steps // 10)

        def print_loss(m: Mapping[str, Any]) -> None:
            if self.step % report == 0 or self.step == cfg.steps:
                evaluated = f", eval loss {m['eval/loss']:.4f}" if "eval/loss" in m else ""
                self.ctx.say(f"step {self.step}: loss {m['train/loss']:.4f}{evaluated}")

        self.ctx.run_steps(
            self.train_step, self.save_checkpoint, current=lambda: self.step, final=True,  # the export reads it
            after_step=print_loss, intro=f"sft: {len(self.train_data)} training rows; {cfg.steps} steps of "
            f"{cfg.batch.prompts_per_step} rows, starting at step {self.step}",
        )
        self.actor.offload()  # the export builds its own engine from the checkpoint
        try:
            path = self.export()
        finally:
            self.actor.onload()
        self.ctx.say(f"sft: model for `verl train model.path=...`: {path}")
        return self.history

    def close(self) -> None:
        """Close the metric sinks; release the actor engine, the executor and the claim on the output folder."""
        try:
            self.ctx.close_sinks(failed=False, step=self.step)
        finally:
            if self._built:
                self._release_engines()
                self._built = False
            self.ctx.release()

    def __enter__(self) -> SFTTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
