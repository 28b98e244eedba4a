"""The model: which one --model names (a local folder, the hub, or one built offline with random
weights: the tiny BERT, or the real model's shape), loaded with a classification head, and the
optimizer every script trains it with."""
import collections
import math
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import transformers
from safetensors import SafetensorError

from .options import DEFAULT_LR, ROOT, check_max_seq_len
from .errors import UserError
from .task import base_shape_config

HUB_MODEL_ID = "hfl/chinese-bert-wwm-ext"
LOCAL_MODEL_DIR = ROOT / "model_hub" / "chinese-bert-wwm-ext"
RANDOM_WEIGHTS_BANNER = "random weights: figures compare strategies, not models"

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


def resolve_model(choice):
    """Turn --model into 'tiny', a local folder or a hub id; 'auto' falls back step by step. Call it
    in one process and share the answer: processes that probe the network each on its own may
    disagree."""
    if choice != "auto":
        if choice not in ("tiny", "base-shape"):
            check_model_source(choice)
        return choice
    if LOCAL_MODEL_DIR.is_dir():
        return str(LOCAL_MODEL_DIR)
    if hub_cached(HUB_MODEL_ID) or hub_reachable():  # cached here, or the hub answers within a few seconds
        return HUB_MODEL_ID
    banner = "=" * 78
    print(f"{banner}\n No {LOCAL_MODEL_DIR.relative_to(ROOT)} and no reachable hub: using the TINY randomly"
          f"\n initialised BERT. Figures measure the strategies, not Chinese BERT quality."
          f"\n See model_hub/README.md to get {HUB_MODEL_ID}.\n{banner}", file=sys.stderr)
    return "tiny"


def hub_cached(model_id):
    from huggingface_hub import try_to_load_from_cache
    return isinstance(try_to_load_from_cache(model_id, "config.json"), str)


def hub_reachable():
    """Whether the hub answers within a few seconds; never with HF_HUB_OFFLINE set."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return False
    host = constants.ENDPOINT.split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def check_model_source(name):
    """Refuse at once a --model that names neither a folder nor a hub id, or a hub model that is not
    cached when the hub is unreachable. Unreachable, the hub is not asked again: a cached model
    loads at once, not after a minute of retries."""
    if Path(name).is_dir():
        return
    if name.startswith((".", "/")) or name.count("/") != 1:
        raise UserError(f"model not found: {name} is neither a folder nor a hub id like {HUB_MODEL_ID}")
    if hub_reachable():
        return
    from huggingface_hub import constants
    constants.HF_HUB_OFFLINE = True
    if not hub_cached(name):
        raise UserError(f"model {name} is not in the Hugging Face cache and the hub is unreachable (or HF_HUB_OFFLINE "
                        f"is set): download it once, as README.md's 'Getting the real weights' shows, with "
                        f"`hf download {name} --local-dir <folder>`, then pass --model <folder>")


def character_vocabulary(train_texts):
    """BERT's special tokens, then the characters of the training texts, most frequent first.

    BERT's tokenizer splits Chinese into characters but keeps Latin words and digits whole, then
    cuts them into "##"-continued pieces: every character comes in both forms.
    """
    counts = collections.Counter(char for text in train_texts for char in text.lower())
    chars = sorted(counts, key=lambda char: (-counts[char], char))
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + [f"##{char}" for char in chars]


def randomly_initialised(vocab, config, seed):
    """A tokenizer over `vocab` and a BERT classifier of `config` with weights drawn from `seed`."""
    tokenizer = transformers.BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.BertForSequenceClassification(config)
    return tokenizer, model


def build_tiny_model(train_texts, seed, config_overrides):
    """A 2-layer BERT (hidden 128) with a character vocabulary from the training texts.

    Deterministic from the texts and the seed, built in a second, no download: what tests and
    machines without the real weights use.
    """
    vocab = character_vocabulary(train_texts)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=512, max_position_embeddings=512,
                                     **config_overrides)
    return randomly_initialised(vocab, config, seed)


def build_base_shape_model(train_texts, seed, config_overrides):
    """hfl/chinese-bert-wwm-ext's exact architecture (BERT-base, vocabulary 21,128) with random weights.

    The tokenizer knows the tiny model's characters; unused tokens fill the vocabulary up to the
    real size, so that the embedding matrix, and with it every figure of memory and communication,
    has the real model's shape. Deterministic from the texts and the seed, no download.
    """
    values = base_shape_config()
    vocab = character_vocabulary(train_texts)
    if len(vocab) > values["vocab_size"]:
        raise UserError(f"the training texts have {len(vocab)} tokens, more than base-shape's vocabulary of "
                        f"{values['vocab_size']}: use fewer --max-samples")
    vocab += [f"[unused{i}]" for i in range(values["vocab_size"] - len(vocab))]
    return randomly_initialised(vocab, transformers.BertConfig(**values, **config_overrides), seed)


def parameter_count(model):
    """The model's parameters, whole even where a strategy shards them (DeepSpeed ZeRO-3 keeps the
    whole count in ds_numel; an FSDP2 DTensor's numel() is the whole tensor's)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def load_model(args, train_texts, name, labels, announce=False):
    """Return (tokenizer, model, model name, learning rate) for the resolved --model `name`, with a
    classification head over `labels`; with `announce`, say so when its weights are random."""
    overrides = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                 "label2id": {label: i for i, label in enumerate(labels)}}
    if args.dropout is not None:
        overrides.update(hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                         classifier_dropout=args.dropout)
    if name == "tiny":
        tokenizer, model = build_tiny_model(train_texts, args.seed, overrides)
    elif name == "base-shape":
        tokenizer, model = build_base_shape_model(train_texts, args.seed, overrides)
        if announce:
            banner = "=" * 78
            print(f"{banner}\n base-shape: the architecture of {HUB_MODEL_ID} (BERT-base), "
                  f"{RANDOM_WEIGHTS_BANNER}\n{banner}", file=sys.stderr)
    else:
        tokenizer, model = load_pretrained(name, args.seed, overrides)
    check_max_seq_len(args.max_seq_len, model.config.max_position_embeddings)
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing: the form DDP, FSDP2 and the rest accept without special cases.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lr = args.lr if args.lr is not None else DEFAULT_LR.get(name, DEFAULT_LR["pretrained"])
    return tokenizer, model, name, lr


