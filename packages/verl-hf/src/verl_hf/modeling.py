"""Loading transformers models for the engines and the per-token math they share.

Every forward passes explicit position ids ``cumsum(mask) - 1`` clipped at 0 (left padding would
otherwise shift positions), and reads the logits of response token t at the position of the
preceding token. Log-probs and entropy are computed in float32 from upcast logits, a chunk of
tokens at a time (``verl_core.enginekit.token_stats``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import os
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from verl_core.enginekit.decode_attention import grouped_decode_attention
from verl_core.enginekit.model_folder import check_layer_types, check_special_token_ids
from verl_core.enginekit.packed_attention import packed_causal_attention
from verl_core.enginekit.token_stats import token_log_probs
from verl_core.enginekit.weight_stream import fusion_group
from verl_core.kernel.batch import TensorBatch
from verl_core.kernel.errors import ConfigError

__all__ = [
    "FUSED_SDPA",
    "GROUPED_SDPA",
    "PACKED_SDPA",
    "FlatParameters",
    "ModelKind",
    "cache_keyword",
    "contiguous_head_input",
    "disable_dropout",
    "export_order",
    "fused_decode_sdpa",
    "grouped_decode_sdpa",
    "load_model",
    "packed_sdpa",
    "packing_unsupported",
    "position_ids",
    "quiet_transformers",
    "register_grouped_sdpa",
    "register_packed_sdpa",
    "sequence_inputs",
    "token_outputs",
]

ModelKind = Literal["causal_lm", "value", "reward"]
"""Which head a loaded model carries: the LM head, a one-label token head, a one-label sequence head."""


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' loading progress bars and load reports while inside the block."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def disable_dropout(model: nn.Module) -> None:
    """Turn every dropout off: RL log-probs must be a deterministic function of the weights."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # noqa: B010
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "classifier_dropout"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


