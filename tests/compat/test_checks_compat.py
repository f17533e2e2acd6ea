"""``assert_same_device`` against real transformers objects that hold large plain data.

A tokenizer keeps its vocabulary (about 150,000 str-to-int entries for Qwen2)
as a Python dict, and a pipeline holds that tokenizer next to its model: the
check reads the plain values in bulk, so neither is refused for holding more
than it looks through one by one, and a stray tensor beside them is still
found. Built offline from a generated vocabulary: nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import devicekit as dk

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def qwen2_tokenizer(size: int = 150_000) -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3}
    vocab.update({f"w{i}": i + 4 for i in range(size)})
    return transformers.Qwen2Tokenizer(vocab=vocab, merges=[("a", "b")])


def test_a_real_tokenizer_with_a_150k_vocabulary_is_checked_not_refused() -> None:
    # It raised ValueError: "tok is a Qwen2Tokenizer ... holds more than 100,000 objects".
    tok = qwen2_tokenizer()
    assert len(tok._vocab) > 150_000
    assert tok("ab")["input_ids"] == [3]
    assert dk.assert_same_device(tok=tok, x=torch.ones(1)) == torch.device("cpu")
    tok.stray = torch.ones(1, device="meta")
    with pytest.raises(dk.DeviceMismatchError, match=r"  tok\.stray: meta\n"):
        dk.assert_same_device(tok=tok, x=torch.ones(1))


def test_a_pipeline_holding_a_model_and_its_tokenizer_is_checked() -> None:
    transformers = pytest.importorskip("transformers")
    tok = qwen2_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tok._vocab),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.Qwen2ForCausalLM(config)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    assert dk.assert_same_device(pipe=pipe) == torch.device("cpu")
    model.lm_head.to("meta")
    with pytest.raises(dk.DeviceMismatchError, match=r"  pipe\.model\.lm_head\.weight: meta\n"):
        dk.assert_same_device(pipe=pipe)


def test_check_module_makes_no_false_claim_about_torchmetrics_states() -> None:
    # A Lightning model usually holds metrics: their states are plain attributes
    # that Metric._apply moves, so "module.to() will not move it" would be false.
    torchmetrics = pytest.importorskip("torchmetrics")
    metrics = torchmetrics.MetricCollection(
        {
            "acc": torchmetrics.classification.MulticlassAccuracy(num_classes=3),
            "mean": torchmetrics.aggregation.MeanMetric(),
        }
    )
    model = torch.nn.ModuleDict({"metrics": metrics, "head": torch.nn.Linear(2, 3)})
    assert dk.check_module(model) == []
    model.to("meta")
    assert metrics["acc"].tp.device.type == "meta"
