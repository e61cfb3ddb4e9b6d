"""Fine-tuning job: the adapter it writes is a plain PEFT adapter, resume is exact, data and
method registries behave, and a split model trains under ``transformers.Trainer`` unchanged."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import symbiosis
from symbiosis.errors import UnsupportedPeftMethodError
from symbiosis.jobs.client import ClientOptions
from symbiosis.jobs.data import IGNORE_INDEX, BatchOrder, DataError, Record, collate, read_jsonl, split_eval, tokenize
from symbiosis.jobs.finetune import FinetuneOptions, StepRecord, TrainOptions, finetune, lr_lambda
from symbiosis.jobs.methods import METHODS, MethodOptions, build_peft_config, get_method, ia3_modules
from symbiosis.jobs.tasks import get_task, make_split


def write_task_data(path: Path, task: str = "reverse", n: int = 40) -> Path:
    split = make_split(get_task(task))
    with path.open("w") as f:
        for record in split.train[:n]:
            f.write(json.dumps({"prompt": record.prompt, "completion": record.completion}) + "\n")
    return path


def options(model: Path, data: Path, output: Path, **train) -> FinetuneOptions:
    return FinetuneOptions(
        model=model,
        data=data,
        output=output,
        client=ClientOptions(embedded=True),
        method=train.pop("method", "lora"),
        method_options=train.pop("method_options", MethodOptions(rank=4, alpha=8)),
        train=TrainOptions(**{"steps": 4, "lr": 1e-2, "batch_size": 4, **train}),
        progress=False,
    )


# ---- data ------------------------------------------------------------------------------------


def test_prompt_tokens_are_not_trained_on(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    example = tokenize(tokenizer, Record("ABC=", "CBA"), seq_len=64)
    assert example.labels[:4] == [IGNORE_INDEX] * 4
    assert example.labels[4:] == example.input_ids[4:]
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example.input_ids[4:-1]) == "CBA"
    plain = tokenize(tokenizer, Record("", "hello world"), seq_len=64)
    assert IGNORE_INDEX not in plain.labels
    assert len(tokenize(tokenizer, Record("", "hello world"), seq_len=2).input_ids) == 2


def test_collate_pads_right_with_masked_labels(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    a, b = tokenize(tokenizer, Record("A=", "B"), 64), tokenize(tokenizer, Record("ABCD=", "DCBA"), 64)
    batch = collate([a, b], pad_token_id=0)
    assert batch["input_ids"].shape == (2, len(b.input_ids))
    assert batch["attention_mask"][0].tolist() == [1] * len(a.input_ids) + [0] * (len(b.input_ids) - len(a.input_ids))
    assert (batch["labels"][0, len(a.input_ids) :] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"prompt": "only a prompt"}', "expected a 'text' key"),
        ('{"text": 3}', "'text' must be a non-empty string"),
        ('{"prompt": "x", "completion": ""}', "non-empty"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"data.jsonl:3: .*{message}"):
        read_jsonl(path)


def test_empty_and_missing_data_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        read_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "n, fraction, expected_eval", [(0, 0.1, 0), (1, 0.5, 0), (10, 0.0, 0), (10, 0.1, 1), (10, 0.25, 2)]
)
def test_split_eval_sizes(n, fraction, expected_eval):
    train, evaluation = split_eval(list(range(n)), fraction, seed=0)
    assert len(evaluation) == expected_eval and sorted(train + evaluation) == list(range(n))


def test_batch_order_resumes_from_its_state():
    a = BatchOrder(10, 3, seed=1)
    seen = [a.next_indices() for _ in range(5)]  # crosses an epoch boundary (10 = 3+3+3+1)
    assert sorted(sum(seen[:4], [])) == list(range(10)) and len(seen[3]) == 1
    b = BatchOrder(10, 3, seed=1)
    b.load_state_dict(BatchOrder(10, 3, seed=1).state_dict())
    b.load_state_dict({"epoch": 0, "index": 6})
    assert [b.next_indices() for _ in range(2)] == seen[2:4]


def test_lr_schedules():
    assert [lr_lambda("constant", 2, 10)(s) for s in (0, 1, 2, 9)] == [1 / 3, 2 / 3, 1.0, 1.0]
    linear = lr_lambda("linear", 0, 10)
    assert linear(0) == 1.0 and linear(5) == 0.5 and linear(10) == 0.0
    cosine = lr_lambda("cosine", 0, 10)
    assert cosine(0) == 1.0 and abs(cosine(5) - 0.5) < 1e-9 and cosine(10) == 0.0


# ---- methods ----------------------------------------------------------------------------------


def test_unknown_method_lists_supported():
    with pytest.raises(
        UnsupportedPeftMethodError, match="supported: lora, ia3, adalora, loha, lokr, prefix, prompt, p_tuning"
    ):
        get_method("qlora-xl")


def test_peft_config_file_overrides_and_rejects_unknown_keys(tiny_checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
    config = build_peft_config("lora", model, MethodOptions(rank=4), {"r": 2, "target_modules": ["q_proj"]})
    assert config.r == 2 and set(config.target_modules) == {"q_proj"}
    with pytest.raises(UnsupportedPeftMethodError, match="no option"):
        build_peft_config("lora", model, MethodOptions(), {"not_an_option": 1})


def test_ia3_modules_from_peft_table_and_from_structure(tiny_checkpoint):
    llama = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
    assert ia3_modules(llama)[1] == ["down_proj"]
    llama.config.model_type = "not-in-peft-tables"  # force the structural fallback
    targets, feedforward = ia3_modules(llama)
    assert feedforward == ["down_proj"] and "k_proj" in targets and "down_proj" in targets


def test_ia3_modules_keep_only_what_the_model_has_and_say_what_is_missing(tiny_checkpoint):
    """peft's table names mixtral's "w2", the experts' MLP output before transformers 5 made all
    experts one tensor: peft matched k/v and said nothing, and the adapter scaled no MLP."""
    mixtral = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"))
    with pytest.warns(UserWarning, match="scales \\['k_proj', 'v_proj'\\] only"):
        assert ia3_modules(mixtral) == (["k_proj", "v_proj"], [])


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_builds_and_trains_on_a_split_model(method, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        model = symbiosis.load_client_model(path, executor=executor)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = peft.get_peft_model(
                model, build_peft_config(method, model, MethodOptions(rank=2, num_virtual_tokens=2, total_steps=4))
            )
        ids = torch.tensor([[5, 6, 7, 8]])
        peft_model(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in peft_model.parameters() if p.requires_grad]
        assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
        model.symbiosis_transport.close()


# ---- the job ---------------------------------------------------------------------------------


def test_finetuned_adapter_loads_in_plain_peft_with_equal_logits(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    data = write_task_data(tmp_path / "reverse.jsonl")
    output = tmp_path / "adapter"
    result = finetune(options(path, data, output, steps=3, eval_fraction=0.2, eval_every=2))
    assert (output / "adapter_config.json").is_file() and (output / "adapter_model.safetensors").is_file()
    assert (output / "loss.png").stat().st_size > 0
    log = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and "eval_loss" in log[1] and "eval_loss" in log[2]
    assert result.losses == [r["loss"] for r in log]
    assert not list(tmp_path.glob(".adapter.tmp-*"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), output)
        trained = {n: p for n, p in reference.named_parameters() if "lora_B" in n}
        assert trained and all(p.abs().sum() > 0 for p in trained.values()), (
            "training left lora_B at 0: test could not fail"
        )
        with symbiosis.BaseExecutor.from_pretrained(path) as executor:
            split = peft.PeftModel.from_pretrained(symbiosis.load_client_model(path, executor=executor), output)
            ids = torch.tensor([[65, 66, 67, 30, 67, 66, 65]])
            with torch.no_grad():
                torch.testing.assert_close(
                    split(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5
                )
            split.get_base_model().symbiosis_transport.close()


def test_finetune_against_a_served_executor(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    data = write_task_data(tmp_path / "copy.jsonl", task="copy", n=8)
    with symbiosis.BaseExecutor.from_pretrained(path) as executor:
        server = executor.serve(f"ipc://{tmp_path}/executor.sock")
        job = options(path, data, tmp_path / "adapter", steps=2, method="ia3", method_options=MethodOptions())
        job.client = ClientOptions(executor=server.address, connect_timeout_s=5)
        result = finetune(job)
        served = sum(layer["requests"] for layer in executor.stats()["layers"].values())
    assert result.steps == 2 and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert served > 0, "the base layers were not served by the executor"
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["peft_type"] == "IA3"


class Interrupt(Exception):
    pass


def test_resume_continues_exactly(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")
    data = write_task_data(tmp_path / "reverse.jsonl", n=20)
    # Dropout and grad accumulation make the RNG state and the data position matter.
    common = dict(
        steps=6,
        save_every=3,
        grad_accum=2,
        batch_size=3,
        lr_schedule="linear",
        warmup_steps=2,
        method_options=MethodOptions(rank=4, dropout=0.2),
    )
    full = finetune(options(path, data, tmp_path / "full", **copy.deepcopy(common)))

    def stop_after_checkpoint(record: StepRecord) -> None:
        if record.step == 4:  # the checkpoint of step 3 exists; step 4 is lost
            raise Interrupt

    interrupted = options(path, data, tmp_path / "resumed", **copy.deepcopy(common))
    with pytest.raises(Interrupt):
        finetune(interrupted, on_step=stop_after_checkpoint)
    assert not (tmp_path / "resumed").exists(), "an interrupted run must not leave an adapter"
    interrupted.resume = True
    torch.manual_seed(1234)  # resume must not depend on the process's RNG state
    resumed = finetune(interrupted)

    assert len(resumed.losses) == 6
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses), rtol=1e-6, atol=1e-7)
    from safetensors.torch import load_file

    a, b = (
        load_file(tmp_path / "full" / "adapter_model.safetensors"),
        load_file(tmp_path / "resumed" / "adapter_model.safetensors"),
    )
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_transformers_trainer_trains_a_split_model_like_the_monolithic_one(bf16, tiny_checkpoint, tmp_path):
    """Trainer, unchanged; with ``bf16=True`` (autocast) against an executor in bf16."""
    from transformers import Trainer, TrainingArguments

    from tests.reference import make_pair

    path = tiny_checkpoint("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = [tokenize(tokenizer, r, 32) for r in make_split(get_task("sort")).train[:8]]
    dataset = [{"input_ids": e.input_ids, "labels": e.labels} for e in examples]

    def collator(features):
        from symbiosis.jobs.data import TokenizedExample

        return collate([TokenizedExample(f["input_ids"], f["labels"]) for f in features], tokenizer.pad_token_id)

    def train(model, name):
        args = TrainingArguments(
            output_dir=str(tmp_path / name),
            max_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            dataloader_num_workers=0,
            bf16=bf16,
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        return losses, changed, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    with symbiosis.BaseExecutor.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32) as executor:
        reference, split = make_pair(path, executor, "lora", "llama")
        ref_losses, ref_changed, ref_params = train(reference, "reference")
        losses, changed, params = train(split, "split")
        split.get_base_model().symbiosis_transport.close()
    assert len(losses) == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    adapter = {n for n, p in split.named_parameters() if p.requires_grad}
    assert changed and changed <= adapter, f"non-adapter parameters changed: {sorted(changed - adapter)[:3]}"
    assert changed == ref_changed
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-3, atol=1e-5)


def test_bf16_runs_forward_passes_under_autocast_and_is_part_of_what_a_resume_checks(tiny_checkpoint, tmp_path):
    """``--bf16`` is transformers' ``Trainer(bf16=True)``: the forward under bfloat16 autocast (its
    products travel in bf16: loss within bf16 rounding of the float32 run's, not equal to it), the
    adapters in float32. A checkpoint records it: resumed without it, the run is refused; a
    checkpoint written before the flag existed resumes as float32."""
    from symbiosis.jobs.base import JobError

    path = tiny_checkpoint("llama")
    data = write_task_data(tmp_path / "reverse.jsonl", n=12)
    full = finetune(options(path, data, tmp_path / "fp32", steps=2))
    mixed = options(path, data, tmp_path / "bf16", steps=2, save_every=1, bf16=True)
    result = finetune(mixed)
    assert result.losses[0] != full.losses[0]
    torch.testing.assert_close(torch.tensor(result.losses[0]), torch.tensor(full.losses[0]), rtol=2e-2, atol=0)
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "bf16" / "adapter_model.safetensors").values()} == {torch.float32}

    state_file = next((tmp_path / "bf16.run" / "checkpoints").glob("step-*")) / "trainer_state.pt"
    assert torch.load(state_file, weights_only=False)["options"]["bf16"] is True
    again = options(path, data, tmp_path / "bf16", steps=2, save_every=1)
    again.resume = True
    with pytest.raises(JobError, match="bf16"):
        finetune(again)
    state = torch.load(state_file, weights_only=False)
    del state["options"]["bf16"]  # as written before the flag
    torch.save(state, state_file)
    assert len(finetune(again).losses) == 2
