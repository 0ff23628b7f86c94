"""The model-folder rule every backend applies at build: pad, EOS and BOS ids are rows of the vocabulary, in
config.json, generation_config.json and the tokenizer's files; sliding_attention layers have a window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_conformance.testkit import (
    OUT_OF_VOCAB_FILES,
    OUT_OF_VOCAB_IDS,
    OUT_OF_VOCAB_TOKEN,
    out_of_vocab_file_model,
    out_of_vocab_model,
    tiny_model,
)
from verl_core import ConfigError, HFTokenizer
from verl_core.enginekit.model_folder import (
    check_layer_types,
    check_special_token_ids,
    check_tokenizer_ids,
)

_OK: dict[str, Any] = {"vocab_size": 128, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


@pytest.mark.parametrize("edit", [
    {}, {"pad_token_id": None}, {"eos_token_id": [1, 127]}, {"bos_token_id": 127},
    {"vocab_size": None, "pad_token_id": 500},  # nothing to compare with: the loader refuses what it cannot read
])
def test_ids_inside_the_vocabulary_or_absent_pass(edit: dict[str, Any]) -> None:
    check_special_token_ids("/m", {**_OK, **edit})


@pytest.mark.parametrize(("edit", "fragments"), [
    ({"pad_token_id": 128}, ["pad_token_id = 128, not in [0, 128)", "vocab_size 128", "padding_idx"]),
    ({"pad_token_id": -1}, ["pad_token_id = -1, not in [0, 128)", "a negative id does not mean none"]),
    ({"eos_token_id": [1, 131, 200]}, ["eos_token_id = [1, 131, 200]: 131, 200 are not in [0, 128)", "never stops"]),
    ({"bos_token_id": 128}, ["bos_token_id = 128, not in [0, 128)"]),
    ({"eos_token_id": "1"}, ["eos_token_id = '1'; expected a token id", "a list of them, or null"]),
    ({"pad_token_id": True}, ["pad_token_id = True; expected a token id"]),
    ({"vocab_size": 64, "text_config": {"vocab_size": 128, "pad_token_id": 130}},
     ["text_config.pad_token_id = 130, not in [0, 128)", "vocab_size 128"]),
])
def test_ids_outside_the_vocabulary_are_refused_by_name(edit: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        check_special_token_ids("/models/m", {**_OK, **edit})
    message = str(info.value)
    assert "model folder '/models/m': config.json sets" in message
    for fragment in fragments:
        assert fragment in message, message


def test_the_folder_is_read_when_no_config_is_given(tmp_path: Path) -> None:
    check_special_token_ids(tmp_path)  # no config.json: the engine's loader says what is missing
    (tmp_path / "config.json").write_text(json.dumps({**_OK, "eos_token_id": 128}))
    with pytest.raises(ConfigError, match=r"eos_token_id = 128, not in \[0, 128\)"):
        check_special_token_ids(tmp_path)


@pytest.mark.parametrize("key", OUT_OF_VOCAB_IDS)
def test_every_crafted_out_of_vocab_folder_is_refused(key: str) -> None:
    for head in ("causal_lm", "reward"):
        path = out_of_vocab_model(key, head)
        assert json.loads((path / "config.json").read_text())[key] == OUT_OF_VOCAB_IDS[key]
        with pytest.raises(ConfigError, match=key):
            check_special_token_ids(path)


# ------------------------------------------------------------------ generation_config.json and the tokenizer
def _folder(tmp: Path, **files: Any) -> Path:
    """A folder with config.json (_OK) and ``files`` (name with "." as "_": JSON content)."""
    (tmp / "config.json").write_text(json.dumps(_OK))
    for name, content in files.items():
        (tmp / name.replace("_json", ".json")).write_text(json.dumps(content))
    return tmp


def _tokenizer_json(size: int = 128, added: dict[str, int] | None = None) -> dict[str, Any]:
    """A WordLevel tokenizer.json: ids 0..3 special, then characters, ``size`` ids in all, plus ``added``."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    vocab.update({f"c{i}": i for i in range(4, size)})
    specials = [{"id": i, "content": t, "special": True} for t, i in list(vocab.items())[:4]]
    extra = [{"id": i, "content": t, "special": True} for t, i in (added or {}).items()]
    return {"added_tokens": specials + extra, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}


_TOKENIZER_CONFIG: dict[str, Any] = {"eos_token": "<eos>", "pad_token": "<pad>", "bos_token": "<bos>"}


