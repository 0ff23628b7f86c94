"""User reward functions as one reward engine: ``reward.functions`` and ``reward.weights``.

A reward function follows TRL's convention: it is called once per batch as
``fn(prompts=list[str], completions=list[str], **columns)`` and returns one number per completion.
``prompts`` and ``completions`` are the decoded prompt and response of every sample (special
tokens such as EOS dropped); ``completion_ids`` holds each response's token ids (EOS included when
one was generated) and ``truncated`` whether the response was cut at ``max_new_tokens`` without
EOS, so a function can tell ``"123"`` followed by EOS from a ``"123"`` that was cut off. Each other
keyword is a dataset column (a per-sample extra of the batch), holding that column's value for the
same samples in the same order (a prompt's ``n`` samples repeat its values). A function that names
only some keywords (``def f(completions, answer)``) gets just those; one with ``**kwargs`` gets all.
Each function gets lists of its own: one that edits ``completions`` or a column in place changes
nothing that the next function, the batch or the metrics see.

A batch of multi-turn episodes (``[agent]``) changes three keywords: ``completions`` and
``completion_ids`` are the episode's final model turn, and ``messages`` is its whole conversation
(:func:`verl_core.trainer.inputs.agent.episode_keywords`).

:class:`RewardFunctions` scores a batch with the weighted sum of the functions (and, optionally, of
a reward-model engine's scores); functions are named ``"module:function"`` or
``"path/to/file.py:function"``. Built-in functions live in :mod:`verl_core.trainer.inputs.reward_functions`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final

import torch

from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.capabilities import RewardCapabilities
from verl_core.kernel.convert import Check, check_fields
from verl_core.kernel.errors import ConfigError, RewardError, describe
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.tokenizer import Tokenizer
from verl_core.trainer.inputs.agent import EPISODE_EXTRAS, episode_keywords
from verl_core.trainer.inputs.usercode import import_object, split_spec

__all__ = [
    "MODEL_NAME",
    "SAMPLE_KEYWORDS",
    "FunctionReward",
    "RewardFn",
    "RewardFunctions",
    "RewardFunctionsConfig",
    "ScoreFn",
    "load_function",
]

RewardFn = Callable[..., Sequence[float]]
"""``fn(prompts=list[str], completions=list[str], **columns) -> one number per completion``."""

SAMPLE_KEYWORDS: Final = ("prompts", "completions", "completion_ids", "truncated")
"""Keywords every reward function is offered besides the dataset columns (which may not use these names)."""

MODEL_NAME: Final = "model"
"""Name of the reward-model engine's term in metrics and extras (``reward/model/mean``)."""


@dataclasses.dataclass(frozen=True)
class RewardFunctionsConfig:
    """Reward functions and their weights (the ``reward`` section of a run config).

    Attributes:
        functions: Each ``"module:function"`` (an importable module) or
            ``"path/to/file.py:function"`` (a Python file; a relative path is looked up in the
            config file's folder, then in the working directory), e.g. ``"verl_core.trainer.inputs.reward_functions:exact_match"``.
        weights: One weight per function (empty = 1.0 each); the score is the weighted sum.
        model_weight: Weight of the reward model's scores (``backends.reward`` other than
            ``rule``), with or without functions: the score is ``model_weight`` times the model's
            score plus the weighted functions (a negative weight flips the model's scores). The
            metric ``reward/model/mean`` is the model's own score, before the weight.
    """

    functions: list[str] = dataclasses.field(default_factory=list)
    weights: list[float] = dataclasses.field(default_factory=list)
    model_weight: Annotated[float, Check(math.isfinite, "any finite number (negative flips the scores)")] = 1.0

    def __post_init__(self) -> None:
        check_fields(self, prefix="reward.")
        for spec in self.functions:
            split_spec(spec, "reward function")
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"reward.weights has {len(self.weights)} values for {len(self.functions)} reward.functions; "
                "give one weight per function, or none (1.0 each)"
            )

    def resolved_weights(self) -> list[float]:
        """One weight per function (1.0 each when ``weights`` is empty)."""
        return [float(w) for w in self.weights] if self.weights else [1.0] * len(self.functions)


