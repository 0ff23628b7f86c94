"""The typed registry facade over pluggy: backends, engines, weight-sync paths, algorithm parts and presets.

Plugins are discovered through the ``verl.plugins`` entry-point group on first use (set
``VERL_DISABLE_PLUGIN_AUTOLOAD=1`` to skip discovery; built-in algorithms stay registered).
Built-in plugins (verl-core's own algorithms) are handed to the registry from above with
:func:`add_builtin_plugin` and imported when algorithm components are first looked up, so the kernel
never imports the algorithms layer and a process that only builds engines never loads it.
Plugins that are not installed are named in ``VERL_PLUGINS`` (``name=module:attr`` entries,
comma-separated); child processes inherit the variable, so torchrun ranks see them too.
Listing backends reads only their BackendSpecs and imports no engine library.

An installed plugin that cannot be loaded (its module does not import, its hooks or spec are
refused) does not stop the others: it is listed as broken (:meth:`Registry.broken`, ``verl
backends``) with its error, and only a lookup of its name (a run that selects it) fails, with
that error.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final, TypeVar, cast, get_args

import pluggy

from verl_core.kernel import hookspecs
from verl_core.kernel.algorithm import AlgorithmComponent, ComponentKind, Preset
from verl_core.kernel.capabilities import (
    Capabilities,
    RewardCapabilities,
    RolloutCapabilities,
    TrainingCapabilities,
)
from verl_core.kernel.convert import convert, field_types
from verl_core.kernel.engine import ROLES, EngineSpec, Role
from verl_core.kernel.errors import ConfigError, PluginError, UnknownNameError, check_str, describe
from verl_core.kernel.reward import RewardEngine
from verl_core.kernel.rollout import RolloutEngine
from verl_core.kernel.training import TrainingEngine
from verl_core.kernel.version import PROTOCOL_VERSION, protocol_compatible
from verl_core.kernel.weights import StreamWeightSync, WeightSync

__all__ = [
    "ENTRY_POINT_GROUP",
    "BackendSpec",
    "BrokenPlugin",
    "InstalledBackend",
    "Registry",
    "available_backends",
    "broken_plugins",
    "get_backend",
    "add_builtin_plugin",
    "get_registry",
    "get_reward_engine",
    "get_rollout_engine",
    "get_training_engine",
    "get_weight_sync",
    "import_string",
    "parse_options",
]

ENTRY_POINT_GROUP: Final = "verl.plugins"
_CORE: Final = "verl-core"
"""The distribution name the built-in plugins are registered under."""
AUTOLOAD_ENV: Final = "VERL_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV: Final = "VERL_PLUGINS"
_INSTALL_HINTS: Final = {
    "hf": "pip install verl-hf",
    "megatron": "pip install verl-megatron",
    "vllm": "pip install 'verl-vllm[cuda]' (GPU) or 'verl-vllm[cpu]' (CPU)",
}
_ROLE_CAPS: Final[dict[Role, type]] = {
    "actor": TrainingCapabilities,
    "reference": TrainingCapabilities,
    "critic": TrainingCapabilities,
    "rollout": RolloutCapabilities,
    "reward": RewardCapabilities,
}


@dataclass(frozen=True)
class BackendSpec:
    """What a backend plugin declares (returned by its ``verl_backend`` hook).

    Attributes:
        name: Backend name users type; equals the plugin's entry-point name.
        roles: Role -> import string ``"module:factory"`` of a callable taking an EngineSpec.
        capabilities: Static capabilities per role.
        protocol_version: The verl-core protocol version the backend implements (``"MAJOR.MINOR"``).
        config_class: Import string of the dataclass that validates ``EngineSpec.options``, or None.
        description: One line about the backend.
    """

    name: str
    roles: Mapping[Role, str]
    capabilities: Mapping[Role, Capabilities]
    protocol_version: str
    config_class: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        for role in self.roles:
            if role not in ROLES:
                raise PluginError(f"backend {self.name!r} declares unknown role {role!r}; roles: {ROLES}")
            if ":" not in self.roles[role]:
                raise PluginError(
                    f"backend {self.name!r} role {role!r}: factory must be 'module:attr', got {self.roles[role]!r}"
                )
        for role, caps in self.capabilities.items():
            if role not in self.roles:
                raise PluginError(f"backend {self.name!r} declares capabilities for role {role!r} it does not provide")
            if not isinstance(caps, _ROLE_CAPS[role]):
                raise PluginError(
                    f"backend {self.name!r} role {role!r}: capabilities must be {_ROLE_CAPS[role].__name__}, "
                    f"got {type(caps).__name__}"
                )


@dataclass(frozen=True)
class InstalledBackend:
    """A discovered backend: its spec and the distribution that installed it."""

    spec: BackendSpec
    distribution: str
    version: str

    def capabilities(self, role: Role) -> Capabilities:
        """Declared capabilities of ``role`` (defaults when the backend declares none)."""
        caps = self.spec.capabilities.get(role)
        return caps if caps is not None else cast(Capabilities, _ROLE_CAPS[role]())


@dataclass(frozen=True)
class BrokenPlugin:
    """An installed plugin that could not be loaded.

    Attributes:
        name: Its entry-point name (the backend name a run would select).
        target: What the entry point names (``module`` or ``module:attr``).
        distribution: The distribution that installed it.
        version: That distribution's version.
        error: Why it could not be loaded (the import error, or why its hooks were refused).
    """

    name: str
    target: str
    distribution: str
    version: str
    error: str

    def describe(self) -> str:
        """One line: the plugin, where it comes from, and its error."""
        return (
            f"verl plugin {self.name!r} ({self.target}) from {self.distribution} {self.version} is installed but "
            f"cannot be loaded: {self.error}; reinstall or fix {self.distribution}, or uninstall it"
        )




_BUILTINS: list[tuple[str, Callable[[], object]]] = []


def add_builtin_plugin(name: str, load: Callable[[], object]) -> None:
    """Register a built-in plugin of verl-core: ``load()`` returns its hook module when first needed.

    Built-ins are loaded whatever ``VERL_DISABLE_PLUGIN_AUTOLOAD`` says (turning discovery off never
    removes GRPO). Called by the package facade for verl-core's own algorithms; adding a name twice
    keeps the first.
    """
    if all(n != name for n, _ in _BUILTINS):
        _BUILTINS.append((name, load))

_T = TypeVar("_T")


def import_string(path: str) -> Any:
    """Import ``"package.module:attr"`` and return the attribute (the module for ``"package.module"``)."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"cannot import {module_name!r} (from {path!r}): {e}") from e
    obj: Any = module
    for part in attr.split(".") if attr else []:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None
    return obj