def contiguous_head_input(model: nn.Module) -> bool:
    """Hand ``model``'s output head a contiguous input (a forward pre-hook); False where it has none.

    transformers feeds the head the last positions of the hidden states (``logits_to_keep``), a
    strided ``[rows, k, hidden]`` view. torch's matmul folds such an input into one matrix product
    only when the weight requires grad; against a frozen weight (a rollout's) it runs a batched
    product over the weight expanded per row, reading the whole head once per row. In the
    prefill of 128 rows x 32 tokens of the 0.89B model that one product took 4.8 of the
    prefill's 27.6 ms on an H100 (``benchmarks/gpu/profile_prefill.py``). A contiguous input is
    one matrix product, the same values; where the input is contiguous already (every decode
    step) the hook changes nothing.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        return False
    head.register_forward_pre_hook(_contiguous_args)
    return True


def _contiguous_args(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.contiguous() if isinstance(a, Tensor) else a for a in args)


def export_order(names: Collection[str]) -> list[str]:
    """``names`` with each fusion group (q/k/v, gate/up) contiguous, in first-appearance order.

    The order of the weight stream and of :class:`FlatParameters`, so two engines that load the
    same architecture lay their weights out alike.
    """
    order: dict[str, int] = {}
    for n in names:
        order.setdefault(fusion_group(n), len(order))
    return sorted(names, key=lambda n: order[fusion_group(n)])


_ALIGN_BYTES = 16  # every view starts on a 16-byte boundary (what vectorised kernels load)


@dataclass(frozen=True)
class FlatParameters:
    """An engine's weights re-homed as views of one contiguous buffer, in a given name order.

    Two engines whose layouts are equal (same names, shapes and dtype, in order) copy weights
    with one device copy of the buffer and check them with one reduction. The views start on
    aligned offsets; the gaps are zeros. Anything that re-homes a tensor afterwards (moving the
    model between devices, replacing a parameter) is caught by :meth:`intact`.
    """

    buffer: Tensor
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    pointers: tuple[int, ...]
    offsets: tuple[int, ...]
    index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", {name: i for i, name in enumerate(self.names)})

    @classmethod
    def build(cls, tensors: Mapping[str, Tensor]) -> FlatParameters | None:
        """Move ``tensors`` (name -> parameter or buffer, in layout order) into one buffer.

        Each tensor's ``.data`` becomes a view of the buffer, so parameter objects (and an
        optimizer holding them) stay valid; they may already be views of one buffer (rebuilding
        after a move). None, changing nothing, when the tensors are not all plain dense tensors of
        one floating dtype on one device, or two of them overlap in memory.
        """
        items = list(tensors.items())
        if not items:
            return None
        first = items[0][1]
        dtype, device = first.dtype, first.device
        spans = []
        for _, t in items:
            if (type(t) not in (Tensor, nn.Parameter) or t.dtype != dtype or t.device != device
                    or not t.is_floating_point() or t.layout != torch.strided):
                return None
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        spans.sort()
        if any(start < end for (_, end), (start, _) in itertools.pairwise(spans)):
            return None  # two names share memory (tied weights): they cannot have two places
        align = max(1, _ALIGN_BYTES // first.element_size())
        offsets, total = [], 0
        for _, t in items:
            offsets.append(total)
            total += -(-t.numel() // align) * align
        buffer = torch.zeros(total, dtype=dtype, device=device)
        with torch.no_grad():
            for (_, t), off in zip(items, offsets, strict=True):
                view = buffer[off : off + t.numel()].view(t.shape)
                view.copy_(t)
                t.data = view
        return cls(buffer, tuple(n for n, _ in items), tuple(tuple(t.shape) for _, t in items),
                   tuple(t.data_ptr() for _, t in items), tuple(offsets))

    def span(self, names: list[str]) -> Tensor | None:
        """The part of the buffer holding ``names`` back to back (no gap between them), else None."""
        start = self.index.get(names[0]) if names else None
        if start is None or start + len(names) > len(self.names):
            return None
        end = self.offsets[start]
        for k, name in enumerate(names):
            i = start + k
            if self.names[i] != name or self.offsets[i] != end:
                return None
            end += math.prod(self.shapes[i])
        return self.buffer[self.offsets[start] : end]

    def same_layout(self, other: FlatParameters) -> bool:
        """Whether ``other`` holds the same names, shapes and dtype at the same offsets."""
        return (self.buffer.dtype == other.buffer.dtype and self.buffer.numel() == other.buffer.numel()
                and self.names == other.names and self.shapes == other.shapes)

    def moved(self, tensors: Mapping[str, Tensor], into: Tensor, *, copy: bool = True) -> FlatParameters:
        """This layout in ``into`` (a buffer of the same size and dtype, e.g. on another device):
        the buffer is copied there in one copy and every tensor of ``tensors`` (name -> tensor,
        :meth:`intact` with this layout) becomes its view there. The old buffer is no longer
        referenced by the tensors, so its memory is freed once this layout is dropped. With
        ``copy=False`` the values are not copied: the views hold whatever ``into`` holds (for a
        caller that writes every tensor before reading one).
        """
        if into.dtype != self.buffer.dtype or into.numel() != self.buffer.numel() or into.dim() != 1:
            raise ValueError(f"FlatParameters.moved needs a 1-D {self.buffer.dtype} buffer of {self.buffer.numel()} "
                             f"elements, got {tuple(into.shape)} {into.dtype}")
        with torch.no_grad():
            if copy:
                into.copy_(self.buffer)
            for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
                tensors[name].data = into[off : off + math.prod(shape)].view(shape)
        return FlatParameters(into, self.names, self.shapes, tuple(tensors[n].data_ptr() for n in self.names),
                              self.offsets)

    def intact(self, tensors: Mapping[str, Tensor]) -> bool:
        """Whether ``tensors`` (name -> live tensor) are still the views this layout placed."""
        if len(tensors) != len(self.names):
            return False
        for name, ptr in zip(self.names, self.pointers, strict=True):
            t = tensors.get(name)
            if t is None or t.data_ptr() != ptr:
                return False
        return True


GROUPED_SDPA = "verl_grouped_sdpa"
"""Name of :func:`grouped_decode_sdpa` in transformers' attention registry."""

FUSED_SDPA = "verl_fused_decode_sdpa"
"""Name of :func:`fused_decode_sdpa` in transformers' attention registry."""