def load_function(spec: str, *, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable that ``"module:function"`` or ``"path/to/file.py:function"`` names.

    Resolved by :func:`verl_core.trainer.inputs.usercode.import_object`: a file is run once as a module
    and reused for every function taken from it.

    Args:
        spec: The import string.
        base_dir: Folder where relative file paths are looked up first (then the working directory).

    Raises:
        ConfigError: the module or file cannot be found or fails to import, it has no such
            attribute, or the attribute is not callable.
    """
    fn = import_object(spec, what="reward function", base_dir=base_dir)
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r} is a {type(fn).__name__}, not a callable")
    return fn  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class _Term:
    name: str
    fn: Callable[..., Any]
    weight: float
    accepts: frozenset[str] | None  # keywords the function takes; None = any (it has **kwargs)


def _accepted_keywords(name: str, fn: Callable[..., Any], columns: Sequence[str] | None) -> frozenset[str] | None:
    """The keywords ``fn`` takes (None = any); ConfigError when it cannot be called with them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"reward function {name!r}: cannot read its signature ({e}); wrap it in a Python function") from e
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    expected = "fn(prompts, completions, **columns)"
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        raise ConfigError(
            f"reward function {name!r} has positional-only parameters {positional_only}; it is called "
            f"with keywords as {expected}"
        )
    if "completions" not in named and not var_kw:
        raise ConfigError(
            f"reward function {name!r} has the signature {sig} and cannot take the keyword 'completions'; "
            f"expected {expected} (a **kwargs parameter takes the keywords it does not name)"
        )
    if columns is not None:
        offered = {*SAMPLE_KEYWORDS, *columns}
        missing = [
            p.name for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in offered
        ]
        if missing:
            raise ConfigError(
                f"reward function {name!r} requires {missing}, which are neither {', '.join(map(repr, SAMPLE_KEYWORDS))} "
                f"nor dataset columns ({', '.join(columns) or 'none'}); expected {expected}"
            )
    return None if var_kw else frozenset(named)


