"""--model base-shape has the real model's shapes, and --max-steps cuts a run short.

The figures that choose a strategy (model state per process, bytes communicated) depend on the
architecture, not on the trained values: base-shape must have exactly the parameters of
hfl/chinese-bert-wwm-ext, counted here from its published config, not by transformers' modules."""
import json
import math

import pytest

from conftest import BIN, ROOT, SMALL, free_port, read_result, run, small_split

CONFIG = json.loads((ROOT / "configs" / "models" / "chinese-bert-wwm-ext.json").read_text())["config"]
LABELS = 6


def bert_classifier_parameters(config, labels):
    """Parameters of BertForSequenceClassification, from the shapes its config implies."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    linear = lambda inputs, outputs: inputs * outputs + outputs  # weight and bias
    layer_norm = 2 * hidden
    embeddings = hidden * (config["vocab_size"] + config["max_position_embeddings"] + config["type_vocab_size"])
    attention = 4 * linear(hidden, hidden) + layer_norm  # query, key, value, output
    feed_forward = linear(hidden, inner) + linear(inner, hidden) + layer_norm
    return (embeddings + layer_norm + config["num_hidden_layers"] * (attention + feed_forward)
            + linear(hidden, hidden) + linear(hidden, labels))  # pooler, classifier


def test_the_config_is_bert_base_as_published():
    assert {key: CONFIG[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "intermediate_size", "max_position_embeddings", "type_vocab_size",
                                         "vocab_size")} == {
        "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
        "max_position_embeddings": 512, "type_vocab_size": 2, "vocab_size": 21128}
    assert bert_classifier_parameters(CONFIG, LABELS) == pytest.approx(102.3e6, rel=1e-3)


def test_base_shape_has_the_real_models_parameters_and_embedding():
    import torch

    from support import models
    texts = [text for text, _ in small_split()[0]]
    tokenizer, model = models.build_base_shape_model(texts, 123, {"num_labels": LABELS})
    assert models.parameter_count(model) == sum(p.numel() for p in model.parameters())
    assert models.parameter_count(model) == bert_classifier_parameters(CONFIG, LABELS)
    assert model.bert.embeddings.word_embeddings.weight.shape == (CONFIG["vocab_size"], CONFIG["hidden_size"])
    assert len(tokenizer) == CONFIG["vocab_size"]
    # The training characters keep the tiny model's ids; unused tokens only fill the vocabulary up.
    tiny_tokenizer, _ = models.build_tiny_model(texts, 123, {"num_labels": LABELS})
    assert tokenizer(texts[:20])["input_ids"] == tiny_tokenizer(texts[:20])["input_ids"]
    _, again = models.build_base_shape_model(texts, 123, {"num_labels": LABELS})
    assert torch.equal(model.classifier.weight, again.classifier.weight)  # deterministic from the seed


def test_ddp_at_real_size_holds_what_the_zero_formula_predicts_and_max_steps_stops_it(tmp_path):
    """2 DDP processes, 2 steps of 2 micro-batches of 1: each holds BERT-base's whole model state, 16
    bytes per parameter; common.Trainer's loop stops at --max-steps and evaluates."""
    output = tmp_path / "ddp"
    process = run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "--master-port", free_port(),
                   "multi-gpu-distributed-cls.py", *SMALL, "--model", "base-shape", "--max-samples", "120",
                   "--dev-ratio", "0.1", "--batch-size", "1", "--grad-accum", "2", "--max-steps", "2",
                   "--output-dir", str(output)])
    banner = " base-shape: the architecture of hfl/chinese-bert-wwm-ext (BERT-base), random weights"
    assert process.stderr.count(banner) == 1  # rank 0 says so, once
    result = read_result(output)
    parameters = bert_classifier_parameters(CONFIG, LABELS)
    assert result["parameters"] == parameters
    held, formula = result["model_state_bytes"], result["model_state_formula_bytes"]
    assert formula["total"] == 16 * parameters  # fp32 weights and gradients, Adam's two moments
    for part in ("parameters", "gradients", "optimizer_state"):
        assert formula[part] <= held[part] <= formula[part] + 4096, part  # + Adam's step counters
    assert (result["steps"], result["max_steps"], result["stopped_early"]) == (2, 2, True)
    assert result["global_batch_size"] == 4 and result["samples_trained"] == 2 * 4
    # result.json rounds it to 2 decimals: at BERT-base's fraction of a sample a second, 2% here.
    assert result["samples_per_second"] == pytest.approx(result["samples_trained"] / result["train_seconds"], abs=0.006)
    assert result["dev_samples"] == 12  # the whole dev set, evaluated after the early stop


