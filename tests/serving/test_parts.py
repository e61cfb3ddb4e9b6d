"""The server's parts on their own: stop strings, sampling, the adapter pool, the padded cache, LoRA stacking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from symbiosis.serving.adapters import AdapterPool, AdapterPoolFullError, UnknownAdapterError
from symbiosis.serving.detokenize import IncrementalText
from symbiosis.serving.kvcache import PaddedBatch, left_pad
from symbiosis.serving.lora import AdapterFormatError, LoraAdapter, LoraModule, RowAdapters, read_lora_config
from symbiosis.serving.sampling import RowSampler, SamplingParams, choose_tokens


class CharTokenizer:
    """Token id = character code; enough to test text release."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def released(stop: tuple[str, ...], text: str) -> tuple[list[str], str, bool]:
    stream = IncrementalText(CharTokenizer(), stop)
    deltas = []
    for char in text:
        deltas.append(stream.add(ord(char)))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return [d for d in deltas if d], stream.text, stream.stopped


def test_text_is_released_as_it_becomes_final_and_cut_at_a_stop_string():
    deltas, text, stopped = released(("END",), "abcENxyzENDtail")
    assert text == "abcENxyz" and stopped and "".join(deltas) == "abcENxyz"
    assert "abcEN" not in deltas  # "EN" was held back until it could no longer start "END"


def test_text_without_stop_strings_is_released_token_by_token():
    deltas, _, stopped = released((), "hello")
    assert deltas == list("hello") and not stopped


def test_sampling_filters_and_seeds():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0], [1.0, 0.0, 0.0, 9.0]])
    greedy = RowSampler(SamplingParams(temperature=0))
    assert choose_tokens(logits, [greedy, greedy]) == [1, 3]
    top1 = RowSampler(SamplingParams(temperature=1.0, top_k=1, seed=0))
    assert {top1.choose(logits[0]) for _ in range(20)} == {1}
    nucleus = RowSampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    assert {nucleus.choose(logits[0]) for _ in range(20)} == {1}  # token 1 alone holds > 0.5
    a, b = (RowSampler(SamplingParams(temperature=1.5, seed=3)) for _ in range(2))
    assert [a.choose(logits[0]) for _ in range(10)] == [b.choose(logits[0]) for _ in range(10)]


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, Path(name), {"m": LoraModule(torch.ones(1, 2), torch.ones(2, 1), 1.0)})


def test_pool_keeps_at_most_max_loaded_and_never_drops_adapters_in_use(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    loads = []
    pool = AdapterPool(lambda name, path: loads.append(name) or _adapter(name), adapter_dir=tmp_path, max_loaded=2)
    a = pool.acquire("a")
    b = pool.acquire("b")
    assert not pool.can_acquire("c")
    with pytest.raises(AdapterPoolFullError):
        pool.acquire("c")
    pool.release(a)
    pool.acquire("c")  # a (free, least recently used) makes room
    assert pool.loaded_count == 2 and loads == ["a", "b", "c"]
    pool.release(b)
    assert pool.acquire("a") is not a  # read again from disk
    with pytest.raises(UnknownAdapterError):
        pool.acquire("missing")
    pool.unload("b")
    assert "b" not in pool.names()


def test_only_plain_lora_adapters_are_accepted(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    with pytest.raises(AdapterFormatError, match="serves LoRA"):
        read_lora_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    with pytest.raises(AdapterFormatError, match="DoRA"):
        read_lora_config(tmp_path)


def test_rows_get_only_their_own_adapters_update():
    first = LoraAdapter("x", Path("x"), {"m": LoraModule(torch.randn(2, 3), torch.randn(4, 2), 0.5)})
    second = LoraAdapter("y", Path("y"), {"m": LoraModule(torch.randn(5, 3), torch.randn(4, 5), 2.0)})
    rows = RowAdapters([first, None, second, first])
    a_cat, b_cat, mask, scaling = rows.stacked("m")
    x = torch.randn(4, 1, 3)
    update = ((x @ a_cat.T) * mask[:, None, :]) @ b_cat.T * scaling[:, None, None]
    for row, adapter in enumerate([first, None, second, first]):
        expected = (
            torch.zeros(1, 4)
            if adapter is None
            else (x[row] @ adapter.modules["m"].a.T) @ adapter.modules["m"].b.T * adapter.modules["m"].scaling
        )
        torch.testing.assert_close(update[row], expected)
    assert rows.stacked("other") is None


def _batch(lengths: list[int]) -> PaddedBatch:
    _, mask, _ = left_pad([[1] * n for n in lengths], 0)
    cache = DynamicCache()
    keys = (
        mask[:, None, :, None].float().expand(len(lengths), 1, mask.shape[1], 2).clone()
        * torch.arange(1, len(lengths) + 1)[:, None, None, None]
    )
    cache.update(keys, keys.clone(), 0)
    return PaddedBatch(cache, mask, mask.sum(-1))


def test_padded_batches_merge_and_shrink_without_losing_rows():
    merged = _batch([3, 1]).merge(_batch([5]))
    assert merged.mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    assert merged.positions.tolist() == [3, 1, 5]
    kept = merged.select([0, 1])  # the longest row left: its columns go
    assert kept.mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    keys = kept.cache.layers[0].keys
    assert keys.shape[2] == 3 and keys[0, 0, :, 0].tolist() == [1, 1, 1] and keys[1, 0, :, 0].tolist() == [0, 0, 2]