def grouped_decode_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    fused: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, reading only the part of a static KV cache a call needs,
    with decode steps that read it once.

    A 4D mask narrower than the cache (``attention_mask.shape[-1] < key.shape[2]``) attends over
    the first ``attention_mask.shape[-1]`` slots only: the rest of a preallocated cache is never
    read. The hf rollout's static decoder passes masks as wide as the slots filled so far (rounded
    up to a cache window, :func:`verl_core.enginekit.sampling.cache_windows`), so a step's attention
    reads what was written, not the whole cache, and the prefill's grouped key/value heads are
    repeated over the prompt's slots only.

    With a mask, transformers' sdpa path materialises every key/value head ``num_key_value_groups``
    times (``repeat_kv``) before the kernel; in a decode step over a long KV cache that copy costs
    more than the attention itself. For one query token per row, the query heads of a group are
    folded into one matrix instead (head ``h`` reads key/value head ``h // groups``, as
    ``repeat_kv`` lays them out), and the attention is two batched matrix products around a
    float32 softmax: with one query token the masked flash kernels run at about half the
    bandwidth of reading the cache (on an H200, 68 against 33 microseconds per layer at 128 rows
    and 160 slots once compiled: benchmarks/gpu/bench_decode_attention.py). Every other call
    (prefill, dropout, masks of another shape) is transformers' own function, over the slots the
    mask covers. With ``fused`` (:func:`fused_decode_sdpa`, ``HFOptions.rollout_decode_kernel``)
    a bfloat16 decode step on CUDA runs the fused Triton kernel instead
    (:func:`verl_core.enginekit.decode_attention.grouped_decode_attention`).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] < key.shape[2]:
        slots = attention_mask.shape[-1]  # views: the slots past the mask are not read
        key, value = key[:, :, :slots], value[:, :, :slots]
    groups = int(getattr(module, "num_key_value_groups", 1))
    _, heads, q_len, dim = query.shape
    if (q_len != 1 or dropout != 0.0 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1:3] != (1, 1) or key.shape[1] * groups != heads):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    scale = dim**-0.5 if scaling is None else scaling
    return grouped_decode_attention(query, key, value, attention_mask, scale, fused=fused), None


def fused_decode_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """:func:`grouped_decode_sdpa` with decode steps through the fused Triton kernel where it takes
    them (:func:`verl_core.enginekit.decode_attention.grouped_decode_attention`)."""
    return grouped_decode_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                               fused=True, **kwargs)


def register_grouped_sdpa(fused: bool = False) -> str:
    """Register :func:`grouped_decode_sdpa`, or :func:`fused_decode_sdpa` with ``fused``, (and sdpa's
    mask format) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = FUSED_SDPA if fused else GROUPED_SDPA
    AttentionInterface.register(name, fused_decode_sdpa if fused else grouped_decode_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


PACKED_SDPA = "verl_packed_sdpa"
"""Name of :func:`packed_sdpa` in transformers' attention registry."""

# Decoder families whose attention reads ``config._attn_implementation`` and forwards the model's
# extra keyword arguments to it (checked against each family's transformers modeling code).
_PACKABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# How many packed attention calls ran on each kernel (what benchmarks report as the path taken).
def packed_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention that also runs packed rows: sequences laid end to end in
    one row, each attending causally to itself only.

    A call whose keyword arguments carry ``cu_seq_lens_q`` (int32 cumulative sequence lengths,
    ``[sequences + 1]``) and ``max_length_q`` is packed: it runs
    ``torch.nn.attention.varlen.varlen_attn`` (a CUDA flash kernel for float16/bfloat16, reading
    grouped key/value heads in place), elsewhere one ``scaled_dot_product_attention(...,
    is_causal=True)`` per sequence (exact, slower). Every other call is transformers' own sdpa
    function, so a model set to this implementation runs padded batches as before.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if query.shape[0] != 1 or dropout != 0.0 or kwargs.get("sliding_window") is not None:
        raise ValueError("packed attention takes one packed row, no dropout and no sliding window; got "
                         f"{query.shape[0]} rows, dropout {dropout}, sliding_window {kwargs.get('sliding_window')}")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # [1, heads, tokens, dim] -> [tokens, heads, dim], the packed layout (the projections' own)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = packed_causal_attention(q, k, v, cu, int(kwargs.get("max_length_q") or 0) or None, scale)
    return out.unsqueeze(0), None


def _packed_mask(*args: Any, **kwargs: Any) -> Any:
    """sdpa's mask, and none for a call without a padding mask: a packed call's attention reads
    the sequence boundaries instead, so the [tokens, tokens] block mask is never built."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register_packed_sdpa() -> str:
    """Register :func:`packed_sdpa` (and its mask format) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, _packed_mask)
    return PACKED_SDPA


