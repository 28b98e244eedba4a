"""flops.py: its count of a training step against torch's own FLOP counter, on the tiny model and on
BERT-base's shape; the published peaks; and microbenchmarks/matmul_peak.py, which measures a peak."""
import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import ROOT, run_in_process, small_split

from instruments import flops
from support import models

LABELS = 6
BASE_SHAPE_PARAMETERS = 102_272_262  # hfl/chinese-bert-wwm-ext with a 6-label head (tests/test_base_shape.py)


def encode(tokenizer, texts, length):
    """A micro-batch as the suite computes it: B texts padded (or cut) to one length S, with its mask."""
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
    assert (encoded["attention_mask"] == 0).any(), "the batch must hold padding: the formula counts it"
    return encoded


def train_step(model, encoded):
    """Forward, cross-entropy loss and backward, as common.Trainer computes a micro-batch."""
    labels = torch.arange(len(encoded["input_ids"])) % LABELS
    logits = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"]).logits
    F.cross_entropy(logits, labels).backward()


def counted_flops(model, batches):
    """FlopCounterMode's FLOPs of one training step per batch, and its FLOPs by operator.

    The counter knows the matrix products (mm, addmm, bmm, ...) and some fused attention kernels, but
    not the CPU's: under torch 2.13, SDPA without dropout runs _scaled_dot_product_flash_attention_for_cpu
    and its backward, which it would count as zero. SDPA's math backend computes attention as the
    products the formula counts (Q K^T and probabilities times V forward, two products for each in
    backward) in bmm, which it counts: so attention goes through the math backend here. (With the
    model's dropout of 0.1 in training the CPU takes that path anyway.)
    """
    model.train()
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        for encoded in batches:
            train_step(model, encoded)
    by_operator = {str(op): count for op, count in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), by_operator


def work(batches):
    """The three sums training_flops reads, as measure.count_tokens adds them up: B*S, B, B*S*S."""
    shapes = [encoded["input_ids"].shape for encoded in batches]
    return (sum(b * s for b, s in shapes), sum(b for b, _ in shapes), sum(b * s * s for b, s in shapes))


def assert_counts_match(model, batches):
    total, by_operator = counted_flops(model, batches)
    # The linear layers run as addmm forward and as two mm each backward (input and weight
    # gradients); attention as bmm. Anything else counted would be a product the formula leaves out.
    assert set(by_operator) == {"aten.addmm", "aten.mm", "aten.bmm"}, by_operator
    assert by_operator["aten.mm"] == 2 * by_operator["aten.addmm"]
    assert flops.training_flops(model.config, *work(batches)) == total


@pytest.fixture(scope="module")
def texts():
    return [text for text, _ in small_split()[0]]


def test_the_formula_counts_what_torch_counts_on_the_tiny_model(texts):
    tokenizer, model = models.build_tiny_model(texts, 123, {"num_labels": LABELS})
    assert_counts_match(model, [encode(tokenizer, texts[:2] + ["好"], 14)])


def test_the_formula_counts_what_torch_counts_at_bert_base_shape(texts):
    tokenizer, model = models.build_base_shape_model(texts, 123, {"num_labels": LABELS})
    assert models.parameter_count(model) == BASE_SHAPE_PARAMETERS
    assert_counts_match(model, [encode(tokenizer, texts[:1] + ["好"], 12)])


def test_micro_batches_of_different_lengths_add_up(texts):
    """Gradient accumulation: two micro-batches of other sizes and lengths count as the sum of the two."""
    tokenizer, model = models.build_tiny_model(texts, 123, {"num_labels": LABELS})
    batches = [encode(tokenizer, texts[:1] + ["好"], 9), encode(tokenizer, texts[2:4] + ["好吧"], 16)]
    assert_counts_match(model, batches)
    apart = sum(flops.training_flops(model.config, *work([encoded])) for encoded in batches)
    assert flops.training_flops(model.config, *work(batches)) == apart


def test_the_docstrings_figure_by_hand():
    config = transformers.BertConfig(**models.base_shape_config(), num_labels=LABELS)
    assert flops.training_flops(config, 128, 1, 128**2) == 67_045_321_728


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA H200", "fp16", 989.4),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156),
    ("NVIDIA A100 80GB PCIe", "tf32", 156),
    ("NVIDIA L40S", "fp32", 91.6),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("NVIDIA GeForce RTX 3090", "fp16", 71),
    ("Tesla V100-SXM2-32GB", "fp16", 125),
    ("Tesla V100-SXM2-32GB", "tf32", 15.7),  # no TF32 before Ampere: fp32 products stay fp32
])
def test_published_peaks(name, precision, peak):
    figure, source = flops.published_peak(name, precision)
    assert figure == peak
    assert "NVIDIA" in source


@pytest.mark.parametrize("name", ["NVIDIA B200", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
                                  "NVIDIA L40", "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 3090 Ti"])
def test_a_gpu_without_its_own_figures_gets_none_and_where_to_measure_one(name):
    assert flops.published_peak(name, "bf16") == (
        None, f"no published peak for {name} in flops.PEAK_TFLOPS: microbenchmarks/matmul_peak.py measures one")


def test_a_precision_the_gpu_lacks_gets_none_and_why():
    figure, reason = flops.published_peak("Tesla V100-SXM2-16GB", "bf16")
    assert figure is None and "no bf16" in reason


def test_every_figure_has_a_source_and_mfu_is_the_share_of_the_peak():
    assert set(flops.SOURCES) == set(flops.PEAK_TFLOPS)
    assert flops.mfu(494.7e12, 989.4) == pytest.approx(0.5)
    assert flops.mfu(1e12, None) is None


def load_matmul_peak():
    spec = importlib.util.spec_from_file_location("matmul_peak", ROOT / "microbenchmarks" / "matmul_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_matmul_peak_measures_the_cpu_and_leaves_the_threads_as_they_were():
    threads = torch.get_num_threads()
    tflops = load_matmul_peak().measure("cpu", "fp32", sizes=(64, 128), repeats=3, threads=1)
    assert tflops > 0
    assert torch.get_num_threads() == threads


def test_matmul_peak_command_line_ends_with_json_and_refuses_tf32_on_cpu():
    done = run_in_process(["microbenchmarks/matmul_peak.py", "--device", "cpu", "--precision", "fp32", "--sizes",
                           "64,128", "--repeats", "3", "--threads", "1", "--json"])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])  # as benchmark.py reads it
    assert result["device"] == "cpu" and result["precision"] == "fp32" and result["threads"] == 1
    assert result["size"] in (64, 128) and result["tflops"] > 0

    refused = run_in_process(["microbenchmarks/matmul_peak.py", "--device", "cpu", "--precision", "tf32"])
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("error: --precision tf32 ") and len(refused.stderr.splitlines()) == 1


def test_padding_per_sample_counts_the_real_samples_rows_only():
    """Two real texts of 3 and 5 tokens in a batch padded to 8, filled with two repeats of weight 0 (a
    short batch, --pad-to-multiple-of): 5 + 3 padding tokens over 2 samples; the repeats pad no sample."""
    from instruments import measure, results
    mask = torch.tensor([[1] * 3 + [0] * 5, [1] * 5 + [0] * 3, [1] * 3 + [0] * 5, [1] * 3 + [0] * 5])
    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "attention_mask": mask,
             "weight": torch.tensor([0.5, 0.5, 0.0, 0.0])}
    sums = dict(zip(results.TOKEN_COUNTS, measure.count_tokens(batch).tolist()))
    assert sums["real_tokens"] == 8 and sums["computed_tokens"] == 32
    assert results.padding_per_sample(sums) == 4
