"""The harness a check runs against: the backend(s) under test, tiny models, specs and helpers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Final, NoReturn, TypeVar

import torch
from torch import Tensor

from verl_conformance.errors import CheckFailed, CheckSkipped
from verl_conformance.testkit import (
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    ROPE_SCALINGS,
    TinyModelSpec,
    absolute_position_model,
    bfloat16_norm_model,
    bfloat16_norm_reward_model,
    config_constants_model,
    eos_model,
    folder_defaults_model,
    headless_reward_model,
    long_rope_model,
    nan_reward_model,
    omitted_keys_model,
    other_activation_model,
    out_of_vocab_file_model,
    out_of_vocab_model,
    perturbed_absolute_position_model,
    perturbed_model,
    random_batch,
    rope_scaled_model,
    sharded_model,
    sliding_window_model,
    tiny_model,
    tolerance,
    two_label_reward_model,
    value_bias_model,
    windowless_sliding_model,
    without_folders,
)
from verl_conformance.timelimit import DEFAULT_CHECK_TIMEOUT_S
from verl_core import (
    ConfigError,
    EngineSpec,
    OptimConfig,
    ReplayBuffer,
    RewardEngine,
    Role,
    RolloutEngine,
    StreamWeightSync,
    TensorBatch,
    TrainingEngine,
    WeightChunk,
    WeightCommit,
    WeightManifest,
    WeightMessage,
    WeightSync,
)
from verl_core.kernel.engine import ROLES
from verl_core.kernel.registry import InstalledBackend

__all__ = [
    "MODELS",
    "SUITE_OPTIM",
    "BufferFactory",
    "BufferSubject",
    "EngineCache",
    "EngineFactory",
    "Harness",
    "Subject",
    "collect_stream",
    "exported_weights",
    "recover_grads",
    "weights_moved",
]

EngineFactory = Callable[[EngineSpec], Any]
"""Builds an engine from an EngineSpec (the registry's, or a third party's own)."""

_E = TypeVar("_E")

BFLOAT16_RUN: Final = "verl conformance NAME --dtype bfloat16, or pytest --verl-dtype bfloat16"
"""How a user runs the whole suite in bfloat16 (skip reasons of the bfloat16-only checks name it)."""

SUITE_OPTIM: Final = OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0)
"""AdamW whose first update is ``-lr * g / (|g| + eps)``: invertible, so one step's weight change
recovers the gradient exactly (see :func:`recover_grads`), and well conditioned over a few steps."""

MODELS: Final[dict[str, TinyModelSpec]] = {
    "llama": TinyModelSpec(),
    "llama-tied": TinyModelSpec(tied=True),
    "qwen2": TinyModelSpec(arch="qwen2"),
    "qwen3-tied": TinyModelSpec(arch="qwen3", tied=True),
    "llama-alt": TinyModelSpec(seed=1),
    "value": TinyModelSpec(head="value"),
    "reward": TinyModelSpec(head="reward"),
}
"""The test kit's tiny models the suite uses, by short name (``llama-alt``: same shapes, other weights)."""

BufferFactory = Callable[..., ReplayBuffer]
"""Builds a replay buffer from the keyword arguments ``capacity`` (most samples held, or None),
``memory_samples`` (most samples kept in memory before older ones spill to disk, or None) and
``spill_dir`` (the folder of the disk tier, or None): the signature of
:class:`verl_core.trainer.batching.replay.HybridReplayBuffer`, which is a factory as it is."""


@dataclass(frozen=True)
class BufferSubject:
    """A replay buffer implementation under test (the ``buffer`` area).

    Attributes:
        name: Label for reports.
        make: Builds a buffer (see :data:`BufferFactory`).
        disk_tier: Whether the buffer spills to ``spill_dir`` past ``memory_samples`` (False: the
            spill check is skipped, and ``memory_samples`` is never passed).
    """

    name: str
    make: BufferFactory
    disk_tier: bool = True

