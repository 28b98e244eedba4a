"""The model FLOPs of training BertForSequenceClassification, counted once from the shapes the model
computed, and the published dense peaks of the GPUs they are set against (MFU = achieved FLOP/s over
the peak). Pure arithmetic: no torch, so that anything may import it.
"""
import re


def training_flops(config, computed_tokens, computed_sequences, attended_pairs):
    """Model FLOPs of forward and backward over micro-batches of B sequences padded to length S, from
    three sums over the micro-batches: `computed_tokens` of B*S, `computed_sequences` of B and
    `attended_pairs` of B*S*S (the query-key pairs attention scored). Padding counts: it was computed.

    Only the matrix products count, 2 FLOPs per multiply-add; with h = hidden_size, f =
    intermediate_size, L = num_hidden_layers and n = num_labels, the multiply-adds of the forward are
      per token, per layer          4 h^2 + 2 h f   (query, key, value and attention output
                                                     projections; the feed-forward's two products)
      per attended pair, per layer  2 h             (scores Q K^T, then probabilities times V:
                                                     h multiply-adds each, summed over the heads)
      per sequence                  h^2 + h n       (the pooler, on the first token only; the classifier)
    The embedding lookup is no product; biases, softmax, LayerNorm, GELU and the loss are left out.
    Backward computes two products per forward product (the gradient of the input and of the
    weight, or of both operands), so training is 3 x the forward: 6 FLOPs per multiply-add.

    These are model FLOPs, as MFU counts them: what training needs, not what the hardware ran.
    Gradient checkpointing's recomputed forward and a fused attention kernel's recomputed scores in
    backward are not counted.

    By hand, BERT-base (h 768, f 3072, L 12) with 6 labels on one sequence of 128 tokens:
      tokens      12 x (4 x 768^2 + 2 x 768 x 3072) x 128 = 10,871,635,968
      pairs       12 x 2 x 768 x 128^2                    =    301,989,888
      sequence    768^2 + 768 x 6                         =        594,432
    11,174,220,288 multiply-adds, x 6 = 67,045,321,728 FLOPs (about 6 x 85M encoder parameters x 128
    tokens, the usual 6 N D, plus attention).
    """
    hidden, inner = config.hidden_size, config.intermediate_size
    layers, labels = config.num_hidden_layers, config.num_labels
    multiply_adds = (layers * (4 * hidden * hidden + 2 * hidden * inner) * computed_tokens
                     + layers * 2 * hidden * attended_pairs
                     + (hidden * hidden + hidden * labels) * computed_sequences)
    return 6 * multiply_adds


PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

# Dense peaks (no 2:4 sparsity: datasheets that print only sparse figures are halved) in TFLOP/s per
# GPU: fp32 on the CUDA cores, the others on the tensor cores. Consumer cards: 16-bit products with
# fp32 accumulate, what PyTorch runs (their fp16-accumulate figure is twice that). A precision a GPU
# lacks has no entry.
PEAK_TFLOPS = {
    "H100 SXM": {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 PCIe": {"fp32": 51, "tf32": 378, "bf16": 756, "fp16": 756},
    "H200 SXM": {"fp32": 67, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # the H100 SXM's compute
    "A100": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},  # SXM4 and PCIe alike
    "L40S": {"fp32": 91.6, "tf32": 183, "bf16": 362.05, "fp16": 362.05},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
    "V100 SXM2": {"fp32": 15.7, "fp16": 125},  # Volta: no bf16, no tf32
    "V100 PCIe": {"fp32": 14, "fp16": 112},
}
SOURCES = {
    "H100 SXM": "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
    "H100 PCIe": "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)",
    "H200 SXM": "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
    "A100": "NVIDIA A100 Tensor Core GPU datasheet",
    "L40S": "NVIDIA L40S datasheet",
    "RTX 4090": "NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090)",
    "RTX 3090": "NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090)",
    "V100 SXM2": "NVIDIA Tesla V100 datasheet (V100 SXM2)",
    "V100 PCIe": "NVIDIA Tesla V100 datasheet (V100 PCIe)",
}
# torch.cuda.get_device_name's strings, e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB". First match wins. Variants with other figures
# match nothing, so they get no wrong peak: H100 NVL, H200 NVL, GH200, L40, RTX 4090 D, RTX 3090 Ti,
# laptop GPUs, V100S.
GPU_NAMES = [
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b.*\b(HBM3|SXM)", "H100 SXM"),
    (r"\bH200\b(?!.*\bNVL\b)", "H200 SXM"),
    (r"\bA100\b", "A100"),
    (r"\bL40S\b", "L40S"),
    (r"^(NVIDIA )?(GeForce )?RTX 4090$", "RTX 4090"),
    (r"^(NVIDIA )?(GeForce )?RTX 3090$", "RTX 3090"),
    (r"\bV100-SXM2\b", "V100 SXM2"),
    (r"\bV100-PCIE\b", "V100 PCIe"),
]


def gpu_model(device_name):
    """The PEAK_TFLOPS key of a CUDA device name, or None."""
    return next((model for pattern, model in GPU_NAMES
                 if re.search(pattern, device_name.strip(), re.IGNORECASE)), None)


def published_peak(device_name, precision):
    """(TFLOP/s, source) for a CUDA device name as torch.cuda.get_device_name returns it and a precision in
    fp32, tf32, bf16, fp16; or (None, reason) when the table has no such GPU or the GPU lacks the precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is none of {', '.join(PRECISIONS)}")
    model = gpu_model(device_name)
    if model is None:
        return None, (f"no published peak for {device_name} in flops.PEAK_TFLOPS: microbenchmarks/matmul_peak.py "
                      "measures one")
    figures = PEAK_TFLOPS[model]
    if precision == "tf32" and "tf32" not in figures:
        # Before Ampere there are no TF32 tensor cores: asking for TF32 leaves fp32 products in fp32.
        return figures["fp32"], f"{SOURCES[model]}, FP32 peak: {model} has no TF32, its fp32 products stay FP32"
    if precision not in figures:
        return None, f"{device_name} ({model}) has no {precision}: {SOURCES[model]} lists none"
    kind = "FP32 peak (CUDA cores)" if precision == "fp32" else f"dense {precision.upper()} tensor-core peak"
    return figures[precision], f"{SOURCES[model]}, {kind}"


def mfu(flop_per_second, peak_tflops):
    """Model FLOPs utilisation: the fraction of the peak that the model's FLOP/s reach; None without a
    peak or a rate."""
    if peak_tflops is None or flop_per_second is None:
        return None
    return flop_per_second / (peak_tflops * 1e12)