def load_pretrained(name, seed, overrides):
    check_model_source(name)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # the new classification head starts the same in every process
            model = transformers.AutoModelForSequenceClassification.from_pretrained(name, **overrides)
    except (OSError, ValueError, SafetensorError) as error:  # SafetensorError: a truncated model.safetensors
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"could not load model {name}: {first_line}") from None
    return tokenizer, model


def make_optimizer(model, lr, weight_decay):
    """AdamW without weight decay on biases and LayerNorm weights, as BERT was trained."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 else decay).append(param)
    # Fused AdamW (one CUDA kernel per step for all the weights, torch's fastest) where every weight is a
    # plain tensor on a GPU. Elsewhere torch's default: on the CPU (CPU runs, FSDP's --offload, a model
    # not yet moved, as DeepSpeed and Accelerate take it) and for FSDP2's sharded DTensors.
    fused = all(type(param) is torch.nn.Parameter and param.is_cuda for param in decay + no_decay) or None
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, fused=fused)


def prepared_mask(attention_mask):
    """The padding mask as the (batch, 1, 1, length) boolean mask that SDPA attention takes, which
    transformers passes on as it is. Given the 2D mask instead, it asks on every forward whether any
    token is padding (`mask.all()`), and the CPU waits for the GPU to answer."""
    return attention_mask[:, None, None, :].bool()


# Where a compiled model may replay its steps as CUDA graphs: one device and DDP (torchrun, spawn, AMP),
# whose hooks run outside the compiled model and read its gradients before the next replay.
CUDA_GRAPH_STRATEGIES = ("single-device", "ddp", "ddp-amp")


def compile_options(args, strategy):
    """torch.compile's arguments for --compile-mode and --compile-dynamic. Static shapes compile a graph
    per step shape: with --pad-to-multiple-of a handful, each as fast as it can be (and what DDP's graph
    splitting and CUDA graphs want); dynamic compiles one graph for every length."""
    if args.compile_mode == "reduce-overhead":
        if strategy.device.type != "cuda":
            raise UserError("--compile-mode reduce-overhead records CUDA graphs, which need a GPU; on a CPU "
                            "leave it out (--compile)")
        if strategy.name not in CUDA_GRAPH_STRATEGIES:
            raise UserError(f"--compile-mode reduce-overhead: {strategy.name} updates gradients or weights in "
                            "hooks between the compiled kernels, which recorded CUDA graphs would not follow; "
                            "CUDA graphs run with single-gpu-cls.py and the DDP scripts")
    static = args.compile_dynamic == "static"
    # Python floats (dropout, the attention scale) as constants: left symbolic, dynamic shapes would trace
    # the model twice, the first time only to learn that inductor cannot take them as inputs.
    torch._dynamo.config.specialize_float = True
    if not static or strategy.world_size == 1:
        # DDP's graph splitter (a graph per gradient bucket) with dynamic shapes fails in torch 2.11's
        # inductor ("expected [s16] to have been codegen-ed", BERT-base on GPU and CPU alike): one whole
        # graph, as torch's maintainers advise (pytorch#111636). Static shapes keep the split, which
        # lets a bucket's all-reduce start during backward: with one process there is none to overlap,
        # and the split would only cut each shape's graph in pieces (about 17 at BERT-base).
        torch._dynamo.config.optimize_ddp = False
    else:
        # A graph per length of the ladder, for training and for evaluation (no_grad compiles its own).
        lengths = math.ceil(args.max_seq_len / args.pad_to_multiple_of)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * lengths + 2)
    return {"mode": args.compile_mode, "dynamic": not static}