def packing_unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run packed sequences (None: it can).

    Packing needs a decoder family known to pass extra keyword arguments to its attention
    function (llama, mistral, qwen2, qwen3), sdpa attention and full attention in every layer.
    """
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in _PACKABLE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(_PACKABLE_MODEL_TYPES)}"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", PACKED_SDPA):
        return f"attention implementation {impl!r} is not 'sdpa'"
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [t for t in layer_types if t != "full_attention"]
    if sliding or (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        return "the model has sliding-window attention layers"
    return None


_REWARD_MODEL_KEY: Final = (
    " (with `verl train`: set the config key reward_model to the reward model's folder; "
    "left empty it is the policy's folder, a causal LM)"
)


def _folder_config(path: str) -> Any:
    """The folder's transformers config, or None when it cannot be read (loading then says why)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError):
        return None


def _stored_shape(path: str, name: str) -> tuple[int, ...] | None:
    """The shape of tensor ``name`` in the folder's safetensors files (read from their headers, nothing
    loaded): the shard the index names, else each ``*.safetensors`` file; None where none holds it."""
    from safetensors import safe_open

    folder = Path(path)
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shard = index.get("weight_map", {}).get(name)
        files = [folder / shard] if isinstance(shard, str) else []
    except (OSError, ValueError):
        files = sorted(folder.glob("*.safetensors"))
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                stored: list[str] = list(f.keys())  # the header's names (the handle itself has no `in`)
                if name in stored:
                    return tuple(f.get_slice(name).get_shape())
        except (OSError, ValueError, RuntimeError):
            continue  # an unreadable file: loading says why
    return None


def _check_one_label(path: str, kind: ModelKind) -> None:
    """Refuse a value or reward folder whose stored ``score.weight`` has other than one row (labels):
    transformers would stop with a bare RuntimeError about mismatched sizes, or a head of several
    labels would be read as one."""
    shape = _stored_shape(path, "score.weight")
    if shape is None or shape[0] == 1:
        return
    gives = {"value": "a critic's value head gives one number per token",
             "reward": "a reward model gives one score per sequence"}[kind]
    raise ConfigError(
        f"{kind} model {path!r} has a score head of {shape[0]} labels (score.weight {list(shape)}); {gives}: "
        f"expected num_labels 1 (score.weight [1, hidden])" + (_REWARD_MODEL_KEY if kind == "reward" else "")
    )