CRAFTED: Final[dict[str, Callable[[], Any]]] = {
    "eos": eos_model,
    "gpt2": absolute_position_model,
    "llama-longrope": long_rope_model,
    "llama-constants": config_constants_model,
    "qwen2-constants": lambda: config_constants_model(MODELS["qwen2"]),
    "qwen3-constants": lambda: config_constants_model(TinyModelSpec(arch="qwen3")),
    "llama-gelu": other_activation_model,
    "llama-sharded": sharded_model,
    "llama-omitted-keys": partial(omitted_keys_model, "llama"),
    "qwen3-omitted-keys": partial(omitted_keys_model, "qwen3"),
    "qwen2-sliding": sliding_window_model,
    "qwen2-sliding-windowless": windowless_sliding_model,
    "llama-bf16-norm": bfloat16_norm_model,
    # its reward-model variant: a score head reading the attention output
    "reward-bf16-norm": bfloat16_norm_reward_model,
    "reward-nan": nan_reward_model,
    "reward-headless": headless_reward_model,
    "reward-two-labels": two_label_reward_model,
    # the Qwen reward folders with every tensor moved: in a random folder Qwen2's q/k/v biases are zeros
    # and every norm weight (Qwen3's q/k norms too) is one, which an engine that leaves them out computes
    "reward-qwen2": lambda: perturbed_model(TinyModelSpec(arch="qwen2", head="reward"), 1),
    "reward-qwen3": lambda: perturbed_model(TinyModelSpec(arch="qwen3", head="reward"), 1),
    **{f"llama-rope-{kind}": partial(rope_scaled_model, kind) for kind in ROPE_SCALINGS},
    "llama-perturbed-a": lambda: perturbed_model(MODELS["llama"], 1),
    "llama-perturbed-b": lambda: perturbed_model(MODELS["llama"], 2),
    # the causal-LM Qwen folders with every tensor moved, for the same reason as the reward ones: the forward
    # checks of each family (llama-perturbed-a is the Llama one)
    "qwen2-perturbed": lambda: perturbed_model(MODELS["qwen2"], 1),
    "qwen3-tied-perturbed": lambda: perturbed_model(MODELS["qwen3-tied"], 1),
    "qwen2-tied-perturbed": lambda: perturbed_model(TinyModelSpec(arch="qwen2", tied=True), 1),
    # the value-head folders of the Qwen families with every tensor moved: a critic's q/k/v biases and
    # norm weights (Qwen3's q/k norms too), which a random folder holds at zeros and ones
    "value-qwen2-perturbed": lambda: perturbed_model(TinyModelSpec(arch="qwen2", head="value"), 1),
    "value-qwen3-perturbed": lambda: perturbed_model(TinyModelSpec(arch="qwen3", head="value"), 1),
    "gpt2-perturbed": lambda: perturbed_absolute_position_model(1),
    # the value-head folder with score.bias 0.5: a random folder's is 0, which a critic that never loads it computes
    "value-biased": value_bias_model,
    **{f"llama-oov-{key}": partial(out_of_vocab_model, key) for key in OUT_OF_VOCAB_IDS},
    **{f"reward-oov-{key}": partial(out_of_vocab_model, key, "reward") for key in OUT_OF_VOCAB_IDS},
    # config.json right, the tokenizer's EOS or generation_config.json's EOS past the vocabulary
    **{f"llama-oov-{name}": partial(out_of_vocab_file_model, name) for name in OUT_OF_VOCAB_FILES},
    # further EOS ids listed in config.json and generation_config.json, and generation_config.json's sampling
    # defaults: not stops, not sampling settings (a rollout follows the tokenizer's EOS and SamplingParams)
    "eos-folder-defaults": partial(folder_defaults_model, "eos"),
    "llama-folder-defaults": partial(folder_defaults_model, "llama"),
    **{f"reward-oov-{name}": partial(out_of_vocab_file_model, name, "reward") for name in OUT_OF_VOCAB_FILES},
}
"""The test kit's crafted folders (:mod:`verl_conformance.testkit.crafted`) by short name."""

MAX_PROMPT: Final = 12
MAX_RESPONSE: Final = 12