def test_the_hf_trainers_max_steps_stops_training_and_evaluates(tmp_path):
    """transformers.Trainer's loop (its TrainingArguments.max_steps) stops as common.Trainer's does: 2
    processes x 4 x 2 micro-batches, shuffling, length grouping and dropout on (the defaults)."""
    run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "--master-port", free_port(),
         "multi-gpu-transformers-cls.py", *SMALL, "--max-steps", "3", "--grad-accum", "2", "--batch-size", "4",
         "--output-dir", str(tmp_path)])
    result = read_result(tmp_path)
    assert (result["steps"], result["max_steps"], result["stopped_early"]) == (3, 3, True)
    assert result["world_size"] == 2 and result["samples_trained"] == 3 * 16
    assert result["samples_per_second"] == pytest.approx(result["samples_trained"] / result["train_seconds"], rel=0.01)
    assert result["dev_samples"] == 83  # each dev sample once, not once per process


def test_max_steps_beyond_the_epochs_trains_the_epochs(single_33):
    """conftest's single_33 runs with --max-steps 1000: it trains its epoch, and every 3-process run
    of test_equivalence.py, without --max-steps, ends with its weights."""
    result = read_result(single_33)
    assert result["max_steps"] == 1000
    assert result["steps"] == math.ceil(result["train_samples"] / result["global_batch_size"]) == 11
    assert (result["stopped_early"], result["samples_trained"]) == (False, result["train_samples"])


def test_the_runner_counts_base_shape_from_its_config_alone():
    from bench import estimate
    assert estimate.bert_parameters(CONFIG, LABELS) == bert_classifier_parameters(CONFIG, LABELS)


def test_real_size_plan_runs_every_default_row_and_the_sharded_ones_at_4():
    from bench import estimate, options, rows
    cells = options.plan(options.parse_args(["--real-size"], gpus=0), gpus=0)
    launched = {(cell["variant"], estimate.processes(cell)) for cell in cells}
    assert {variant.name for variant in rows.DEFAULT_ROWS} <= {variant for variant, _ in launched}
    assert {("deepspeed-zero1", 4), ("deepspeed", 4), ("deepspeed-zero3", 4), ("fsdp", 4), ("ddp", 2),
            ("single", 1)} <= launched
    assert max(count for variant, count in launched if variant not in options.REAL_SIZE_SHARDED_ROWS) == 2


@pytest.mark.parametrize("gpus, counts, sharded", [(1, {1}, {1}), (2, {2}, {2}), (3, {2}, {2}), (8, {2}, {2, 4})])
def test_real_size_sizes_its_rows_to_the_gpus_present(gpus, counts, sharded):
    """A process per GPU: on 1 GPU every row at 1 process, on 2-3 at 2, from 4 on the sharded rows also at
    4; on a CPU (above) 2 and 4, whatever the machine's GPUs."""
    from bench import estimate, options
    cells = options.plan(options.parse_args(["--real-size"], gpus=gpus), gpus=gpus)
    launched = {(cell["variant"], estimate.processes(cell)) for cell in cells}
    assert {count for variant, count in launched if variant in options.REAL_SIZE_SHARDED_ROWS} == sharded
    assert {count for variant, count in launched
            if variant not in options.REAL_SIZE_SHARDED_ROWS | {"single", "dataparallel"}} == counts
    assert max(cell["nprocs"] for cell in cells) <= gpus
    on_cpu = options.plan(options.parse_args(["--real-size", "--device", "cpu"], gpus=gpus), gpus=gpus)
    assert {cell["nprocs"] for cell in on_cpu if cell["variant"] == "fsdp"} == {2, 4}


def test_real_size_names_the_counts_it_runs_when_refusing_nprocs():
    from bench import options
    from support import cli
    with pytest.raises(cli.UserError, match=r"--real-size runs 1 process\(es\) per row, 1 for the sharded ones"):
        options.parse_args(["--real-size", "--nprocs", "2"], gpus=1)


def test_real_size_refuses_a_plan_that_does_not_fit_in_memory():
    from bench import estimate, options
    from support import cli
    cells = options.plan(options.parse_args(["--real-size"], gpus=0), gpus=0)
    parameters = bert_classifier_parameters(CONFIG, LABELS)
    # 4 processes, each with 16 bytes of model state a parameter and more: over 4 x 16 x 102 M bytes.
    assert estimate.check_memory(cells, parameters, available=24 * 2**30) > 4 * 16 * parameters
    with pytest.raises(cli.UserError, match="needs about .* GiB for .*4 processes"):
        estimate.check_memory(cells, parameters, available=4 * 16 * parameters)
