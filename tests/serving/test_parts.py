"""The server's parts on their own: stop strings, sampling, the adapter pool, the padded cache, LoRA layouts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from symbiosis.serving import lora as lora_module
from symbiosis.serving.adapters import AdapterPool, AdapterPoolFullError, UnknownAdapterError
from symbiosis.serving.detokenize import IncrementalText
from symbiosis.serving.kvcache import PaddedBatch, left_pad, roomy_cache
from symbiosis.serving.lora import (
    AdapterContext,
    AdapterFormatError,
    GatheredUpdate,
    LoraAdapter,
    LoraModule,
    MultiLoraLinear,
    RowAdapters,
    StackedUpdate,
    choose_layout,
    load_lora_adapter,
    read_lora_config,
)
from symbiosis.serving.sampling import RowSampler, SamplingParams, choose_tokens, prompt_logprobs, rows_logprobs


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


def test_stop_strings_count_only_from_min_tokens_on():
    stream = IncrementalText(CharTokenizer(), ("ab",), min_tokens=4)
    deltas = [stream.add(ord(char)) for char in "xabyab"]
    # "ab" ends at the 3rd token (too early: passed over), then again at the 6th.
    assert stream.stopped and stream.text == "xaby" and "".join(deltas) == "xaby"
    early = IncrementalText(CharTokenizer(), ("ab",), min_tokens=2)
    assert [early.add(ord(c)) for c in "ab"] and early.stopped and early.text == ""


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


def test_extreme_parameters_still_choose_the_limit_token(monkeypatch):
    """Valid but extreme parameters leave no distribution to draw from (the softmax of inf/NaN):
    a temperature under 1e-5 is greedy (vLLM's rule), and a row whose scores overflow takes its
    most likely token instead of drawing (``multinomial`` raised, which failed every sequence in
    the batch). No case below draws: each must take that limit."""
    drawn = []
    real_multinomial = torch.multinomial

    def counted(*args, **kwargs):
        token = real_multinomial(*args, **kwargs)
        drawn.append(token)
        return token

    monkeypatch.setattr(torch, "multinomial", counted)
    tiny = RowSampler(SamplingParams(temperature=1e-300, seed=0))
    assert tiny.params.greedy and choose_tokens(torch.tensor([[0.5, 3.0, 2.0, -1.0]]), [tiny]) == [1]
    # A penalty past float32's range on tokens already seen: a seen score of exactly 0 becomes
    # 0 x inf = NaN (the softmax is NaN everywhere); the limit is the best other token.
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    crushing = RowSampler(SamplingParams(temperature=1.0, repetition_penalty=1e308, seed=0), (0, 1))
    assert choose_tokens(logits, [crushing]) == [2]
    greedy_crushing = RowSampler(SamplingParams(temperature=0, repetition_penalty=1e308), (0, 1))
    assert choose_tokens(logits, [greedy_crushing]) == [2]  # greedy: NaN is not the arg-max either
    # A penalty so small that dividing by it overflows: the seen tokens' scores become +inf (the
    # softmax NaN); the first of them is taken.
    exploding = RowSampler(SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=0), (1, 2))
    assert choose_tokens(logits, [exploding]) == [1]
    # Every token held back (min_tokens, every id an end of sequence): still a token, not an error.
    nothing = RowSampler(SamplingParams(temperature=1.0, min_tokens=1, seed=0), eos_ids=frozenset(range(4)))
    assert choose_tokens(logits, [nothing]) == [0]  # all -inf: the first
    assert not drawn


def test_a_row_whose_choice_raises_is_reported_alone():
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])

    class Broken(RowSampler):
        def choose(self, logits):
            raise RuntimeError("a bug")

    good, broken = RowSampler(SamplingParams(temperature=1.0, top_k=1, seed=0)), Broken(SamplingParams(temperature=1.0))
    failures = {}
    tokens = choose_tokens(logits, [good, broken], failures)
    assert tokens[0] == 1 and list(failures) == [1] and good.generated == 1 and broken.generated == 0
    with pytest.raises(RuntimeError, match="a bug"):
        choose_tokens(logits, [good, broken])


def test_repetition_penalty_is_transformers_own():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 3
    prompt, generated = [3, 7, 7, 11], [20, 3, 41]
    sampler = RowSampler(SamplingParams(temperature=0, repetition_penalty=1.7), tuple(prompt))
    for token in generated:
        sampler.record(token)
    seen = torch.tensor([prompt + generated])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(seen, logits.clone())[0]
    assert torch.equal(sampler.penalize(logits[0]), expected)
    assert choose_tokens(logits, [sampler]) == [int(expected.argmax())]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 6)
    logits[0, 2] = 1.0  # the favourite, until it has been generated twice
    sampler = RowSampler(SamplingParams(temperature=0, presence_penalty=0.25, frequency_penalty=0.5), (2, 2, 2))
    chosen = choose_tokens(logits, [sampler]) + choose_tokens(logits, [sampler]) + choose_tokens(logits, [sampler])
    assert chosen == [2, 2, 0]  # 1.0 -> 1 - 0.25 - 0.5 = 0.25 -> 1 - 0.25 - 1.0 < 0: token 0 (0.0) wins
    penalized = sampler.penalize(logits[0])
    assert penalized[2] == 1.0 - 0.25 - 2 * 0.5 and penalized[0] == -0.25 - 0.5 and penalized[1] == 0.0
    plain = RowSampler(SamplingParams(temperature=0))
    assert not plain.own_pass and choose_tokens(logits, [plain]) == [2] and not plain.output_counts


def test_logit_bias_min_tokens_and_min_p():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    biased = RowSampler(SamplingParams(temperature=0, logit_bias=((1, -5.0), (3, 0.5))))
    assert biased.penalize(logits[0]).tolist() == [0.0, -2.0, 2.0, 1.5]
    assert choose_tokens(logits, [biased]) == [2]
    # Token 1 ends the sequence (an end-of-sequence id) and token 2 is a stop token id: both out of
    # reach for the first two tokens, then allowed.
    held = RowSampler(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,)), eos_ids=frozenset({1}))
    assert [choose_tokens(logits, [held])[0] for _ in range(3)] == [3, 3, 1]
    # min_p 0.3: only tokens at least 0.3 times as likely as the likeliest (token 1); token 2 has
    # e^-1 of its probability, token 3 e^-2.
    nucleus = RowSampler(SamplingParams(temperature=1.0, min_p=0.3, seed=0))
    assert {nucleus.choose(logits[0]) for _ in range(50)} == {1, 2}


def test_logprobs_are_the_raw_distributions_each_row_its_own_ask():
    small = rows_logprobs(torch.tensor([[2.0, 0.5, 3.0, -1.0]]), [1], [2])[0]
    expected = torch.log_softmax(torch.tensor([2.0, 0.5, 3.0, -1.0]), -1)
    assert small.token == 1 and small.logprob == float(expected[1])
    assert small.top == ((2, float(expected[2])), (0, float(expected[0])))  # most likely first
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    tokens, tops = [3, 0, 29, 7], [0, 2, 5, 1]
    for row, entry in enumerate(rows_logprobs(logits, tokens, tops)):
        alone = torch.log_softmax(logits[row], -1)
        values, ids = torch.topk(alone, tops[row]) if tops[row] else (torch.empty(0), torch.empty(0))
        assert entry.token == tokens[row] and abs(entry.logprob - float(alone[tokens[row]])) < 1e-6
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(v - w) < 1e-6 for (_, v), w in zip(entry.top, values.tolist()))


def test_prompt_logprobs_score_each_token_from_the_position_before_it():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2))  # the prompt's 5 positions
    prompt = [4, 9, 9, 1, 22]
    entries = prompt_logprobs(logits, prompt, 2)
    assert [e.token for e in entries] == prompt[1:]
    for position, entry in enumerate(entries):
        assert abs(entry.logprob - float(torch.log_softmax(logits[position], -1)[prompt[position + 1]])) < 1e-6
        assert [t for t, _ in entry.top] == torch.topk(logits[position], 2).indices.tolist()


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


@pytest.mark.parametrize("flaw", ["nan", "inf", "rank 0"])
def test_adapters_with_non_finite_weights_or_no_rank_are_refused(tmp_path, flaw):
    """A diverged fine-tuning job's adapter (NaN) must not load: in the stacked layout every row
    is multiplied by every adapter's columns, and 0 x NaN is NaN, so it would turn its
    batch-mates' logits to NaN (seen on a live server before this check: another adapter's
    greedy tokens beside it became [488, 0] instead of 8 tokens)."""
    from safetensors.torch import save_file

    rank = 0 if flaw == "rank 0" else 2
    a, b = torch.randn(rank, 3), torch.randn(4, rank)
    if flaw != "rank 0":
        a[0, 1] = float(flaw)
    prefix = "base_model.model.m"
    save_file({f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 4, "r": 2}))
    with pytest.raises(AdapterFormatError, match="NaN or infinite" if rank else "rank 0"):
        load_lora_adapter("x", tmp_path, {"m": (3, 4)}, dtype=torch.float32, device=torch.device("cpu"))
    if flaw == "nan":  # the same file with finite weights loads
        a[0, 1] = 0.5
        save_file(
            {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}, str(tmp_path / "adapter_model.safetensors")
        )
        loaded = load_lora_adapter("x", tmp_path, {"m": (3, 4)}, dtype=torch.float32, device=torch.device("cpu"))
        assert loaded.modules["m"].scaling == 2.0


@pytest.mark.parametrize("layout", ["stacked", "gathered"])
def test_rows_get_only_their_own_adapters_update(layout, monkeypatch):
    monkeypatch.setattr(lora_module, "GATHER_ABOVE_RANK_RATIO", 0 if layout == "gathered" else 1000)
    first = LoraAdapter("x", Path("x"), {"m": LoraModule(torch.randn(2, 3), torch.randn(4, 2), 0.5)})
    second = LoraAdapter("y", Path("y"), {"m": LoraModule(torch.randn(5, 3), torch.randn(4, 5), 2.0)})
    per_row = [first, None, second, first]
    context = AdapterContext()
    layer = MultiLoraLinear(torch.nn.Linear(3, 4), "m", context)
    x = torch.randn(4, 2, 3)
    context.rows = RowAdapters(per_row)
    with torch.no_grad():
        served = layer(x)
        base = layer.base_layer(x)
    for row, adapter in enumerate(per_row):
        lora = adapter.modules["m"] if adapter is not None else None
        expected = base[row] if lora is None else base[row] + (x[row] @ lora.a.T) @ lora.b.T * lora.scaling
        torch.testing.assert_close(served[row], expected)
    assert type(context.rows.update("m")).__name__.lower().startswith(layout)
    assert context.rows.update("other") is None
    context.rows = None
    torch.testing.assert_close(layer(x), layer.base_layer(x))  # no rows set: the base layer alone


def test_layout_follows_the_number_of_distinct_adapters():
    assert choose_layout([8]) is StackedUpdate
    assert choose_layout([8, 8, 8, 8]) is StackedUpdate  # Σr = 4 r_max: one large product is cheaper
    assert choose_layout([8] * 5) is GatheredUpdate
    assert choose_layout([64, 8, 8]) is StackedUpdate  # padding every row to rank 64 would cost more


def _batch(lengths: list[int]) -> PaddedBatch:
    _, mask, _ = left_pad([[1] * n for n in lengths], 0)
    cache = roomy_cache(spare_columns=2)
    keys = (
        mask[:, None, :, None].float().expand(len(lengths), 1, mask.shape[1], 2).clone()
        * torch.arange(1, len(lengths) + 1)[:, None, None, None]
    )
    cache.update(keys, keys.clone(), 0)
    return PaddedBatch(cache, mask, mask.sum(-1))


def test_padded_batches_merge_and_shrink_without_losing_rows():
    merged = _batch([3, 1]).merge(_batch([5]), spare_columns=4)
    assert merged.mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]
    assert merged.positions.tolist() == [3, 1, 5]
    kept = merged.select([0, 1], spare_columns=1)  # the longest row left: its columns go
    assert kept.mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    keys = kept.cache.layers[0].keys
    assert keys.shape[2] == 3 and keys[0, 0, :, 0].tolist() == [1, 1, 1] and keys[1, 0, :, 0].tolist() == [0, 0, 2]


def test_decode_steps_append_in_place_and_the_cache_grows_when_its_room_runs_out():
    batch = _batch([2, 1])  # 2 columns, room for 2 more
    layer = batch.cache.layers[0]
    buffer = layer._key_buffer
    assert batch.cache_bytes() == 2 * buffer.nbytes and buffer.shape[2] == 4
    plain = DynamicCache()
    plain.update(layer.keys.clone(), layer.values.clone(), 0)
    for step in range(3):  # the third step outgrows the room: the buffers are reallocated
        new = torch.full((2, 1, 1, 2), float(step + 10))
        keys, values = batch.cache.update(new, new.clone(), 0)
        expected_keys, expected_values = plain.update(new, new.clone(), 0)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    assert layer._key_buffer is not buffer and layer._key_buffer.shape[2] >= 5
    assert batch.cache.get_seq_length() == 5


def _age(file: Path, seconds: float = 10.0) -> None:
    """Date ``file`` back (the pool checks a file written within 2 s again on every listing)."""
    stamp = file.stat().st_mtime_ns - int(seconds * 1e9)
    os.utime(file, ns=(stamp, stamp))


def test_models_lists_only_adapter_folders_the_server_can_serve(tmp_path):
    """``/v1/models`` reads the pool's names: a folder of another PEFT method, a broken config,
    DoRA or no weights file is not listed (requesting it still gets the reason), and a config
    fixed later, or weights written later, are."""
    configs = {
        "lora": {"peft_type": "LORA"},
        "ia3": {"peft_type": "IA3"},
        "dora": {"peft_type": "LORA", "use_dora": True},
        "broken": None,
        "no-weights": {"peft_type": "LORA"},
    }
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{" if config is None else json.dumps(config))
        if name != "no-weights":
            (tmp_path / name / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "no-config").mkdir()
    pool = AdapterPool(lambda name, path: _adapter(name), adapter_dir=tmp_path)
    assert pool.names() == ["lora"]
    assert pool.path_of("ia3") == tmp_path / "ia3"  # servable by name: acquiring it gives the reason
    assert pool.path_of("no-weights") == tmp_path / "no-weights"
    broken = tmp_path / "broken" / "adapter_config.json"
    broken.write_text(json.dumps({"peft_type": "LORA"}))
    os.utime(broken, ns=(broken.stat().st_atime_ns, broken.stat().st_mtime_ns + 10**9))  # a later write
    assert pool.names() == ["broken", "lora"]
    (tmp_path / "no-weights" / "adapter_model.safetensors").write_bytes(b"")  # a job finished writing it
    assert pool.names() == ["broken", "lora", "no-weights"]


_SHAPES = {"layers.0.q": (3, 4), "layers.0.v": (3, 4)}  # a model's adaptable layers: module -> (in, out)
_OTHERS = frozenset({"layers", "layers.0", "embed", "lm_head"})  # its other modules


def _write_adapter(folder: Path, modules: dict[str, tuple[int, int]], rank: int = 2, **config) -> Path:
    """A peft-named LoRA safetensors file of ``modules`` (module -> (in, out)), ones everywhere."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (in_features, out_features) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.ones(rank, in_features)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.ones(out_features, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 4, **config}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how", ["header", "load"])