def load_model(
    path: str | os.PathLike[str],
    kind: ModelKind,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    sequence_len: int | None = None,
) -> Any:
    """Load the transformers model of ``path`` with the head of ``kind``, dropout off.

    A ``value`` model is read with ``AutoModelForTokenClassification`` (one label) so every backend
    reads the same value head; when the folder holds a causal LM its backbone is loaded and the
    value head is initialised from ``seed``. A ``reward`` model is read with
    ``AutoModelForSequenceClassification`` and must have one label and hold its ``score`` head's
    weights: a folder that names another architecture (a causal LM) or lacks those weights is
    refused rather than given a random head, whose scores would be noise that trains nothing.

    ``sequence_len``, the longest sequence the engine runs (``max_prompt_len + max_response_len``),
    is refused before the weights load when the model's learned position table is shorter (GPT-2's
    ``n_positions``): a longer sequence would index past the table. Rotary models have no table.
    So is a folder whose pad, EOS or BOS id is not a row of the vocabulary, in ``config.json``,
    ``generation_config.json`` or the tokenizer's files
    (:func:`verl_core.enginekit.model_folder.check_special_token_ids`), which transformers would
    meet with a bare ``AssertionError`` (the config's pad) or build (a rollout stopping on the
    tokenizer's EOS then never stops). A causal LM's head gets a contiguous input
    (:func:`contiguous_head_input`).

    Raises:
        ConfigError: the folder cannot be loaded as ``kind``, or its head has more than one label;
            for ``reward``, the folder names a non-classification architecture or holds no
            weights for the score head; ``sequence_len`` longer than the position table; a
            pad, EOS or BOS id outside ``[0, vocab_size)`` (the message names the file and key).
    """
    import transformers

    path = str(path)
    check_special_token_ids(path)
    check_layer_types(path)  # sliding_attention layers without a window
    config = _folder_config(path) if sequence_len is not None or kind == "reward" else None
    table = getattr(config, "n_positions", None)  # a learned position table (GPT-2); rotary models have none
    if isinstance(table, int) and sequence_len is not None and sequence_len > table:
        raise ConfigError(
            f"model {path!r} has a learned position table of n_positions={table}, but the engine's sequences reach "
            f"max_prompt_len + max_response_len = {sequence_len} positions; lower them in the EngineSpec to at most "
            f"{table} in total"
        )
    auto: Any = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "value": transformers.AutoModelForTokenClassification,
        "reward": transformers.AutoModelForSequenceClassification,
    }[kind]
    # never run code shipped with a model folder (False refuses at once; the default may prompt)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation, "trust_remote_code": False}
    if kind != "causal_lm":
        _check_one_label(path, kind)
        kwargs["num_labels"] = 1  # the stored rows decide (config.json's num_labels is 2 when it names no labels)
    if kind == "reward":  # before the weights load: a causal LM's folder is refused at once
        archs = list(getattr(config, "architectures", None) or [])
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ConfigError(
                f"reward model {path!r} has architectures {archs}; expected a "
                f"*ForSequenceClassification model with one label (a trained reward model){_REWARD_MODEL_KEY}"
            )
        kwargs["output_loading_info"] = True  # to see whether the folder holds the score head
    try:
        with quiet_transformers(), torch.random.fork_rng(devices=[]):
            # Missing heads (a value head over a causal-LM folder) are initialised from the seed.
            torch.manual_seed(seed)
            model = auto.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"cannot load {path!r} as a {kind} model with transformers ({type(e).__name__}: {e}); "
            "expected a transformers folder with config.json and safetensors weights"
        ) from e
    if kind == "reward":
        model, info = model
        head = getattr(model, "score", None)
        names = {f"score.{n}" for n, _ in head.named_parameters()} if isinstance(head, torch.nn.Module) else set()
        missing = sorted(names & set(info.get("missing_keys") or ()))
        if missing:
            raise ConfigError(
                f"reward model {path!r} holds no weights for the score head ({', '.join(missing)} missing): "
                "transformers would initialise it at random and every score would be noise; expected a trained "
                f"*ForSequenceClassification reward model with one label{_REWARD_MODEL_KEY}"
            )
    disable_dropout(model)
    if kind == "causal_lm":
        contiguous_head_input(model)  # frozen heads (a rollout's, a reference's) read per row otherwise
    model.to(device)
    model.eval()
    return model


def position_ids(attention_mask: Tensor) -> Tensor:
    """``cumsum(attention_mask) - 1`` clipped at 0 (never arange: prompts are left-padded)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def sequence_inputs(batch: TensorBatch) -> tuple[Tensor, Tensor, Tensor]:
    """Input ids, attention mask (bool) and position ids of prompt + response."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    return ids, mask, position_ids(mask)


def token_outputs(
    model: Any,
    batch: TensorBatch,
    outputs: Collection[str],
    *,
    kind: ModelKind,
    temperature: float,
    always_run: bool = False,
    packed: bool = False,
) -> dict[str, Tensor]:
    """Per-response-token ``log_probs``/``entropy`` (causal LM) or ``values`` (value model).

    Runs one forward (with autograd when enabled by the caller) and returns float32 tensors
    [batch, response] that hold 0 where ``batch.loss_mask`` is False (observation tokens of a
    multi-turn response are attended to, through ``response_mask``, but get no output). A batch without response
    columns skips the model unless ``always_run`` (sharded models need every rank's forward).
    With ``packed`` (a model set to :data:`PACKED_SDPA`) the padding is dropped and the sequences
    run as one packed row (:func:`_packed_outputs`); the outputs are the same.
    """
    if packed and batch.response_len > 0 and batch.prompt_len > 0:
        got = _packed_outputs(model, batch, outputs, kind=kind, temperature=temperature)
        if got is not None:
            return got
    ids, mask, pos = sequence_inputs(batch)
    p, r = batch.prompt_len, batch.response_len
    lmask = batch.loss_mask
    result: dict[str, Tensor] = {}
    if r == 0:
        if not always_run:
            zeros = torch.zeros(batch.batch_size, 0, dtype=torch.float32, device=ids.device)
            return {name: zeros for name in outputs}
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False,
                    **({} if kind == "value" else {"logits_to_keep": 1}))
        # Zero-width outputs that stay connected to the graph (backward reaches every parameter).
        empty = out.logits[:, :0, 0].float()
        return {name: empty for name in outputs}
    if kind == "value":
        out = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False)
        values = out.logits[:, p - 1 : p + r - 1, 0].float()
        result["values"] = torch.where(lmask, values, 0.0)
        return result
    # Only the r + 1 last positions need the LM head: p - 1 .. p + r - 1, of which the last is unused.
    out = model(
        input_ids=ids, attention_mask=mask.long(), position_ids=pos, use_cache=False,
        logits_to_keep=r + 1,
    )
    lp, ent = token_log_probs(
        out.logits[:, :r], batch["response_ids"], temperature=temperature, entropy="entropy" in outputs
    )
    if "log_probs" in outputs:
        result["log_probs"] = torch.where(lmask, lp, 0.0)
    if ent is not None:
        result["entropy"] = torch.where(lmask, ent, 0.0)
    return result


