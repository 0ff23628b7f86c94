"""The test kit every package's tests rely on: tiny models, tokenizer, reference, tolerances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_conformance.testkit import (
    ARCHS,
    VALUE_HEAD_BIAS,
    TinyModelSpec,
    assert_close,
    load_tokenizer,
    random_batch,
    reference_forward,
    tiny_model,
    value_bias_model,
)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_load_and_reference_matches_a_float32_forward(arch: str) -> None:
    import transformers

    path = tiny_model(TinyModelSpec(arch=arch, tied=arch == "qwen2"))  # type: ignore[arg-type]
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.head_dim >= 32
    assert config.num_key_value_heads % 2 == 0 and config.num_hidden_layers % 2 == 0
    batch = random_batch(batch_size=3, empty_responses=1, temperature=0.7)
    ref = reference_forward(path, batch)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    pos = (mask.long().cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    p, r = batch.prompt_len, batch.response_len
    logp = torch.log_softmax(logits[:, p - 1 : p + r - 1].float() / 0.7, -1)
    lp = logp.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]
    assert_close(lp, ref["log_probs"], dtype="float32", quantity="log_probs")
    assert not bool(ref["log_probs"][2].any()), "empty response gives zeros"
    with pytest.raises(AssertionError, match="outside the float32 tier"):
        assert_close(lp + 1e-3 * batch["response_mask"], ref["log_probs"], dtype="float32", quantity="log_probs")


def test_tokenizer_is_offline_char_level_with_pad_and_eos() -> None:
    tok = load_tokenizer(tiny_model())
    ids = tok.encode("12+30=42")
    assert len(ids) == 8
    assert tok.decode([*ids, tok.eos_token_id, tok.pad_token_id]) == "12+30=42"
    assert (tok.pad_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, 128)


def test_random_batch_is_well_formed() -> None:
    b = random_batch(batch_size=6, group_size=2, empty_responses=2, with_rl_fields=True)
    b.check(vocab_size=128)
    assert b["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    assert b["response_mask"][-2:].sum() == 0


def test_building_a_tiny_model_prints_no_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """transformers' "Writing model shards" bar is noise on the trainer's stderr (logging.progress=false
    included); the build leaves the progress-bar setting as it found it."""
    from transformers.utils import logging as hf_logging

    from verl_core.trainer.inputs.tiny_model import build_tiny_model

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # as in a fresh process
    try:
        build_tiny_model(tmp_path / "m", TinyModelSpec(num_layers=2))
        assert hf_logging.is_progress_bar_enabled(), "the build turned transformers' progress bars off for good"
    finally:
        if not was:
            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    out, err = capfd.readouterr()
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert "Writing model shards" not in err + out, err


def test_value_bias_model_moves_every_value_by_its_bias() -> None:
    """The value-head folder's score.bias is transformers' initial 0; value_bias_model's is VALUE_HEAD_BIAS,
    and nothing else differs, so each value of the float64 reference moves by exactly that."""
    from safetensors.torch import load_file

    from verl_conformance.reference import reference_outputs

    base, biased = tiny_model(TinyModelSpec(head="value")), value_bias_model()
    a, b = load_file(str(base / "model.safetensors")), load_file(str(biased / "model.safetensors"))
    assert float(a["score.bias"]) == 0.0 and float(b["score.bias"]) == VALUE_HEAD_BIAS != 0.0
    assert {n for n in a if not torch.equal(a[n], b[n])} == {"score.bias"}
    batch = random_batch(batch_size=3, empty_responses=1)
    got = reference_outputs(biased, batch, ("values",))["values"]
    want = reference_outputs(base, batch, ("values",))["values"]
    torch.testing.assert_close(got, (want + VALUE_HEAD_BIAS) * batch["response_mask"])