def test_an_adapter_of_another_model_is_refused_by_name_saying_which_model_it_was_made_for(tmp_path, how, monkeypatch):
    """An adapter of another architecture (modules this model lacks) or size (shapes that do not
    fit) says it does not fit, and which model it was made for, as ``symbiosis generate`` does;
    before, another architecture's was "not a base layer the server can adapt (embeddings and
    the output layer are not)". The error names the adapter, never its folder (it reaches HTTP
    clients), and the header check reads no tensor."""
    if how == "header":
        monkeypatch.setattr(lora_module, "load_file", lambda *a: pytest.fail("the header check read tensors"))

    def check(folder: Path) -> None:
        if how == "header":
            lora_module.check_lora_adapter("served", folder, _SHAPES, _OTHERS)
        else:
            load_lora_adapter("served", folder, _SHAPES, dtype=torch.float32, device="cpu", other_modules=_OTHERS)

    gpt2 = {"transformer.h.0.attn.c_attn": (3, 12), "transformer.h.1.attn.c_attn": (3, 12)}
    foreign = _write_adapter(tmp_path / "gpt2", gpt2, base_model_name_or_path="/home/someone/models/gpt2-tiny")
    with pytest.raises(AdapterFormatError) as refused:
        check(foreign)
    message = str(refused.value)
    assert message.startswith("adapter 'served' does not fit this model (it was made for 'gpt2-tiny'): ")
    assert "'transformer.h.0.attn.c_attn' (and 1 other module), which this model does not have" in message
    assert str(tmp_path) not in message and "/home/someone" not in message
    wider = _write_adapter(tmp_path / "wider", {"layers.0.q": (5, 6)}, base_model_name_or_path="org/llama-wide")
    with pytest.raises(AdapterFormatError, match=r"^adapter 'served' does not fit this model \(it was made for "):
        check(wider)
    with pytest.raises(AdapterFormatError, match=r"org/llama-wide'\): layers.0.q has A \(2, 5\) and B \(6, 2\)"):
        check(wider)
    with pytest.raises(AdapterFormatError, match="not a base layer the server can adapt"):
        check(_write_adapter(tmp_path / "head", {"lm_head": (3, 4)}))  # the model has it, but it is not served
    with pytest.raises(AdapterFormatError, match="rank 2 weights but its adapter_config.json says r=8"):
        check(_write_adapter(tmp_path / "rank", {"layers.0.v": (3, 4)}, r=8))
    check(_write_adapter(tmp_path / "fits", _SHAPES))