class RewardFunctions(RewardEngine):
    """A reward engine over user reward functions, optionally combined with a reward model.

    The score of a sample is ``sum_i weight_i * fn_i(...)[sample]`` plus ``model_weight *`` the
    reward model's score. The returned batch also carries each term's unweighted per-sample values
    as the extra ``reward/<name>`` (``<name>`` is the function's name, made unique with ``_2``,
    ``_3``... and ``model`` for the reward model); :meth:`metrics` turns them into
    ``reward/<name>/mean``. With the reward model alone (no functions) nothing is decoded, and the
    model's ``token_scores``, when it gives them, are passed on times ``model_weight`` (beside
    functions they are dropped: the functions give sequence scores only).

    Args:
        functions: Import strings (see :func:`load_function`) or callables.
        tokenizer: Decodes prompts and responses (the rollout engine's tokenizer).
        weights: One per function (default 1.0 each).
        model: A reward-model engine whose ``scores`` are added (e.g. from ``backends.reward``).
        model_weight: Weight of the model's scores.
        columns: The dataset's column names, when known: a function that requires a keyword that
            is none of them is refused at construction instead of at the first step.
        base_dir: Folder where relative file paths are looked up first (then the working directory).

    Raises:
        ConfigError: no function and no model; weights that do not match the functions or are not
            finite; a function that does not resolve, is not callable, or whose signature cannot
            take ``(prompts=, completions=, **columns)``.
    """

    def __init__(
        self,
        functions: Sequence[str | Callable[..., Any]],
        tokenizer: Tokenizer,
        *,
        weights: Sequence[float] | None = None,
        model: RewardEngine | None = None,
        model_weight: float = 1.0,
        columns: Sequence[str] | None = None,
        base_dir: str | Path | None = None,
    ) -> None:
        if not functions and model is None:
            raise ConfigError("RewardFunctions needs at least one reward function or a reward model")
        weights = [1.0] * len(functions) if weights is None else list(weights)
        if len(weights) != len(functions):
            raise ConfigError(
                f"{len(weights)} reward weights for {len(functions)} reward functions; give one weight per function"
            )
        for w in [*weights, model_weight]:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise ConfigError(f"reward weights must be finite numbers, got {w!r}")
        self._terms: list[_Term] = []
        used = {MODEL_NAME} if model is not None else set()
        for spec, weight in zip(functions, weights):
            fn = load_function(spec, base_dir=base_dir) if isinstance(spec, str) else spec
            label = spec if isinstance(spec, str) else getattr(fn, "__qualname__", repr(fn))
            if not callable(fn):
                raise ConfigError(f"reward function {label!r} is a {type(fn).__name__}, not a callable")
            accepts = _accepted_keywords(label, fn, columns)
            name = base = str(getattr(fn, "__name__", "fn"))
            k = 2
            while name in used:
                name, k = f"{base}_{k}", k + 1
            used.add(name)
            self._terms.append(_Term(name, fn, float(weight), accepts))
        self._tokenizer = tokenizer
        self._model = model
        self._model_weight = float(model_weight)
        if self._terms or model is None:
            self._caps = RewardCapabilities(needs_text=True)
        else:  # the model alone: what it gives
            inner = model.capabilities
            self._caps = RewardCapabilities(token_scores=inner.token_scores, needs_text=inner.needs_text,
                                            devices=inner.devices)

    @classmethod
    def from_config(
        cls,
        config: RewardFunctionsConfig,
        tokenizer: Tokenizer,
        *,
        model: RewardEngine | None = None,
        columns: Sequence[str] | None = None,
        base_dir: str | Path | None = None,
    ) -> RewardFunctions:
        """The engine of a ``reward`` config section (plus an optional reward model)."""
        return cls(
            config.functions, tokenizer, weights=config.resolved_weights(), model=model,
            model_weight=config.model_weight, columns=columns, base_dir=base_dir,
        )

    @property
    def capabilities(self) -> RewardCapabilities:
        """Sequence scores from text (with the reward model alone: the model's capabilities)."""
        return self._caps

    @property
    def names(self) -> list[str]:
        """The terms' names as they appear in extras and metrics (functions, then ``model``)."""
        return [t.name for t in self._terms] + ([MODEL_NAME] if self._model is not None else [])

    def score(self, batch: TensorBatch) -> TensorBatch:
        """Decode every sample, call each function once on the whole batch, and sum the weighted terms
        (with the reward model alone: its scores times ``model_weight``, nothing decoded).

        Raises:
            RewardError: a function raised, or returned a wrong number of values, a value that is
                not a number, NaN or inf (naming the function and the sample index), or the reward
                model returned no ``scores``.
        """
        batch.require("prompt_ids", "prompt_mask", "response_ids", "response_mask", where="RewardFunctions.score")
        size = batch.batch_size
        total = [0.0] * size
        extras: dict[str, list[float]] = {}
        if self._terms:
            total = self._functions(batch, extras)
        token_scores = None
        if self._model is not None:
            scored = self._model.score(batch)
            if "scores" not in scored:
                raise RewardError("the reward model returned no 'scores'; RewardFunctions combines sequence scores")
            values = [float(v) for v in scored["scores"].detach().float().cpu().tolist()]
            extras[f"reward/{MODEL_NAME}"] = values
            total = [t + self._model_weight * v for t, v in zip(total, values)]
            if not self._terms and "token_scores" in scored:
                token_scores = (self._model_weight * scored["token_scores"].float()).to(batch.device)
        for i, v in enumerate(total):
            # finite terms can still overflow when weighted and summed, or beyond float32, the scores' dtype
            if not math.isfinite(v) or abs(v) > _FLOAT32_MAX:
                raise RewardError(
                    f"the weighted reward of sample {i} is {v}, beyond the float32 range of the scores "
                    f"(|x| <= {_FLOAT32_MAX:.4g}); lower the reward weights or the values of {', '.join(self.names)}"
                )
        scores = torch.tensor(total, dtype=torch.float32, device=batch.device)
        if token_scores is not None:
            return batch.update(scores=scores, token_scores=token_scores, extras=extras)
        return batch.update(scores=scores, extras=extras)

    def _functions(self, batch: TensorBatch, extras: dict[str, list[float]]) -> list[float]:
        """The weighted sum of the functions' values of each sample; each function's values go to ``extras``."""
        prompts = self._decode(_rows(batch["prompt_ids"], batch["prompt_mask"]))
        completion_ids = _rows(batch["response_ids"], batch["response_mask"])
        completions = self._decode(completion_ids)
        if "truncated" in batch:
            truncated = [bool(t) for t in batch["truncated"].cpu().tolist()]
        else:  # a batch scored outside a rollout: a response is complete when it ends with EOS
            eos = self._tokenizer.eos_token_id
            truncated = [not ids or ids[-1] != eos for ids in completion_ids]
        episodes = episode_keywords(batch)  # multi-turn: the final turn, and messages= (None: single-turn)
        columns = {k: v for k, v in batch.extras.items()
                   if not k.startswith("reward/") and (episodes is None or k not in EPISODE_EXTRAS)}
        sample: dict[str, list[Any]] = {
            "prompts": prompts, "completions": completions, "completion_ids": completion_ids, "truncated": truncated,
            **(episodes or {}),
        }
        size = batch.batch_size
        total = [0.0] * size
        for term in self._terms:
            values = self._call(term, sample, columns, size)
            extras[f"reward/{term.name}"] = values
            total = [t + term.weight * v for t, v in zip(total, values)]
        return total

    @staticmethod
    def metrics(batch: TensorBatch) -> dict[str, float]:
        """``reward/<name>/mean`` of each term of a batch scored by :meth:`score`."""
        out = {}
        for key, values in batch.extras.items():
            if key.startswith("reward/") and values:
                out[f"{key}/mean"] = float(sum(values) / len(values))
        return out

    def close(self) -> None:
        """Close the reward-model engine, when there is one (the functions hold nothing to release)."""
        close = getattr(self._model, "close", None)
        if callable(close):
            close()

    def _decode(self, rows: list[list[int]]) -> list[str]:
        texts: list[str] = []
        cache: dict[tuple[int, ...], str] = {}  # a prompt's n samples share its text
        for row in rows:
            toks = tuple(row)
            if toks not in cache:
                cache[toks] = self._tokenizer.decode(toks)
            texts.append(cache[toks])
        return texts

    @staticmethod
    def _call(
        term: _Term, sample: Mapping[str, Sequence[Any]], columns: Mapping[str, Sequence[Any]], size: int
    ) -> list[float]:
        # copies of its own: a function that edits its inputs in place changes nothing the next one gets
        ids = sample.get("completion_ids")  # lists of ints (_rows): copied without a check of each element
        kwargs = {k: [list(row) for row in v] if v is ids else _own_copy(v) for k, v in {**sample, **columns}.items()
                  if term.accepts is None or k in term.accepts}
        try:
            out = term.fn(**kwargs)
        except Exception as e:
            raise RewardError(
                f"reward function {term.name!r} raised {type(e).__name__}: {e} (scoring {size} samples; "
                f"keywords {sorted(kwargs)})"
            ) from e
        if hasattr(out, "tolist"):  # a tensor or NumPy array
            try:
                out = out.tolist()
            except Exception as e:
                raise RewardError(
                    f"reward function {term.name!r} returned {describe(out)}, whose tolist() raised "
                    f"{type(e).__name__}: {e}; expected a list of {size} numbers (one per completion)"
                ) from e
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise RewardError(
                f"reward function {term.name!r} returned {type(out).__name__}; expected a list of {size} numbers "
                "(one per completion)"
            )
        if len(out) != size:
            raise RewardError(
                f"reward function {term.name!r} returned {len(out)} values for {size} completions; expected one each"
            )
        values = []
        for i, v in enumerate(out):
            if not isinstance(v, numbers.Real):
                raise RewardError(
                    f"reward function {term.name!r} returned {describe(v)} for sample {i}; expected a number"
                )
            try:
                f = float(v)
            except (OverflowError, ValueError, TypeError) as e:  # an int beyond the float range, a broken __float__
                raise RewardError(
                    f"reward function {term.name!r} returned {describe(v)} for sample {i}, which is not a float "
                    f"({type(e).__name__}: {e}); rewards must be finite numbers"
                ) from e
            if not math.isfinite(f):
                raise RewardError(f"reward function {term.name!r} returned {f} for sample {i}; rewards must be finite")
            values.append(f)
        return values