def parse_options(config_class: type[_T], options: Mapping[str, Any], *, where: str = "options") -> _T:
    """Build a dataclass config from a mapping; unknown keys are an error listing the valid ones.

    Each value is checked against its field's annotation by the one typed converter
    (:func:`verl_core.kernel.convert.convert`: types, ``Literal`` choices, ``Annotated`` bounds), so
    a backend's options class declares its rules on its fields instead of re-checking by hand.

    Raises:
        ConfigError: ``options`` is not a mapping with string keys, has unknown keys, or holds a
            value the config class refuses.
        PluginError: ``config_class`` is not a dataclass (a backend declared a wrong config class).
    """
    if not isinstance(config_class, type) or not dataclasses.is_dataclass(config_class):
        raise PluginError(f"{where}: the config class {describe(config_class)} is not a dataclass")
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"{where} must be a mapping with string keys, got {describe(options)}")
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(names)) or 'none'}"
        )
    hints = field_types(config_class)
    values = {k: convert(v, hints[k], k, label=f"{where} key") for k, v in options.items()}
    try:
        return config_class(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a config class that checks with plain Python errors
        raise ConfigError(f"{where}: {e}") from e


class Registry:
    """Plugin manager plus typed lookups. Most code uses the module functions over one instance.

    Args:
        autoload: Discover entry-point plugins (default: unless ``VERL_DISABLE_PLUGIN_AUTOLOAD`` is set).
    """

    def __init__(self, *, autoload: bool | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._autoload = (not os.environ.get(AUTOLOAD_ENV)) if autoload is None else autoload
        self._loaded = False
        self._lock = threading.RLock()
        self._backends: dict[str, InstalledBackend] = {}
        self._broken: dict[str, BrokenPlugin] = {}
        self._components: dict[tuple[ComponentKind, str], tuple[AlgorithmComponent, str]] = {}
        self._presets: dict[str, tuple[Preset, str]] = {}
        self._builtins_loaded = False

    def _ensure_builtins(self) -> None:
        """Register the built-in plugins (before any plugin's components are looked up)."""
        with self._lock:
            if self._builtins_loaded:
                return
            for name, load in _BUILTINS:
                if not self.pm.has_plugin(name):
                    self._register_module(load(), name, _CORE, _core_version())
            self._builtins_loaded = True  # after a refusal (a plugin took a built-in name) every lookup says why

    # ------------------------------------------------------------- loading
    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self._autoload:
                self._load_entry_points()
            self._load_env_plugins()

    def _load_entry_points(self) -> None:
        by_name: dict[str, list[md.EntryPoint]] = {}
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            dists = by_name.setdefault(ep.name, [])
            if all(_dist_name(d) != _dist_name(ep) for d in dists):
                dists.append(ep)
        for name, eps in sorted(by_name.items()):
            if len(eps) > 1:
                owners = " and ".join(f"{_dist_name(e)} ({e.value})" for e in eps)
                raise PluginError(
                    f"two distributions claim the verl backend name {name!r}: {owners}; uninstall one"
                )
            ep = eps[0]
            version = ep.dist.version if ep.dist is not None else "unknown"
            try:
                module = ep.load()
                self._register_module(module, name, _dist_name(ep), version)
            except Exception as e:  # one broken plugin must not stop every command: only runs that select it
                error = str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
                self._broken[name] = BrokenPlugin(name, ep.value, _dist_name(ep), version, error)

    def _load_env_plugins(self) -> None:
        """Register the plugins named in ``VERL_PLUGINS`` (``name=module:attr``, comma-separated)."""
        for entry in filter(None, (e.strip() for e in os.environ.get(PLUGINS_ENV, "").split(","))):
            name, _, target = (part.strip() for part in entry.partition("="))
            if not name or not target:
                raise PluginError(f"{PLUGINS_ENV} entries must be 'name=module:attr', got {entry!r}")
            self._register_module(import_string(target), name, PLUGINS_ENV, target)

    def register(self, plugin: ModuleType | object, name: str, *, distribution: str = "<in-process>",
                 version: str = "0") -> None:
        """Register a plugin object in-process (for third-party code and tests without installing)."""
        check_str(name, "plugin name", error=PluginError)
        with self._lock:
            self._ensure_loaded()
            self._register_module(plugin, name, distribution, version)

    def _register_module(self, plugin: object, name: str, dist: str, version: str) -> None:
        if self.pm.has_plugin(name):
            raise PluginError(f"a verl plugin named {name!r} is already registered")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"verl plugin {name!r} (from {dist}): {e}") from e
        try:
            self._check_hook_names(plugin, name, dist)
            self._collect(plugin, name, dist, version)
        except Exception:
            self.pm.unregister(plugin, name=name)
            raise

    def _check_hook_names(self, plugin: object, name: str, dist: str) -> None:
        """Refuse a plugin whose ``@hookimpl`` names no hook spec (a misspelt hook would never run)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            specs = sorted(n for n in dir(hookspecs) if n.startswith("verl_"))
            raise PluginError(
                f"verl plugin {name!r} (from {dist}) implements a hook that does not exist: {e}; "
                f"the hooks are: {', '.join(specs)}"
            ) from e

    def _call(self, plugin: object, hook: str, **kwargs: Any) -> list[Any]:
        """The results of ``plugin``'s implementation of ``hook``, called through pluggy."""
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        return list(self.pm.subset_hook_caller(hook, remove_plugins=others)(**kwargs))

    def _collect(self, plugin: object, name: str, dist: str, version: str) -> None:
        """Check everything ``plugin`` declares, then record it all (a refused plugin leaves nothing)."""
        spec = self._backend_spec(plugin, name, dist, version)
        components: dict[tuple[ComponentKind, str], tuple[AlgorithmComponent, str]] = {}
        for comp in [c for comps in self._call(plugin, "verl_algorithm_components") for c in comps or []]:
            key = (comp.kind, comp.name)
            if key in self._components or key in components:
                other = (self._components.get(key) or components[key])[1]
                raise PluginError(f"{comp.kind} {comp.name!r} is registered by both {other} and {dist}")
            components[key] = (comp, dist)
        presets: dict[str, tuple[Preset, str]] = {}
        for preset in [p for found in self._call(plugin, "verl_algorithm_presets") for p in found or []]:
            if not isinstance(preset, Preset):
                raise PluginError(
                    f"plugin {name!r} (from {dist}): verl_algorithm_presets() must return Preset records "
                    f"(verl_core.kernel.algorithm.Preset), got {describe(preset)}"
                )
            if preset.name in self._presets or preset.name in presets:
                other = (self._presets.get(preset.name) or presets[preset.name])[1]
                raise PluginError(
                    f"algorithm preset {preset.name!r} is registered by both {other} and {dist}; "
                    "give the plugin's preset another name"
                )
            presets[preset.name] = (preset, dist)
        if spec is not None:
            self._backends[name] = InstalledBackend(spec, dist, version)
        self._components.update(components)
        self._presets.update(presets)

    def _backend_spec(self, plugin: object, name: str, dist: str, version: str) -> BackendSpec | None:
        """The checked BackendSpec ``plugin`` declares (None for a plugin that adds only algorithms)."""
        specs = self._call(plugin, "verl_backend")
        spec = specs[0] if specs else None
        if spec is None:
            return None
        if not isinstance(spec, BackendSpec):
            raise PluginError(f"plugin {name!r}: verl_backend() must return a BackendSpec, got {type(spec).__name__}")
        if spec.name != name:
            raise PluginError(
                f"plugin {name!r} (from {dist}) returns a BackendSpec named {spec.name!r}; "
                "the spec name must equal the entry-point name"
            )
        if not protocol_compatible(spec.protocol_version):
            raise PluginError(
                f"backend {name!r} ({dist} {version}) implements verl protocol {spec.protocol_version}, "
                f"but this verl-core speaks {PROTOCOL_VERSION} (same major, minor <= ours); "
                f"upgrade {dist} or verl-core so they match"
            )
        if name in self._backends:
            other = self._backends[name].distribution
            raise PluginError(f"two distributions claim the verl backend name {name!r}: {other} and {dist}")
        return spec

    # ------------------------------------------------------------- backends
    def backends(self) -> dict[str, InstalledBackend]:
        """Installed backends by name (imports no engine library); broken plugins are not among them."""
        self._ensure_loaded()
        return dict(sorted(self._backends.items()))

    def broken(self) -> dict[str, BrokenPlugin]:
        """Installed plugins that could not be loaded, by entry-point name."""
        self._ensure_loaded()
        return dict(sorted(self._broken.items()))

    def backend(self, name: str) -> InstalledBackend:
        """The backend ``name``; an unknown name lists the installed ones and how to add it.

        Raises:
            PluginError: ``name`` is an installed plugin that could not be loaded (with its error).
            UnknownNameError: no backend of that name is installed.
        """
        check_str(name, "backend name")
        backends = self.backends()
        if name not in backends and name in self._broken:
            raise PluginError(f"backend {name!r}: {self._broken[name].describe()}")
        if name not in backends:
            hint = _INSTALL_HINTS.get(name, f"pip install verl-{name}")
            raise UnknownNameError(
                f"unknown verl backend {name!r}; installed: {', '.join(backends) or 'none'}. "
                f"To add it: {hint}"
                + (f" (plugin autoload is off: unset {AUTOLOAD_ENV})" if not self._autoload else "")
            )
        return backends[name]

    def build(self, name: str, spec: EngineSpec) -> Any:
        """Build the engine of ``spec.role`` from backend ``name`` (imports the engine here)."""
        _check_spec(spec)
        backend = self.backend(name)
        factory_path = backend.spec.roles.get(spec.role)
        if factory_path is None:
            raise UnknownNameError(
                f"backend {name!r} does not provide role {spec.role!r}; it provides: "
                f"{', '.join(backend.spec.roles) or 'none'}"
            )
        if spec.lora is not None:
            _check_lora(name, spec.role, backend.capabilities(spec.role))
        if backend.spec.config_class is not None:
            parse_options(import_string(backend.spec.config_class), spec.options,
                          where=f"backend {name!r} options")
        elif spec.options:
            raise ConfigError(f"backend {name!r} takes no options, got {', '.join(spec.options)}")
        factory = import_string(factory_path)
        return factory(spec)

    def weight_sync(self, source: str, target: str) -> WeightSync:
        """A direct WeightSync for the pair when a plugin registers one, else the canonical stream."""
        check_str(source, "weight sync source backend name")
        check_str(target, "weight sync target backend name")
        self._ensure_loaded()
        direct = self.pm.hook.verl_weight_sync(source=source, target=target)
        if direct is not None:
            return cast(WeightSync, _checked(direct, WeightSync, f"{source}->{target}", "weight sync"))
        return StreamWeightSync()

    # ------------------------------------------------------------- algorithms
    def components(self, kind: ComponentKind) -> dict[str, AlgorithmComponent]:
        """Registered components of ``kind`` by name."""
        kinds = get_args(ComponentKind)
        if not isinstance(kind, str) or kind not in kinds:
            raise UnknownNameError(f"unknown algorithm component kind {describe(kind)}; kinds: {', '.join(kinds)}")
        self._ensure_builtins()
        self._ensure_loaded()
        return {n: c for (k, n), (c, _) in sorted(self._components.items()) if k == kind}

    def component(self, kind: ComponentKind, name: str) -> AlgorithmComponent:
        """The component ``name`` of ``kind``; an unknown name lists the registered ones."""
        comps = self.components(kind)
        check_str(name, f"{kind} name")
        if name not in comps:
            broken = "".join(f"; {b.describe()} (it may provide it)" for b in self._broken.values())
            raise UnknownNameError(
                f"unknown {kind} {name!r}; registered: {', '.join(comps) or 'none'}{broken}"
            )
        return comps[name]


    def presets(self) -> dict[str, Preset]:
        """Registered algorithm presets by name (the values of ``algorithm.name``): verl-core's first,
        in its table's order, then the plugins'."""
        self._ensure_builtins()
        self._ensure_loaded()
        ordered = sorted(self._presets.items(), key=lambda item: item[1][1] != _CORE)  # stable: table order kept
        return {n: p for n, (p, _) in ordered}

    def preset(self, name: str) -> Preset:
        """The preset ``name``; an unknown name lists the registered ones.

        Raises:
            UnknownNameError: no preset of that name is registered (the message lists them, and any
                installed plugin that could not be loaded).
        """
        presets = self.presets()
        check_str(name, "algorithm preset name")
        if name not in presets:
            broken = "".join(f"; {b.describe()} (it may provide it)" for b in self._broken.values())
            raise UnknownNameError(f"unknown algorithm {name!r}; choices: {', '.join(presets)}{broken}")
        return presets[name]


def _dist_name(ep: md.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "<unknown distribution>"


def _core_version() -> str:
    from verl_core.kernel.version import __version__

    return __version__


_registry: Registry | None = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (created on first use)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def reset_registry() -> None:
    """Forget the process-wide registry so the next use rediscovers plugins (for tests)."""
    global _registry
    with _registry_lock:
        _registry = None


def available_backends() -> dict[str, InstalledBackend]:
    """Installed backends by name."""
    return get_registry().backends()


def broken_plugins() -> dict[str, BrokenPlugin]:
    """Installed plugins that could not be loaded, by name (``verl backends`` lists them as broken)."""
    return get_registry().broken()


def get_backend(name: str) -> InstalledBackend:
    """The installed backend ``name``."""
    return get_registry().backend(name)


def get_training_engine(name: str, spec: EngineSpec) -> TrainingEngine:
    """Build a training engine (actor, reference or critic) of backend ``name``."""
    _check_spec(spec)
    if spec.role not in ("actor", "reference", "critic"):
        raise ConfigError(f"get_training_engine needs role actor, reference or critic, got {spec.role!r}")
    return cast(TrainingEngine, _checked(get_registry().build(name, spec), TrainingEngine, name, spec.role))


def get_rollout_engine(name: str, spec: EngineSpec) -> RolloutEngine:
    """Build a rollout engine of backend ``name``."""
    _check_spec(spec)
    if spec.role != "rollout":
        raise ConfigError(f"get_rollout_engine needs role 'rollout', got {spec.role!r}")
    return cast(RolloutEngine, _checked(get_registry().build(name, spec), RolloutEngine, name, spec.role))


def get_reward_engine(name: str, spec: EngineSpec) -> RewardEngine:
    """Build a reward engine of backend ``name``."""
    _check_spec(spec)
    if spec.role != "reward":
        raise ConfigError(f"get_reward_engine needs role 'reward', got {spec.role!r}")
    return cast(RewardEngine, _checked(get_registry().build(name, spec), RewardEngine, name, spec.role))


def get_weight_sync(source: str, target: str) -> WeightSync:
    """The WeightSync from training backend ``source`` to rollout backend ``target``."""
    return get_registry().weight_sync(source, target)


def _check_lora(name: str, role: Role, caps: Capabilities) -> None:
    """Refuse ``EngineSpec.lora`` where the backend does not declare it for ``role``."""
    if isinstance(caps, TrainingCapabilities) and not caps.lora:
        raise ConfigError(
            f"backend {name!r} does not train LoRA adapters for role {role!r} (capabilities.lora is False); "
            "set EngineSpec.lora=None (model.lora.enabled=false) or use a backend that declares it, e.g. hf"
        )
    if isinstance(caps, RolloutCapabilities) and not caps.lora_adapters:
        raise ConfigError(
            f"backend {name!r} does not apply LoRA adapter streams (capabilities.lora_adapters is False); build "
            "its rollout engine without EngineSpec.lora and sync merged weights (model.lora.sync='merged')"
        )
    if isinstance(caps, RewardCapabilities):
        raise ConfigError(f"backend {name!r}: a reward engine takes no EngineSpec.lora")


def _check_spec(spec: object) -> None:
    if not isinstance(spec, EngineSpec):
        raise ConfigError(f"spec must be an EngineSpec, got {describe(spec)}")


def _checked(obj: object, proto: type, name: str, role: str) -> object:
    if proto not in type(obj).__mro__:
        raise PluginError(
            f"backend {name!r} built a {type(obj).__name__} for {role}, which does not subclass "
            f"{proto.__name__}; engines must inherit the verl_core protocol explicitly"
        )
    return obj