def test_adapters_are_checked_when_registered_and_listed_and_errors_name_them_not_their_folders(tmp_path, caplog):
    """``--adapter`` runs the pool's check at startup (before, only the config was read: an
    adapter of another model was accepted, and failed on its first request); ``--adapter-dir``
    lists only folders that pass it; a refused load names the adapter to the client and logs
    its folder."""
    folders = {
        "fits": _write_adapter(tmp_path / "dir" / "fits", _SHAPES),
        "gpt2": _write_adapter(tmp_path / "dir" / "gpt2", {"transformer.h.0.attn.c_attn": (3, 12)}),
        "wider": _write_adapter(tmp_path / "dir" / "wider", {"layers.0.q": (5, 4)}),
    }
    for folder in folders.values():
        for file in folder.iterdir():
            _age(file)

    def check(name, path):
        lora_module.check_lora_adapter(name, path, _SHAPES, _OTHERS)

    def load(name, path):
        return load_lora_adapter(name, path, _SHAPES, dtype=torch.float32, device="cpu", other_modules=_OTHERS)

    with pytest.raises(AdapterFormatError, match=r"^--adapter mine=.*gpt2: adapter 'mine' does not fit this model"):
        AdapterPool(load, check=check, adapters={"mine": folders["gpt2"]})
    checked = []
    pool = AdapterPool(
        load,
        check=lambda name, path: checked.append(name) or check(name, path),
        adapters={"mine": folders["fits"]},
        adapter_dir=tmp_path / "dir",
    )
    assert pool.names() == ["fits", "mine"]
    assert pool.names() == ["fits", "mine"] and sorted(checked) == ["fits", "gpt2", "mine", "wider"]  # once each
    with caplog.at_level("WARNING", logger="symbiosis.api"), pytest.raises(AdapterFormatError) as refused:
        pool.acquire("wider")
    assert "adapter 'wider' does not fit this model" in str(refused.value) and str(tmp_path) not in str(refused.value)
    assert str(folders["wider"]) in caplog.text
    assert pool.acquire("fits").modules.keys() == _SHAPES.keys()