ScoreFn = Callable[[str, str, Mapping[str, Any]], float]
"""``fn(prompt_text, response_text, extras_of_the_sample) -> score``."""


class FunctionReward(RewardFunctions):
    """A reward engine over one per-sample scoring function: :class:`RewardFunctions` of one term.

    Each sample's prompt and response are decoded (special tokens such as EOS dropped) and scored
    one by one; the scores are the function's values.

    Args:
        fn: Scoring function ``fn(prompt, response, extras) -> float``; ``extras`` holds the
            sample's per-sample extras (e.g. ``{"answer": "42"}``).
        tokenizer: Decodes prompt and response ids.

    Raises:
        RewardError: (from :meth:`score`) the function raised or returned a value that is not a
            finite number, naming the sample.
    """

    def __init__(self, fn: ScoreFn, tokenizer: Tokenizer) -> None:
        def per_sample(prompts: list[str], completions: list[str], completion_ids: Any, truncated: Any,
                       **columns: list[Any]) -> list[float]:
            return [fn(p, c, {k: v[i] for k, v in columns.items()})
                    for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]

        per_sample.__name__ = str(getattr(fn, "__name__", "fn"))
        super().__init__([per_sample], tokenizer)


_ATOMIC: Final = (str, bytes, int, float, bool, type(None))
_FLOAT32_MAX: Final = float(torch.finfo(torch.float32).max)


def _own_copy(values: Sequence[Any]) -> list[Any]:
    """A copy of ``values`` that shares no mutable object with it (lists of numbers and strings cheaply).

    An element that cannot be deep-copied is passed on as it is.
    """
    out: list[Any] = []
    for v in values:
        if type(v) in _ATOMIC:
            out.append(v)
        elif type(v) is list and all(type(x) in _ATOMIC for x in v):
            out.append(list(v))  # token ids
        else:
            try:
                out.append(copy.deepcopy(v))
            except Exception:  # e.g. an object holding a lock
                out.append(v)
    return out


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The ids of each row where the mask is True."""
    mask = mask.cpu().bool()
    kept: list[int] = ids.cpu()[mask].tolist()  # row after row
    ends = mask.sum(dim=1).cumsum(0).tolist()
    return [kept[start:end] for start, end in zip([0, *ends[:-1]], ends)]
