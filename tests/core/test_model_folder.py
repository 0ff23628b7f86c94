"""The model-folder rule every backend applies at build: pad, EOS and BOS ids are rows of the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_conformance.testkit import OUT_OF_VOCAB_IDS, out_of_vocab_model
from verl_core import ConfigError
from verl_core.enginekit.model_folder import check_special_token_ids

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