@pytest.mark.parametrize("files", [
    {"generation_config_json": {"eos_token_id": [1, 127], "pad_token_id": 0, "bos_token_id": None}},
    {"tokenizer_json": _tokenizer_json(), "tokenizer_config_json": _TOKENIZER_CONFIG},
    # a tokenizer with fewer ids than the embedding has rows: fine, and so is a new token transformers adds there
    {"tokenizer_json": _tokenizer_json(100), "tokenizer_config_json": {**_TOKENIZER_CONFIG, "eos_token": "<end>"}},
    # more ids than the embedding, the special ones among its rows: fine
    {"tokenizer_json": _tokenizer_json(128, {"<tool>": 140}), "tokenizer_config_json": _TOKENIZER_CONFIG},
    # an AddedToken mapping, and a pad token of special_tokens_map.json
    {"tokenizer_json": _tokenizer_json(), "tokenizer_config_json": {"eos_token": {"content": "<eos>"}},
     "special_tokens_map_json": {"pad_token": {"content": "<pad>", "lstrip": False}}},
    # a SentencePiece tokenizer.model alone: no file gives the id, the loader reads it
    {"tokenizer_config_json": {"eos_token": "</s>"}},
])
def test_generation_config_and_tokenizer_ids_inside_the_vocabulary_pass(tmp_path: Path, files: dict[str, Any]) -> None:
    check_special_token_ids(_folder(tmp_path, **files))