def _packed_outputs(
    model: Any, batch: TensorBatch, outputs: Collection[str], *, kind: ModelKind, temperature: float
) -> dict[str, Tensor] | None:
    """:func:`token_outputs` without padding: every real token of the micro-batch in one row
    (None for a micro-batch without loss tokens, which the padded path runs).

    Each sequence (its prompt, then its response) keeps its own positions ``0 .. len - 1``; the
    cumulative sequence lengths reach :func:`packed_sdpa` through the model's keyword arguments
    (transformers passes them down to every attention call, also when a checkpointed layer is
    recomputed), so no sequence attends to another. Only the hidden states of the tokens that
    precede a loss token (``batch.loss_mask``) go through the LM head (``logits_to_keep`` as
    indices); the per-token results are scattered back to ``[batch, response]`` with zeros
    elsewhere. The sizes are read with one host synchronisation; every gather after it has a known size.
    """
    ids, mask, pos = sequence_inputs(batch)
    p, r = batch.prompt_len, batch.response_len
    lmask = batch.loss_mask
    lengths = mask.sum(1, dtype=torch.int32)
    tokens, scored, max_len = (int(v) for v in torch.stack(
        [lengths.sum(), lmask.sum(), lengths.max()]).tolist())
    if scored == 0:
        return None
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    real = mask.flatten().nonzero_static(size=tokens).squeeze(1)  # row-major, as mask indexing
    at = lmask.flatten().nonzero_static(size=scored).squeeze(1)
    # index in the packed row of every real token; response token t reads the token before it
    where = (mask.flatten().long().cumsum(0) - 1).view_as(mask)
    keep = where[:, p - 1 : p + r - 1].reshape(-1).index_select(0, at)
    inputs: dict[str, Any] = {
        "input_ids": ids.flatten().index_select(0, real).unsqueeze(0),
        "position_ids": pos.flatten().index_select(0, real).unsqueeze(0), "use_cache": False,
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len,
    }
    if kind == "value":
        values = model(**inputs).logits[0, keep, 0].float()
        return {"values": _unpack(values, at, lmask.shape)}
    logits = model(**inputs, logits_to_keep=keep).logits
    targets = batch["response_ids"].flatten().index_select(0, at).unsqueeze(0)
    lp, ent = token_log_probs(logits, targets, temperature=temperature, entropy="entropy" in outputs)
    result: dict[str, Tensor] = {}
    if "log_probs" in outputs:
        result["log_probs"] = _unpack(lp[0], at, lmask.shape)
    if ent is not None:
        result["entropy"] = _unpack(ent[0], at, lmask.shape)
    return result


def _unpack(values: Tensor, at: Tensor, shape: torch.Size) -> Tensor:
    """``values`` at the flat positions ``at`` of a ``shape`` tensor, 0 elsewhere."""
    flat = torch.zeros(math.prod(shape), dtype=values.dtype, device=values.device)
    return flat.index_copy(0, at, values).view(shape)


def cache_keyword(model: nn.Module) -> str:
    """The keyword a causal LM's forward takes its KV cache by, and the attribute its output
    returns it in: ``cache`` (transformers >= 5.2x, where ``past_key_values`` is deprecated) or
    ``past_key_values`` (earlier releases, and models whose forward names no ``cache``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