@dataclass
class Subject:
    """One backend under test.

    Attributes:
        name: Backend name (registry name, or a label for fixture-supplied factories).
        make_training: Builds training engines (None: the backend has none).
        make_rollout: Builds rollout engines (None: the backend has none).
        roles: Roles the backend provides: an installed backend's ``BackendSpec.roles``, or those
            declared with factories (None: every role a factory is given for).
        version: Distribution and version, for reports.
        registered: True when built through verl_core's registry (so ``verl_*`` hooks apply).
        make_reward: Builds reward engines (None: the backend has none).
        dtypes: The dtypes each role declares (``capabilities.dtypes``), known before an engine is
            built for an installed backend (None: learnt from each engine).
    """

    name: str
    make_training: EngineFactory | None
    make_rollout: EngineFactory | None
    roles: frozenset[str] | None = None
    version: str = ""
    registered: bool = False
    make_reward: EngineFactory | None = None
    dtypes: Mapping[str, frozenset[str]] | None = None

    @classmethod
    def from_registry(cls, name: str) -> Subject:
        """The installed backend ``name`` (raises the registry's error listing installed ones)."""
        from verl_core import (
            get_backend,
            get_reward_engine,
            get_rollout_engine,
            get_training_engine,
        )

        backend = get_backend(name)
        roles = declared_roles(backend)
        training = bool(roles & {"actor", "reference", "critic"})

        def make_training(spec: EngineSpec) -> TrainingEngine:
            return get_training_engine(name, spec)

        def make_rollout(spec: EngineSpec) -> RolloutEngine:
            return get_rollout_engine(name, spec)

        def make_reward(spec: EngineSpec) -> RewardEngine:
            return get_reward_engine(name, spec)

        return cls(
            name=name,
            make_training=make_training if training else None,
            make_rollout=make_rollout if "rollout" in roles else None,
            roles=roles,
            version=f"{backend.distribution} {backend.version}",
            registered=True,
            make_reward=make_reward if "reward" in roles else None,
            dtypes=declared_dtypes(backend),
        )

    @classmethod
    def from_factories(
        cls,
        name: str,
        make_training: EngineFactory | None = None,
        make_rollout: EngineFactory | None = None,
        make_reward: EngineFactory | None = None,
        *,
        roles: Collection[str] | None = None,
    ) -> Subject:
        """Engines given as factories (a backend that is not installed, or not through the registry).

        Args:
            name: Label for reports.
            make_training: Builds the engines of the roles actor, reference and critic.
            make_rollout: Builds rollout engines.
            make_reward: Builds reward engines.
            roles: The roles the factories provide, as a backend's ``BackendSpec.roles`` declares
                them: a role left out skips its checks with the reason, as for an installed
                backend. None: when ``name`` is an installed backend, the roles its
                ``BackendSpec`` declares (:func:`declared_roles`, as for the installed route) that a
                factory given builds; otherwise every role of each factory given (actor,
                reference and critic with ``make_training``).

        Raises:
            ValueError: a role that verl does not know, or a role without the factory that builds it.
        """
        factories = {"rollout": make_rollout, "reward": make_reward}

        def built(role: str) -> bool:
            return factories.get(role, make_training) is not None

        declared: frozenset[str] | None = None
        if roles is None:
            installed = _installed(name)
            if installed is not None:
                declared = frozenset(r for r in declared_roles(installed) if built(r))
        else:
            if isinstance(roles, str):
                raise ValueError(f"roles must be a collection of role names, got the string {roles!r}; "
                                 f"write roles=[{roles!r}]")
            declared = frozenset(roles)
            unknown = sorted(declared - set(ROLES))
            if unknown:
                raise ValueError(f"roles {unknown} are not verl roles; roles: {', '.join(ROLES)}")
            missing = sorted(r for r in declared if not built(r))
            if missing:
                keyword = {"rollout": "make_rollout_engine", "reward": "make_reward_engine"}
                needs = sorted({keyword.get(r, "make_training_engine") for r in missing})
                raise ValueError(f"roles {missing} are declared but no factory builds them: pass "
                                 f"{' and '.join(needs)}, or leave those roles out")
        return cls(name, make_training, make_rollout, roles=declared, make_reward=make_reward)

    @property
    def key(self) -> str:
        """Cache key of the subject's engines."""
        if self.registered:
            return f"registry:{self.name}"
        parts = [self.name]
        for f in (self.make_training, self.make_rollout, self.make_reward):
            parts.append("-" if f is None else f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', id(f))}")
        return "|".join(parts)


def declared_roles(backend: InstalledBackend) -> frozenset[str]:
    """The roles an installed backend provides: those its ``BackendSpec.roles`` declares (the one
    source of both routes: the installed backend, and factories checked under its name)."""
    return frozenset(backend.spec.roles)


def declared_dtypes(backend: InstalledBackend) -> dict[str, frozenset[str]]:
    """The dtypes each role of an installed backend declares (``capabilities.dtypes``; a role
    whose capabilities have no dtypes, a reward engine's, is left out)."""
    return {role: frozenset(dtypes) for role in sorted(declared_roles(backend))
            if (dtypes := getattr(backend.capabilities(role), "dtypes", None)) is not None}  # type: ignore[arg-type]


def _installed(name: str) -> InstalledBackend | None:
    """The installed backend ``name``, or None when none of that name is installed (or it cannot load)."""
    from verl_core import VerlError, get_backend

    try:
        return get_backend(name)
    except VerlError:
        return None


class EngineCache:
    """Engines shared by checks that do not change them (built once per session)."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, str], Any] = {}

    def get(self, key: tuple[str, str], build: Callable[[], Any]) -> Any:
        """The cached engine for ``key``, built on first use."""
        if key not in self._engines:
            self._engines[key] = build()
        return self._engines[key]

    def drop(self, key: tuple[str, str]) -> None:
        """Forget (and close) one engine, e.g. after a check left it in an unknown state."""
        engine = self._engines.pop(key, None)
        if engine is not None:
            _close(engine)

    def close(self) -> None:
        """Close every cached engine."""
        for engine in self._engines.values():
            _close(engine)
        self._engines.clear()


def _close(engine: Any) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


@dataclass
class Harness:
    """What a check sees: the subject, an optional second backend, caches and helpers.

    Attributes:
        subject: The backend under test.
        against: A second backend for differential checks (``--verl-against``), or None.
        cache: Shared engines.
        dtype: Parameter dtype of every engine the suite builds (selects the tolerance tier).
        device: Device of every engine the suite builds (``cpu``, ``cuda``).
        options: Backend options given to every engine of the subject (``--verl-options``); a
            check's own options win.
        buffer: The replay buffer implementation the ``buffer`` area checks, or None.
        time_limit_s: Seconds one check may run before it fails (None: no limit); see
            :mod:`verl_conformance.timelimit`.
        notes: What the running check reports on a pass (see :meth:`note`).
    """

    subject: Subject
    against: Subject | None = None
    cache: EngineCache = field(default_factory=EngineCache)
    dtype: str = "float32"
    device: str = "cpu"
    options: Mapping[str, Any] = field(default_factory=dict)
    buffer: BufferSubject | None = None
    time_limit_s: float | None = DEFAULT_CHECK_TIMEOUT_S
    notes: list[str] = field(default_factory=list)
    _fresh: list[Any] = field(default_factory=list)

    # ------------------------------------------------------------------ outcome helpers
    @staticmethod
    def skip(reason: str) -> NoReturn:
        """Skip the running check, saying why."""
        raise CheckSkipped(reason)

    @staticmethod
    def fail(message: str) -> NoReturn:
        """Fail the running check with a message that points at the fault."""
        raise CheckFailed(message)

    def note(self, text: str) -> None:
        """Report ``text`` with the running check's pass (e.g. what it compared and what the backend
        refused): the message of its result in the report's table and JSON."""
        self.notes.append(text)

    def unless_refused(self, build: Callable[[], _E], *, kind: str, what: str, model_type: str) -> _E | None:
        """``build()``, or None where it raises a ConfigError naming ``model_type`` (a model family the
        engine refuses, which the calling check lists as refused). Fails on a ConfigError that does
        not name it and on any other error, naming the ``kind`` of engine ("rollout", "training",
        "reward") and the folder (``what``)."""
        try:
            return build()
        except ConfigError as e:
            self.expect(model_type in without_folders(str(e)).lower(),
                        f"the {kind} engine refused the folder {what} with a ConfigError that does not name the "
                        f"model_type {model_type!r}: {e}; load the folder, or say which model_type is not supported")
            return None
        except (CheckFailed, CheckSkipped):
            raise
        except Exception as e:
            self.fail(f"building the {kind} engine on the folder {what} raised {type(e).__name__}: {e}; load it, or "
                      "refuse its model_type with verl_core.ConfigError")

    def expect(self, condition: bool, message: str) -> None:
        """Fail with ``message`` unless ``condition`` holds."""
        if not condition:
            self.fail(message)

    def close_fresh(self) -> None:
        """Close the engines a check built for itself."""
        for engine in self._fresh:
            _close(engine)
        self._fresh.clear()

    # ------------------------------------------------------------------ models and specs
    @staticmethod
    def model_path(name: str = "llama") -> str:
        """Folder of the suite model ``name`` (see :data:`MODELS` and :data:`CRAFTED`)."""
        return str(CRAFTED[name]()) if name in CRAFTED else str(tiny_model(MODELS[name]))

    def spec(self, role: Role, model: str = "llama", **kw: Any) -> EngineSpec:
        """The EngineSpec the suite builds engines from (tiny limits, the suite's optimizer)."""
        base: dict[str, Any] = {
            "model_path": self.model_path(model), "role": role, "dtype": self.dtype, "device": self.device, "seed": 0,
            "max_prompt_len": MAX_PROMPT, "max_response_len": MAX_RESPONSE, "optim": SUITE_OPTIM,
        }
        base.update(kw)
        return EngineSpec(**base)

    @staticmethod
    def _maker(subject: Subject, role: Role) -> EngineFactory | None:
        return {"rollout": subject.make_rollout, "reward": subject.make_reward}.get(role, subject.make_training)

    def _factory(self, subject: Subject, role: Role) -> EngineFactory:
        f = self._maker(subject, role)
        if f is None or (subject.roles is not None and role not in subject.roles):
            kind = {"rollout": "rollout engine", "reward": "reward engine"}.get(role, f"training engine for role {role!r}")
            self.skip(f"backend {subject.name!r} provides no {kind}")
        return f

    def training(self, role: Role = "actor", model: str = "llama", *, fresh: bool = False,
                 subject: Subject | None = None, causal_folder: bool = False, **kw: Any) -> TrainingEngine:
        """A training engine of the subject (``fresh``: built for this check and closed after it).

        A critic is built on the value-head folder unless ``causal_folder`` (then on ``model``'s
        causal-LM folder, as the trainer builds PPO's critic on the policy's folder).
        """
        if role == "critic" and model == "llama" and not causal_folder:
            model = "value"
        return self._engine(subject or self.subject, self.spec(role, model, **kw), fresh)  # type: ignore[no-any-return]

    def rollout(self, model: str = "llama", *, fresh: bool = False, subject: Subject | None = None,
                **kw: Any) -> RolloutEngine:
        """A rollout engine of the subject."""
        return self._engine(subject or self.subject, self.spec("rollout", model, **kw), fresh)  # type: ignore[no-any-return]

    def reward(self, model: str = "reward", *, fresh: bool = False, subject: Subject | None = None,
               **kw: Any) -> RewardEngine:
        """A reward engine of the subject (on the test kit's reward-model folder by default)."""
        return self._engine(subject or self.subject, self.spec("reward", model, **kw), fresh)  # type: ignore[no-any-return]

    def _engine(self, subject: Subject, spec: EngineSpec, fresh: bool) -> Any:
        factory = self._factory(subject, spec.role)
        declared = None if subject.dtypes is None else subject.dtypes.get(spec.role)
        if spec.dtype == self.dtype and declared is not None and self.dtype not in declared:
            self.skip(f"backend {subject.name!r} declares dtypes {sorted(declared)} for its {spec.role} engine "
                      f"(capabilities.dtypes); this run builds engines in {self.dtype} (--verl-dtype)")
        if self.options and subject is self.subject:
            spec = replace(spec, options={**self.options, **spec.options})
        try:
            if fresh:
                engine = factory(spec)
                self._fresh.append(engine)
                return engine
            return self.cache.get((subject.key, repr(spec)), lambda: factory(spec))
        except ConfigError as e:
            self._roles_note(subject, spec.role, e)
            raise

    def _roles_note(self, subject: Subject, role: Role, error: ConfigError) -> None:
        """Add to a refusal of the training factory the way to declare the roles it provides.

        Only where the roles were not declared (factories not checked under an installed
        backend's name, no ``roles=``): the factory is then taken to build every training role.
        """
        if subject.registered or subject.roles is not None or role not in ("actor", "reference", "critic"):
            return
        others = [r for r in ROLES if r != role and self.provides(subject, r)]
        error.add_note(
            f"if backend {subject.name!r} has no {role} engine, pass roles={others!r} to check_backend (or a "
            f"provided_roles fixture under pytest) to skip the roles your backend does not provide"
        )

    def provides(self, subject: Subject, role: Role) -> bool:
        """Whether ``subject`` can build an engine of ``role``."""
        f = self._maker(subject, role)
        return f is not None and (subject.roles is None or role in subject.roles)

    def sync_pair(self) -> tuple[Subject, Subject]:
        """The backends of a trainer-to-rollout sync: the subject's actor and rollout, a missing one
        taken from the ``--against`` backend; skips the check when neither provides it."""
        src = dst = self.subject
        if not self.provides(src, "actor") and self.against is not None and self.provides(self.against, "actor"):
            src = self.against
        if not self.provides(dst, "rollout") and self.against is not None and self.provides(self.against, "rollout"):
            dst = self.against
        for subject, role, kind in ((src, "actor", "training"), (dst, "rollout", "rollout")):
            if not self.provides(subject, role):  # type: ignore[arg-type]
                self.skip(f"backend {self.subject.name!r} provides no {kind} engine and no second backend provides "
                          f"one: pass --against NAME to `verl conformance` (--verl-against NAME to pytest, against= "
                          f"to check_backend) to pair it with another backend's {kind} engine")
        return src, dst

    def trainer_syncs(self, src: Subject, dst: Subject) -> list[WeightSync]:
        """The sync a trainer uses from ``src``'s actor to ``dst``'s rollout (the pair's registered
        direct sync), then the stream every pair falls back to; the stream alone for factories."""
        syncs: list[WeightSync] = [StreamWeightSync()]
        if src.registered and dst.registered:
            from verl_core import get_weight_sync

            direct = get_weight_sync(src.name, dst.name)
            if type(direct) is not StreamWeightSync:
                syncs.insert(0, direct)
        return syncs

    def trained_role(self) -> Role:
        """The training role the checks of training in general build: the actor when the subject
        provides one, else its critic (a critic-only backend's checkpoints, micro-batching and input
        checks are held too), else the actor (whose check then skips: no training engine)."""
        if self.provides(self.subject, "actor") or not self.provides(self.subject, "critic"):
            return "actor"
        return "critic"

    def trained_roles(self) -> list[Role]:
        """The training roles the checks of training state, micro-batching and the optimizer hold:
        :meth:`trained_role`, and beside an actor the critic where the subject provides one whose
        engine declares ``values`` (a critic that this run cannot build, as one that does not
        declare the suite's dtype, is left out with a note on the check's pass)."""
        role = self.trained_role()
        if role != "actor" or not self.provides(self.subject, "critic"):
            return [role]
        try:
            values = self.training("critic").capabilities.values
        except CheckSkipped as e:
            self.note(f"the critic is not checked here: {e}")
            return [role]
        if not values:
            self.note("the critic declares values=False (no value head): the actor alone is checked")
            return [role]
        return [role, "critic"]

    def require_against(self) -> Subject:
        """The second backend, or skip when none was given."""
        if self.against is None:
            self.skip("no second backend: pass --against NAME to `verl conformance`, --verl-against NAME to "
                      "pytest, or against= to check_backend")
        return self.against

    def require_buffer(self) -> BufferSubject:
        """The replay buffer under test, or skip when none was given."""
        if self.buffer is None:
            self.skip("no replay buffer selected: pass pytest's --verl-buffer MODULE:FACTORY (the `verl conformance` "
                      "command has no buffer option), or use check_buffer")
        return self.buffer

    # ------------------------------------------------------------------ data
    def batch(self, *, seed: int = 0, batch_size: int = 6, temperature: float = 1.0,
              empty: int = 1, rl_fields: bool = False, max_prompt: int = 8,
              max_response: int = 8, group_size: int = 1) -> TensorBatch:
        """A ragged, correctly padded batch for the test kit's tokenizer (one empty response)."""
        b = random_batch(batch_size=batch_size, max_prompt=max_prompt, max_response=max_response,
                         seed=seed, temperature=temperature, empty_responses=empty,
                         with_rl_fields=rl_fields, group_size=group_size)
        if rl_fields:  # keep only fields a policy loss reads, so every engine accepts the batch
            b = b.select("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids",
                         "truncated", "old_log_probs", "ref_log_probs", "advantages", "returns",
                         "old_values", "scores")
        return b

    # ------------------------------------------------------------------ comparisons
    def close_to(self, actual: Tensor, expected: Tensor, quantity: str, what: str,
                 mask: Tensor | None = None) -> None:
        """Fail when ``actual`` is outside the dtype tier of ``quantity`` around ``expected``."""
        tol = tolerance(self.dtype, quantity)
        a = actual.detach().double().cpu()
        e = expected.detach().double().cpu()
        if a.shape != e.shape:
            self.fail(f"{what}: shape {tuple(a.shape)}, expected {tuple(e.shape)}")
        if not bool(torch.isfinite(a).all()):
            where = (~torch.isfinite(a)).nonzero()[0].tolist()
            self.fail(f"{what}: non-finite value at {where}")
        keep = torch.ones(a.shape, dtype=torch.bool) if mask is None else mask.cpu().bool()
        if quantity == "grad":
            a, e = a[keep], e[keep]
            err = float((a - e).norm()) / max(float(e.norm()), 1e-30)
            if err > tol.rel_l2 and float((a - e).abs().max()) > tol.atol:
                self.fail(f"{what}: relative L2 error {err:.3g} > {tol.rel_l2:g} ({self.dtype} tier)")
            return
        diff = (a - e).abs()
        bound = tol.atol + tol.rtol * e.abs()
        bad = (diff > bound) & keep
        if bool(bad.any()):
            excess = torch.where(keep, diff - bound, torch.full_like(diff, -torch.inf))
            flat = int(excess.flatten().argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
            at = f"[sample {idx[0]}, token {idx[1]}]" if len(idx) == 2 else str(list(idx))
            self.fail(
                f"{what}: {int(bad.sum())} of {int(keep.sum())} values outside the {self.dtype} tier "
                f"(atol={tol.atol:g}, rtol={tol.rtol:g}); worst at {at}: got {float(a[idx]):.7g}, "
                f"expected {float(e[idx]):.7g}"
            )

    def scalar_close(self, actual: float, expected: float, quantity: str, what: str) -> None:
        """Scalar version of :meth:`close_to`."""
        self.close_to(torch.tensor([actual]), torch.tensor([expected]), quantity, what)


def collect_stream(stream: Iterable[WeightMessage]) -> tuple[list[WeightMessage], dict[str, Tensor]]:
    """Drain a weight stream; return its messages (chunks emptied) and a copy of every tensor."""
    msgs: list[WeightMessage] = []
    tensors: dict[str, Tensor] = {}
    for msg in stream:
        if isinstance(msg, WeightChunk):
            for name, t in msg.tensors:
                tensors[name] = t.detach().clone().cpu()
        msgs.append(msg)
    return msgs, tensors


def exported_weights(engine: TrainingEngine) -> dict[str, Tensor]:
    """The engine's weights in transformers naming, through its export stream."""
    return collect_stream(engine.export_weights())[1]


def weights_moved(before: Mapping[str, Tensor], after: Mapping[str, Tensor]) -> list[str]:
    """Names of the tensors of ``before`` that ``after`` holds with another value (bitwise), in order."""
    return [name for name, t in before.items() if name in after and not torch.equal(after[name], t)]


def recover_grads(before: Mapping[str, Tensor], after: Mapping[str, Tensor],
                  optim: OptimConfig = SUITE_OPTIM) -> dict[str, Tensor]:
    """The gradient of AdamW's first step from the weight change (weight decay 0, no clipping).

    Step one moves each weight by ``-lr * g / (|g| + eps)``; solving for g gives
    ``g = -delta * eps / (lr - |delta|)``.
    """
    lr = optim.lr_at(0)
    out = {}
    for name, w0 in before.items():
        delta = after[name].double() - w0.double()
        out[name] = -delta * optim.eps / (lr - delta.abs()).clamp_min(1e-12)
    return out


def messages_kinds(msgs: Iterable[WeightMessage]) -> list[str]:
    """Kinds of a stream's messages (for error messages)."""
    kinds = []
    for m in msgs:
        kinds.append("manifest" if isinstance(m, WeightManifest) else "commit" if isinstance(m, WeightCommit) else "chunk")
    return kinds