@pytest.mark.parametrize(("files", "fragments"), [
    ({"generation_config_json": {"eos_token_id": [1, 131]}},
     ["generation_config.json sets eos_token_id = [1, 131]: 131 is not in [0, 128)", "never stops"]),
    ({"generation_config_json": {"pad_token_id": 128}},
     ["generation_config.json sets pad_token_id = 128, not in [0, 128)", "batches are padded with it"]),
    ({"generation_config_json": {"eos_token_id": "1"}}, ["generation_config.json sets eos_token_id = '1'; expected"]),
    ({"tokenizer_json": _tokenizer_json(128, {"<|end|>": 128}),
      "tokenizer_config_json": {**_TOKENIZER_CONFIG, "eos_token": "<|end|>"}},
     ["tokenizer_config.json sets eos_token = '<|end|>', id 128 in tokenizer.json (the tokenizer's eos_token_id), "
      "not in [0, 128)", "never stops", "resize the model's embedding"]),
    ({"tokenizer_json": _tokenizer_json(), "tokenizer_config_json": {**_TOKENIZER_CONFIG, "pad_token": "<PAD>"}},
     ["tokenizer_config.json sets pad_token = '<PAD>', a token tokenizer.json does not hold, which transformers adds "
      "after every id the tokenizer has: id 128 (the tokenizer's pad_token_id)", "batches are padded with it"]),
    ({"tokenizer_json": _tokenizer_json(128, {"<s>": 130}), "tokenizer_config_json": {},
      "special_tokens_map_json": {"bos_token": {"content": "<s>"}}},
     ["special_tokens_map.json sets bos_token = '<s>', id 130 in tokenizer.json"]),
    # ids from tokenizer_config.json's added_tokens_decoder (no tokenizer.json read)
    ({"tokenizer_config_json": {"eos_token": "</s>", "added_tokens_decoder": {"200": {"content": "</s>"}}}},
     ["eos_token = '</s>', id 200 in tokenizer_config.json's added_tokens_decoder"]),
])
def test_generation_config_and_tokenizer_ids_outside_the_vocabulary_are_refused(
    tmp_path: Path, files: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        check_special_token_ids(_folder(tmp_path, **files))
    message = str(info.value)
    assert f"model folder {str(tmp_path)!r}:" in message
    for fragment in fragments:
        assert fragment in message, message


def test_a_given_config_still_reads_the_folder_s_other_files(tmp_path: Path) -> None:
    _folder(tmp_path, generation_config_json={"eos_token_id": 128})
    with pytest.raises(ConfigError, match="generation_config.json sets eos_token_id = 128"):
        check_special_token_ids(tmp_path, _OK)


def test_a_unigram_vocabulary_gives_ids_by_position(tmp_path: Path) -> None:
    pieces = [["<pad>", 0.0], ["<eos>", 0.0]] + [[f"p{i}", -1.0] for i in range(2, 130)]
    folder = _folder(tmp_path, tokenizer_json={"model": {"type": "Unigram", "vocab": pieces}},
                     tokenizer_config_json={"eos_token": "p129"})
    with pytest.raises(ConfigError, match="eos_token = 'p129', id 129 in tokenizer.json"):
        check_special_token_ids(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    check_special_token_ids(folder)


@pytest.mark.parametrize("name", OUT_OF_VOCAB_FILES)
def test_every_crafted_file_folder_is_refused_and_transformers_agrees(name: str) -> None:
    from transformers import AutoTokenizer

    file, key, value = OUT_OF_VOCAB_FILES[name]
    for head in ("causal_lm", "reward"):
        path = out_of_vocab_file_model(name, head)
        config = json.loads((path / "config.json").read_text())
        check_special_token_ids(tmp := path / "config-only-view", config)  # config.json alone passes
        assert not tmp.exists()
        assert json.loads((path / file).read_text())[key] == value
        with pytest.raises(ConfigError) as info:
            check_special_token_ids(path)
        assert f"{file} sets {key} = " in str(info.value)
    tok = AutoTokenizer.from_pretrained(str(out_of_vocab_file_model("tokenizer-eos")))
    assert (tok.eos_token, tok.eos_token_id) == (OUT_OF_VOCAB_TOKEN, 128)  # what the refusal says transformers loads


def test_the_id_transformers_gives_a_token_the_tokenizer_lacks_is_the_one_refused(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    base = tiny_model()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((base / f).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<end>"}))
    assert AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id == 128
    with pytest.raises(ConfigError, match="eos_token = '<end>', a token tokenizer.json does not hold.*id 128"):
        check_special_token_ids(tmp_path)


def test_tokenizer_json_is_parsed_once_per_version_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import verl_core.enginekit.model_folder as model_folder

    reads: list[Path] = []
    read_json = model_folder._read_json

    def counting(file: Path) -> Any:
        if file.name == "tokenizer.json":
            reads.append(file)
        return read_json(file)

    monkeypatch.setattr(model_folder, "_read_json", counting)
    (tmp_path / "m").mkdir()
    folder = _folder(tmp_path / "m", tokenizer_json=_tokenizer_json(), tokenizer_config_json=_TOKENIZER_CONFIG)
    (tmp_path / "link").symlink_to(folder)
    for path in (folder, folder, tmp_path / "link"):  # each engine of a run checks the folder; a link is the file
        check_special_token_ids(path)
    assert len(reads) == 1
    # the file is written again: the next check reads the new ids (an EOS now past the vocabulary)
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json(128, {"<|end|>": 128})))
    (folder / "tokenizer_config.json").write_text(json.dumps({**_TOKENIZER_CONFIG, "eos_token": "<|end|>"}))
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"eos_token = '<\|end\|>', id 128 in tokenizer.json"):
            check_special_token_ids(folder)
    assert len(reads) == 2


# ------------------------------------------------------------------ a tokenizer object (a model built in memory)
class _Tok:
    """Special ids as a transformers tokenizer gives them (None: no such token)."""

    def __init__(self, pad: Any = 0, eos: Any = 1, bos: Any = None, eos_text: str | None = None) -> None:
        self.pad_token_id, self.eos_token_id, self.bos_token_id, self.eos_token = pad, eos, bos, eos_text

    def __len__(self) -> int:
        return 200


@pytest.mark.parametrize("tok", [_Tok(), _Tok(pad=None), _Tok(eos=127, bos=2), HFTokenizer(_Tok(pad=None), 500)])
def test_tokenizer_ids_among_the_embedding_rows_pass(tok: Any) -> None:
    check_tokenizer_ids(tok, 128)


@pytest.mark.parametrize(("tok", "fragments"), [
    (_Tok(eos=128, eos_text="<|end|>"), ["tokenizer _Tok: its eos_token_id = 128 ('<|end|>') is not in [0, 128)",
                                         "the model's vocabulary (128 rows of its input embedding)", "never stops"]),
    (_Tok(pad=130), ["its pad_token_id = 130 is not in [0, 128)", "batches are padded with it"]),
    (_Tok(pad=-1), ["its pad_token_id = -1 is not in [0, 128)", "a negative id does not mean none"]),
    (_Tok(bos=128), ["its bos_token_id = 128 is not in [0, 128)", "index outside the embedding"]),
    (_Tok(eos="1"), ["its eos_token_id = '1' is not a token id (an integer in [0, 128)"]),
    # the wrapped tokenizer's ids are checked whatever vocab_size the adapter was given
    (HFTokenizer(_Tok(eos=150), 200), ["tokenizer _Tok: its eos_token_id = 150 is not in [0, 128)"]),
])
def test_tokenizer_ids_past_the_embedding_are_refused_by_name(tok: Any, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        check_tokenizer_ids(tok, 128)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    if "not a token id" not in message:
        assert "give it a" in message and "resize the model's embedding to the tokenizer" in message


@pytest.mark.parametrize(("config", "refused"), [
    ({"use_sliding_window": False, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}, True),
    ({"use_sliding_window": True, "sliding_window": None, "layer_types": ["sliding_attention"]}, True),
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention"]}, False),
    ({"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention", "full_attention"]}, False),
    ({"use_sliding_window": False}, False),  # no layer_types: transformers derives full attention
    ({"layer_types": ["sliding_attention"]}, False),  # no use_sliding_window key (Llama reads no window)
])
def test_sliding_layers_without_a_window_are_refused_naming_layer_types(
    tmp_path: Path, config: dict[str, object], refused: bool
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    if not refused:
        check_layer_types(tmp_path)
        return
    with pytest.raises(ConfigError, match=r"layer_types marks layers \[0\] 'sliding_attention'.*no window"):
        check_layer_types(tmp_path)
    check_layer_types(tmp_path, {"model_type": "qwen2"})  # the config given wins over the file
