"""Where an RL run's prompts come from: ``data.train`` / ``data.eval``, or the built-in task.

:class:`PromptSource` reads and checks the datasets and the reward functions before anything is
written (measuring prompts with the model folder's tokenizer, so the engines are built for the
longest one), hands the datasets the rollout engine's tokenizer once it exists, and makes each
step's prompt batch: the next rows of the seeded, resumable data order, or the task's prompts (a
deterministic function of seed and step).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from verl_core.enginekit.hf_tokenizer import HFTokenizer, load_tokenizer
from verl_core.kernel.batch import BatchMeta, TensorBatch
from verl_core.kernel.errors import ConfigError
from verl_core.kernel.rollout import SamplingParams
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.trainer.config import RunConfig
from verl_core.trainer.inputs.agent import (
    EPISODE_EXTRAS,
    MESSAGES_KEYWORD,
    PROMPT_MESSAGES,
    AgentSetup,
)
from verl_core.trainer.inputs.data import PromptDataset, PromptLoader
from verl_core.trainer.inputs.rewards import RewardFunctions
from verl_core.trainer.inputs.tasks import DigitTask, prompt_batch
from verl_core.trainer.inputs.usercode import import_object, resolve_path

__all__ = ["PromptSource"]


class PromptSource:
    """The datasets (or the task) of an RL run and the order their prompts are drawn in.

    Args:
        config: The run.
        task: The built-in task (its prompts when ``data.train`` is not set, and its eval prompts).
        base_dir: The config file's folder, where relative paths are looked up first.
        say: Where the datasets' sizes are reported.
        warn: Where rows left out for a long prompt are reported (default: ``say``); shown whatever
            ``logging.progress`` says.

    Attributes:
        train: ``data.train`` (None: the task's prompts).
        evals: ``data.eval`` (None when not set).
        loader: The data order of ``data.train`` (None: the task's prompts); checkpoints save it.
        columns: Per-sample extras the reward functions may ask for (with ``messages`` in a
            multi-turn run).
        agent: The ``[agent]`` section's environments and tools, imported by :meth:`load` (None:
            single-turn).
    """

    def __init__(
        self, config: RunConfig, task: DigitTask, *, base_dir: Path | None, say: Callable[[str], None],
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.task = task
        self.base_dir = base_dir
        self._say = say
        self._warn = warn if warn is not None else say
        self.train: PromptDataset | None = None
        self.evals: PromptDataset | None = None
        self.loader: PromptLoader | None = None
        self.columns: list[str] = ["answer"]
        self.agent: AgentSetup | None = None
        self.checked = False  # set by the trainer once load() passed (set up again after close(): not again)
        self._longest: int | None = None  # measured by load() when a dataset is used

    def prompt_limit(self) -> int:
        """Longest prompt, in tokens, that the engines are built for.

        The longest kept prompt of the datasets once :meth:`load` measured them (and the task's
        when the task supplies the training prompts); before that ``data.max_prompt_len`` or the
        task's (e.g. for the spec of an export, which runs no prompt).
        """
        if self._longest is not None:
            return self._longest
        d = self.config.data
        return d.max_prompt_len if d.train_paths and d.max_prompt_len else self.task.max_prompt_len()

    def model_tokenizer(self) -> Tokenizer:
        """The policy model's tokenizer, read without building an engine (every backend loads this one)."""
        m = self.config.model
        if importlib.util.find_spec("transformers") is None:
            raise ConfigError(
                "reading data.train / data.eval and checking reward.functions needs the model's tokenizer, "
                "which needs transformers: pip install verl-hf (or transformers)"
            )
        if not m.path:
            from verl_core.trainer.inputs.tiny_model import char_tokenizer

            return HFTokenizer(char_tokenizer(m.vocab_size), m.vocab_size)
        try:
            return load_tokenizer(m.path)
        except ConfigError as e:
            raise ConfigError(f"config key 'model.path' = {m.path!r}: {e}") from e

    def load(self) -> None:
        """Read and check ``data.train`` / ``data.eval``, the reward functions and callback imports.

        Runs before the output folder is claimed and before the model or any engine is built, so a
        bad dataset, column, reward function or callback is refused with nothing written. Prompts
        are measured with the model folder's tokenizer; the engines are built for the longest one.
        """
        cfg = self.config
        d = cfg.data
        for spec in cfg.logging.callbacks:  # imported (modules are cached) but not built yet
            import_object(spec, what="config key 'logging.sinks': callback", base_dir=self.base_dir)
        if cfg.agent.enabled:
            self.agent = AgentSetup.resolve(cfg.agent, base_dir=self.base_dir)
        if not (d.train_paths or d.eval_paths or cfg.reward.functions):
            return
        tok = self.model_tokenizer()
        tools = self.agent.schemas if self.agent is not None else None

        def load(split: str, paths: list[str]) -> PromptDataset | None:
            if not paths:
                return None
            return PromptDataset.load(
                [str(resolve_path(p, self.base_dir)) for p in paths], tok, prompt_key=d.prompt_key,
                chat_template=d.chat_template, max_prompt_len=d.max_prompt_len, long_prompts=d.long_prompts,
                where=f"data.{split}", tools=tools,
            )

        train, evals = load("train", d.train_paths), load("eval", d.eval_paths)
        columns = train.column_names if train is not None else ["answer"]  # the task's prompts carry answers
        if evals is not None:
            columns = [c for c in columns if c in evals.column_names]
        if self.agent is not None:
            clash = [c for c in (MESSAGES_KEYWORD, *EPISODE_EXTRAS) if c in columns]
            if clash:
                raise ConfigError(
                    f"data.train has the column(s) {clash}; a multi-turn run ([agent]) passes reward functions each "
                    f"episode's conversation as {MESSAGES_KEYWORD!r} and keeps its episodes under "
                    f"{', '.join(map(repr, EPISODE_EXTRAS))}: rename them"
                )
            columns = [*columns, MESSAGES_KEYWORD]
        if cfg.reward.functions:
            RewardFunctions.from_config(cfg.reward, tok, columns=columns, base_dir=self.base_dir)  # refused here
        lengths = [ds.longest_prompt for ds in (train, evals) if ds is not None]
        if train is None:
            lengths.append(self.task.max_prompt_len())
        self.train, self.evals, self.columns = train, evals, columns
        self._longest = max(lengths)
        for split, ds in (("train", train), ("eval", evals)):
            if ds is not None:
                left_out = (
                    f"; {ds.dropped} rows left out: their prompts are longer than data.max_prompt_len = "
                    f"{d.max_prompt_len} tokens (data.long_prompts = 'drop')" if ds.dropped else ""
                )
                (self._warn if ds.dropped else self._say)(
                    f"data.{split}: {len(ds)} prompts from {', '.join(ds.sources)} (longest {ds.longest_prompt} "
                    f"tokens{left_out})"
                )
                plain = sum(m is None for m in ds.messages)
                if tools and plain:  # the tools' schemas reach the model only through the chat template
                    self._warn(
                        f"data.{split}: {plain} of {len(ds)} prompts are text used as it is, so the model is never "
                        f"shown the schemas of agent.tools; give chat messages in column {d.prompt_key!r}, or set "
                        "data.chat_template = true (the model folder needs a chat template)"
                    )

    def stats(self) -> dict[str, float]:
        """The datasets' sizes for every step's metrics: ``data/rows`` and ``data/dropped_long_prompts``
        of ``data.train``, ``data/eval_rows`` and ``data/eval_dropped_long_prompts`` of ``data.eval``
        (only the datasets the run has)."""
        out: dict[str, float] = {}
        for prefix, ds in (("data/", self.train), ("data/eval_", self.evals)):
            if ds is not None:
                out.update({prefix + k.removeprefix("data/"): v for k, v in ds.stats().items()})
        return out

    def bind(self, tokenizer: Tokenizer) -> None:
        """Give the datasets the rollout engine's tokenizer, checking that every prompt still fits the engines."""
        for split in ("train", "evals"):
            ds: PromptDataset | None = getattr(self, split)
            if ds is None:
                continue
            columns = dict(ds.columns)
            if self.agent is not None:  # each episode's conversation starts with its prompt's messages
                columns[PROMPT_MESSAGES] = tuple(
                    list(m) if m is not None else [{"role": "user", "content": p}] for p, m in zip(ds.prompts, ds.messages)
                )
            ds = PromptDataset(ds.prompts, columns, tokenizer, dropped=ds.dropped, sources=ds.sources, messages=ds.messages)
            if ds.longest_prompt > self.prompt_limit():
                raise ConfigError(
                    f"data.{split.removesuffix('s')}: the rollout engine's tokenizer (backend "
                    f"{self.config.backends.rollout!r}) encodes a prompt to {ds.longest_prompt} tokens, but the "
                    f"model folder's tokenizer, which the engines were sized with, to at most {self.prompt_limit()}; "
                    "use a backend that tokenizes with the model folder's tokenizer"
                )
            setattr(self, split, ds)
        if self.train is None:
            return
        if self.loader is None:
            self.loader = PromptLoader(self.train, seed=self.config.seed, shuffle=self.config.data.shuffle)
        else:  # set up again after close(): the data order goes on from where it was
            self.loader.dataset = self.train

    def sampling_params(self, step: int) -> SamplingParams:
        """Sampling parameters of ``step`` (the seed makes every sample reproducible)."""
        return self.config.rollout.sampling_params(seed=self.config.seed * 1_000_003 + step)

    def batch(self, step: int, tokenizer: Tokenizer, *, weight_version: int) -> TensorBatch:
        """The prompt batch of ``step`` (group ids unique for the run).

        With ``data.train``: the next rows of the data order, every other column as a per-sample
        extra (each call advances the order; checkpoints save its position). Otherwise the built-in
        task's prompts, a deterministic function of seed and step, with their answers.
        """
        n = self.config.batch.prompts_per_step
        r = self.config.rollout
        meta = BatchMeta(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                         pad_token_id=tokenizer.pad_token_id, weight_version=weight_version, step=step)
        if self.loader is not None:
            return self.loader.batch(step, n, meta=meta)
        examples = self.task.examples(n, seed=self.config.seed, step=step)
        return prompt_batch(
            [p for p, _ in examples], tokenizer, group_ids=[step * n + i for i in range(n)],
            extras={"answer": [a for _, a in examples]}, meta=meta,
        )