def test_weights_of_another_rank_than_the_config_says_are_refused(tmp_path):
    """peft scales a LoRA update by lora_alpha / r of the config (or its rank_pattern) and refuses
    weights of another rank; serving them scaled by their own rank would differ from peft."""
    from safetensors.torch import save_file

    prefix = "base_model.model.layers.0"
    tensors = {
        f"{prefix}.{m}.lora_{p}.weight": t
        for m in ("q", "v")
        for p, t in (("A", torch.ones(2, 3)), ("B", torch.ones(4, 2)))
    }
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    shapes = {"layers.0.q": (3, 4), "layers.0.v": (3, 4)}

    def load(config):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8, **config}))
        return load_lora_adapter("x", tmp_path, shapes, dtype=torch.float32, device=torch.device("cpu"))

    with pytest.raises(AdapterFormatError, match=r"rank 2 weights but its adapter_config.json says r=8"):
        load({})  # peft's default r is 8
    with pytest.raises(AdapterFormatError, match="r=16"):
        load({"r": 2, "rank_pattern": {"v": 16}})
    with pytest.raises(AdapterFormatError, match="rank_pattern is not usable"):
        load({"r": 2, "rank_pattern": ["q"]})
    with pytest.raises(AdapterFormatError, match="alpha_pattern is not usable"):
        load({"r": 2, "alpha_pattern": {"(": 4}})
    adapter = load({"r": 4, "rank_pattern": {"q": 2, "v": 2}})
    assert {m.scaling for m in adapter.modules.values()} == {4.0}
    assert load({"r": 2}).modules["layers.0.q"].scaling == 4.0


def test_the_server_starts_without_importing_peft():
    """peft's import was ~2 s of every API server's start (and again in its engine process), for
    one helper that only adapters with a rank or alpha pattern need (``lora._pattern_key``)."""
    import subprocess
    import sys

    code = "import sys, symbiosis.serving.server, symbiosis.serving.engine_process; print('peft' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_a_prompt_over_the_context_length_is_tokenized_without_the_tokenizers_warning(tiny_checkpoint):
    """The server refuses such a prompt with a 400 naming both lengths; transformers' own "Token
    indices sequence length is longer than..." reached the server's log as well."""
    import logging

    from transformers import AutoTokenizer

    from symbiosis.serving.app import _encode

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))  # its own: the warning is once per tokenizer
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        ids = _encode(tokenizer, "word " * (tokenizer.model_max_length + 10), add_special_tokens=True)
    finally:
        library.removeHandler(handler)
    assert len(ids) > tokenizer.model_max_length
    assert not [r for r in records if "sequence length" in r.getMessage()]
