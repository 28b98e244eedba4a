"""How much the shared data pipeline saves: our loader against the reference tutorial's, side by side.

    python microbenchmarks/pipeline.py                    # tiny model, 10,000 samples, 1 epoch, CPU
    python microbenchmarks/pipeline.py --model model_hub/chinese-bert-wwm-ext --device cuda

Three pipelines train the same model (same initial weights, same sample order) for one epoch:
  reference   tokenize every batch inside collate_fn, padded to --max-seq-len (128), as the
              reference tutorial does, and again every epoch
  ours        tokenize once up front, pad each batch to its longest text
  ours+group  the same, with batches grouped by length (common.py's default)
It prints epoch seconds, padded tokens per sample and dev accuracy for each, and the speed-ups.
"""
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from support import cli, machine, models, options  # noqa: E402


class TokenizeEveryBatch:
    """The reference tutorial's collate: call the tokenizer on raw texts, pad to max_length."""

    def __init__(self, tokenizer, max_seq_len):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len

    def __call__(self, batch):
        texts, labels = zip(*batch)
        encoded = self.tokenizer(list(texts), padding="max_length", truncation=True,
                                 max_length=self.max_seq_len, return_tensors="pt")
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
                "labels": torch.tensor(labels)}


def train_one_epoch(model, loader, device, lr, weight_decay):
    """Returns (seconds, padded tokens per sample). Same loop as common.Trainer, minus the logging."""
    optimizer = models.make_optimizer(model, lr, weight_decay)
    model.train()
    tokens = samples = 0
    machine.synchronize(device)
    start = time.perf_counter()
    for batch in loader:
        input_ids = batch["input_ids"].to(device)
        logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"].to(device)).logits
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += input_ids.numel()
        samples += len(input_ids)
    machine.synchronize(device)
    return time.perf_counter() - start, tokens / samples


@torch.no_grad()
def dev_accuracy(model, dev_set, tokenizer, device, args):
    model.eval()
    loader = common.make_loader(dev_set, args, tokenizer, common.eval_sampler(dev_set, args))
    correct = 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
        correct += (logits.argmax(-1).cpu() == batch["labels"]).sum().item()
    return correct / len(dev_set)


def main():
    parser = options.build_parser(__file__, __doc__)
    args = options.parse(parser)
    device = machine.resolve_device(args.device)
    records = common.load_records(args.data)
    train_records, dev_records = common.split_records(records, args.max_samples, args.dev_ratio, args.seed)

    results = {}
    model_name = models.resolve_model(args.model)
    for name in ("reference", "ours", "ours+group"):
        common.set_seed(args.seed)
        tokenizer, model, model_name, lr = models.load_model(args, [text for text, _ in train_records],
                                                             model_name, common.LABELS)
        model.to(device)
        dev_set = common.EncodedDataset(dev_records, tokenizer, args.max_seq_len)
        train_set = common.EncodedDataset(train_records, tokenizer, args.max_seq_len)
        row_args = options.Options(**dict(vars(args), group_by_length=name == "ours+group"))  # the row's batching
        sampler = common.train_sampler(train_set, row_args)
        sampler.set_epoch(1)
        if name == "reference":
            # The same batches of the same samples, from the raw texts.
            batches = [[index for index, _ in batch] for batch in sampler]
            loader = DataLoader(train_records, batch_sampler=batches,
                                collate_fn=TokenizeEveryBatch(tokenizer, args.max_seq_len))
        else:
            loader = common.make_loader(train_set, args, tokenizer, sampler)
        seconds, tokens = train_one_epoch(model, loader, device, lr, args.weight_decay)
        results[name] = (seconds, tokens, dev_accuracy(model, dev_set, tokenizer, device, args))
        print(f"{name:<11} epoch {seconds:7.1f} s | {tokens:6.1f} padded tokens/sample | "
              f"dev accuracy {results[name][2]:.4f}", flush=True)

    print(f"model {model_name}, {device}, {len(train_records)} train samples, batch {args.batch_size}")
    reference = results["reference"][0]
    for name in ("ours", "ours+group"):
        print(f"speed-up of {name} over reference: {reference / results[name][0]:.2f}x")


if __name__ == "__main__":
    cli.run(main)
