"""Algorithm parts: the protocols of advantage estimators, policy losses, KL estimators, loss
aggregation and value losses, the AlgorithmComponent record through which they are registered, and
the Preset record of a named algorithm (a value of ``algorithm.name``).

Every part is a pure function of TensorBatch fields (or of the tensors they hold) and a typed
config. Implementations of the built-in parts live in :mod:`verl_core.algorithms`; a third party
adds its own through the ``verl_algorithm_components`` hook, with the signature of its kind, and its
named algorithms through the ``verl_algorithm_presets`` hook:

========================  ==================================================================
kind                      signature of ``AlgorithmComponent.impl``
========================  ==================================================================
``advantage``             :class:`AdvantageEstimator`: ``(batch, config) -> batch`` with
                          ``advantages`` and ``returns``
``policy_loss``           :class:`PolicyLoss`: ``(log_probs, old_log_probs, advantages, mask,
                          config) -> PolicyLossTerms`` (per-token, not aggregated)
``kl``                    :class:`KLEstimator`: ``(log_probs, ref_log_probs) -> kl`` per token
``aggregation``           :class:`Aggregation`: ``(loss_mat, mask, stats, norm_length) -> scalar``
``value_loss``            :class:`ValueLoss`: ``(values, old_values, returns, mask, config) ->
                          ValueLossTerms`` (per-token)
========================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from torch import Tensor

from verl_core.kernel.errors import PluginError, check_str

if TYPE_CHECKING:
    from verl_core.kernel.batch import TensorBatch
    from verl_core.kernel.training import GlobalBatchStats

__all__ = [
    "Aggregation",
    "AdvantageEstimator",
    "AlgorithmComponent",
    "ComponentKind",
    "KLEstimator",
    "Need",
    "PolicyLoss",
    "PolicyLossTerms",
    "Preset",
    "ValueLoss",
    "ValueLossTerms",
]

ComponentKind = Literal["advantage", "policy_loss", "kl", "aggregation", "value_loss"]
"""The kinds of algorithm components that are registered by name."""


Need = Literal["critic", "reference", "groups", "greedy_baseline", "token_scores"]
"""What a component needs from the run besides the batch fields it reads: a trained ``critic``
(values), a ``reference`` policy (ref_log_probs), ``groups`` (several samples per prompt), a
``greedy_baseline`` (one greedy response per prompt, scored: ``baseline_scores``) or dense
per-token ``token_scores`` from the reward."""


@dataclass(frozen=True)
class AlgorithmComponent:
    """A named algorithm part, registered through the ``verl_algorithm_components`` hook.

    The trainer and the :class:`~verl_core.algorithms.Algorithm` bundle ask these declarations what a
    component reads and needs; nothing branches on a component's name. Build one with the typed
    constructor of its kind (:meth:`advantage`, :meth:`policy_loss`, :meth:`kl`,
    :meth:`aggregation`, :meth:`value_loss`), so the type checker checks ``impl``'s signature.

    Attributes:
        kind: What the component is.
        name: The name users select it by (unique per kind).
        impl: The function (its signature is fixed per kind; see the table in this module).
        config_class: Dataclass of its options, or None.
        doc: One line describing it.
        reads: Batch fields an advantage estimator reads (besides the rewards it is given).
        needs: What it needs from the run (:data:`Need`): the trainer builds and runs those
            engines and stages.
        outcome: An advantage estimator that reads only each sample's total reward: given
            sequence ``scores`` and no KL in the reward, it is handed ``scores`` directly and no
            ``[batch, response]`` token rewards are built.
    """

    kind: ComponentKind
    name: str
    impl: Callable[..., Any]
    config_class: type | None = None
    doc: str = ""
    reads: frozenset[str] = frozenset()
    needs: frozenset[Need] = frozenset()
    outcome: bool = False

    @classmethod
    def advantage(
        cls, name: str, impl: AdvantageEstimator, config_class: type | None, doc: str, *,
        reads: Iterable[str] = (), needs: Iterable[Need] = (), outcome: bool = False,
    ) -> AlgorithmComponent:
        """An advantage estimator and what it reads (``response_mask`` is always read)."""
        return cls("advantage", name, impl, config_class, doc,
                   frozenset({"response_mask", *reads}), frozenset(needs), outcome)

    @classmethod
    def policy_loss(
        cls, name: str, impl: PolicyLoss, config_class: type | None, doc: str, *, needs: Iterable[Need] = ()
    ) -> AlgorithmComponent:
        """A per-token policy loss."""
        return cls("policy_loss", name, impl, config_class, doc, needs=frozenset(needs))

    @classmethod
    def value_loss(cls, name: str, impl: ValueLoss, config_class: type | None, doc: str) -> AlgorithmComponent:
        """A per-token value loss (it needs a critic)."""
        return cls("value_loss", name, impl, config_class, doc, needs=frozenset({"critic"}))

    @classmethod
    def kl(cls, name: str, impl: KLEstimator, doc: str) -> AlgorithmComponent:
        """A per-token KL estimator (it needs the reference policy's log-probs)."""
        return cls("kl", name, impl, None, doc, needs=frozenset({"reference"}))

    @classmethod
    def aggregation(cls, name: str, impl: Aggregation, doc: str) -> AlgorithmComponent:
        """A loss aggregation mode."""
        return cls("aggregation", name, impl, None, doc)


_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class Preset:
    """One named algorithm, the value of a run's ``algorithm.name``: a record of names and values.

    Registered through the ``verl_algorithm_presets`` hook (verl-core's own table,
    ``verl_core.algorithms.presets.PRESET_TABLE``, through the same hook); the algorithms layer
    builds it (``verl_core.algorithms.presets.build_preset``) with the
    :class:`~verl_core.algorithms.Algorithm` constructor it names.

    Attributes:
        name: The value of ``algorithm.name`` (unique among the registered presets).
        constructor: The name of the :class:`Algorithm` classmethod that builds it (``ppo``,
            ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, ``remax``,
            ``gspo``, ``cispo``).
        fixed: Constructor arguments the preset sets (not options of the preset).
        defaults: Option defaults that differ from the constructor's.
        estimator: A registered advantage estimator that replaces the constructor's (a plugin's
            own, for example).
        dynamic_sampling: The trainer drops groups whose scores are all equal (DAPO).
        summary: One line for listings.
    """

    name: str
    constructor: str
    fixed: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    defaults: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    estimator: str | None = None
    dynamic_sampling: bool = False
    summary: str = ""

    def __post_init__(self) -> None:
        check_str(self.name, "Preset.name", error=PluginError)
        check_str(self.constructor, f"Preset {self.name!r}: constructor", error=PluginError)

    @property
    def is_recipe(self) -> bool:
        """True when the preset is another constructor's with changed defaults, estimator or sampling."""
        return bool(self.defaults) or self.estimator is not None or self.dynamic_sampling


@dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token output of a policy loss, before aggregation.

    Attributes:
        loss: ``[batch, response]`` loss of each token (carries autograd through ``log_probs``);
            values at masked positions are ignored by the aggregation.
        clipped: ``[batch, response]`` bool, True where the clip changed the objective.
        clipped_lower: ``[batch, response]`` bool, True where the dual clip (the lower bound for
            negative advantages) was active; all False for losses without one.
        log_ratio: ``[batch, response]`` detached ``log_probs - old_log_probs`` (for the
            ``ppo_kl`` metric).
    """

    loss: Tensor
    clipped: Tensor
    clipped_lower: Tensor
    log_ratio: Tensor


@dataclass(frozen=True)
class ValueLossTerms:
    """Per-token output of a value loss, before aggregation.

    Attributes:
        loss: ``[batch, response]`` loss of each token (carries autograd through ``values``).
        clipped: ``[batch, response]`` bool, True where the clipped prediction gave the larger loss.
    """

    loss: Tensor
    clipped: Tensor


class AdvantageEstimator(Protocol):
    """Turns a global batch with rewards into one with ``advantages`` and ``returns``."""

    def __call__(self, batch: TensorBatch, config: Any, /) -> TensorBatch:
        """Return ``batch`` updated with ``advantages`` and ``returns`` (float32, 0 where masked)."""
        ...


class PolicyLoss(Protocol):
    """A per-token policy objective (to minimise) of the current and the behaviour log-probs."""

    def __call__(
        self, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: Any, /
    ) -> PolicyLossTerms:
        """Per-token loss and clip indicators; gradients flow through ``log_probs`` only."""
        ...


class KLEstimator(Protocol):
    """An elementwise estimator of KL(pi || pi_ref) from sampled-token log-probs."""

    def __call__(self, log_probs: Tensor, ref_log_probs: Tensor, /) -> Tensor:
        """The per-token estimate (same shape as the inputs)."""
        ...


class Aggregation(Protocol):
    """Reduces a per-token loss to this micro-batch's share of the global loss."""

    def __call__(
        self, loss_mat: Tensor, mask: Tensor, stats: GlobalBatchStats, norm_length: int | None, /
    ) -> Tensor:
        """Scalar contribution, normalised by the global counts in ``stats``."""
        ...


class ValueLoss(Protocol):
    """A per-token critic objective."""

    def __call__(
        self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, config: Any, /
    ) -> ValueLossTerms:
        """Per-token loss and clip indicator; gradients flow through ``values`` only."""
        ...
