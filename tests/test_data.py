"""The shared data pipeline: a split that no strategy can change, sharding, padding."""
import types

import numpy as np
import torch

import common
from support import models
from conftest import ROOT

RECORDS = common.load_records(ROOT / "data" / "train.json")


def args(**overrides):
    values = dict(batch_size=4, grad_accum=1, no_shuffle=False, group_by_length=False, seed=123, num_workers=0,
                  pad_to_multiple_of=1)
    return types.SimpleNamespace(**{**values, **overrides})


def test_the_data_file_matches_the_dataset_readme():
    assert len(RECORDS) == 40133
    counts = [sum(1 for _, label in RECORDS if label == k) for k in range(6)]
    assert counts == [13993, 6697, 5348, 5978, 3167, 4950]
    assert all(" " not in text for text, _ in RECORDS[:100])


def test_default_split_is_9200_train_800_dev_and_deterministic():
    train, dev = common.split_records(RECORDS, 10000, 0.08, 123)
    assert (len(train), len(dev)) == (9200, 800)
    assert common.split_records(RECORDS, 10000, 0.08, 123) == (train, dev)
    assert sorted(train + dev) == sorted(RECORDS[:10000])
    other_train, _ = common.split_records(RECORDS, 10000, 0.08, 124)
    assert other_train != train


def test_split_uses_only_the_first_max_samples_records():
    train, dev = common.split_records(RECORDS, 500, 0.1, 123)
    assert sorted(train + dev) == sorted(RECORDS[:500])


def tiny_datasets(max_samples=200):
    train, dev = common.split_records(RECORDS, max_samples, 0.2, 123)
    tokenizer, _ = models.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    return (common.EncodedDataset(train, tokenizer, 128), common.EncodedDataset(dev, tokenizer, 128), tokenizer)


def samplers(dataset, world_size, batch_size, shuffle=True, group_by_length=False, epoch=1, grad_accum=1):
    result = []
    for rank in range(world_size):
        sampler = common.train_sampler(dataset, args(batch_size=batch_size, no_shuffle=not shuffle,
                                                     group_by_length=group_by_length, grad_accum=grad_accum),
                                       num_replicas=world_size, rank=rank)
        sampler.set_epoch(epoch)
        result.append(sampler)
    return result


def shards(dataset, world_size, batch_size, **options):
    """Each process's (micro-)batches of (index, weight) for one epoch."""
    return [list(sampler) for sampler in samplers(dataset, world_size, batch_size, **options)]


def global_batches(dataset, world_size, batch_size, **options):
    """The samples of each optimizer step across all processes and micro-batches, as lists of
    (index, weight), the repeats of weight 0 left out; checks that every process runs the same
    number of batches."""
    per_rank = shards(dataset, world_size, batch_size, **options)
    assert len({len(batches) for batches in per_rank}) == 1
    counts = samplers(dataset, world_size, batch_size, **options)[0].micro_batches_per_step()
    assert sum(counts) == len(per_rank[0])
    starts = np.cumsum([0] + counts)
    return [sorted(pair for batches in per_rank for batch in batches[start:end] for pair in batch if pair[1] > 0)
            for start, end in zip(starts[:-1], starts[1:])]


def test_every_process_count_trains_the_single_device_global_batches_with_the_same_weights():
    train, _, _ = tiny_datasets()  # 160 samples: 5 global batches of 32; of 33, 4 and a short one of 28
    for shuffle, group in ((False, False), (True, False), (True, True)):
        options = dict(shuffle=shuffle, group_by_length=group)
        assert global_batches(train, 2, 16, **options) == global_batches(train, 1, 32, **options)
        assert global_batches(train, 4, 8, **options) == global_batches(train, 1, 32, **options)
        assert global_batches(train, 3, 11, **options) == global_batches(train, 1, 33, **options)
        assert global_batches(train, 7, 1, **options) == global_batches(train, 1, 7, **options)
    for batch in global_batches(train, 3, 11):
        assert abs(sum(weight for _, weight in batch) - 1) < 1e-12  # each global batch is one mean
    assert sorted(i for batch in global_batches(train, 3, 11) for i, _ in batch) == list(range(len(train)))


def test_accumulated_micro_batches_make_up_the_single_device_global_batches():
    train, _, _ = tiny_datasets()  # 160 samples: 5 global batches of 32; of 36, 4 and a short one of 16
    for shuffle, group in ((False, False), (True, False), (True, True)):
        options = dict(shuffle=shuffle, group_by_length=group)
        assert global_batches(train, 2, 8, grad_accum=2, **options) == global_batches(train, 1, 32, **options)
        assert global_batches(train, 1, 8, grad_accum=4, **options) == global_batches(train, 1, 32, **options)
        assert global_batches(train, 3, 4, grad_accum=3, **options) == global_batches(train, 1, 36, **options)
    # The short last step of 16 at 3 x 4 x 3: two micro-batches (12, then 4 = 2 + 1 + 1), not three.
    assert samplers(train, 3, 4, grad_accum=3)[0].micro_batches_per_step() == [3, 3, 3, 3, 2]
    last = [batches[-1] for batches in shards(train, 3, 4, shuffle=False, grad_accum=3)]
    assert [[weight for _, weight in batch] for batch in last] == [[1 / 16] * 2, [1 / 16, 0.0], [1 / 16, 0.0]]


def test_a_short_last_batch_that_does_not_split_gives_a_weightless_repeat():
    train, _, _ = tiny_datasets(205)  # 164 train samples: 4 batches of 3 x 13 = 39, then 8 left
    per_rank = shards(train, 3, 13, shuffle=False)
    last = [batches[-1] for batches in per_rank]
    assert [len(batch) for batch in last] == [3, 3, 3]  # equal work: no process waits for another
    assert [sum(weight > 0 for _, weight in batch) for batch in last] == [3, 3, 2]
    assert [weight for batch in last for _, weight in batch] == [1 / 8] * 8 + [0.0]


def test_shuffle_changes_with_the_epoch_and_no_shuffle_keeps_order():
    train, _, _ = tiny_datasets()
    first = [i for batch in shards(train, 1, 4, epoch=1)[0] for i, _ in batch]
    second = [i for batch in shards(train, 1, 4, epoch=2)[0] for i, _ in batch]
    assert first != second and sorted(first) == list(range(len(train)))
    fixed = [i for batch in shards(train, 1, 4, shuffle=False)[0] for i, _ in batch]
    assert fixed == list(range(len(train)))


def padding_per_sample(dataset, batches):
    lengths = [len(ids) for ids in dataset.input_ids]
    return sum(len(batch) * max(lengths[i] for i, _ in batch) - sum(lengths[i] for i, _ in batch)
               for batch in batches) / len(lengths)


def test_length_grouping_keeps_full_batches_aligned_and_the_short_one_last():
    train, _, _ = tiny_datasets(1000)  # 800 train samples: 25 global batches of 32; of 3 x 11, 24 and 8 left
    for world_size, batch_size in ((1, 32), (2, 16), (3, 11)):
        batches = global_batches(train, world_size, batch_size, group_by_length=True)
        assert [len(b) for b in batches[:-1]] == [world_size * batch_size] * (len(batches) - 1)
        assert sorted(i for b in batches for i, _ in b) == list(range(len(train)))
    grouped = shards(train, 2, 16, group_by_length=True)[0]
    plain = shards(train, 2, 16)[0]
    assert padding_per_sample(train, grouped) < padding_per_sample(train, plain) / 2


def test_eval_shards_give_each_dev_sample_once():
    _, dev, _ = tiny_datasets(205)  # 41 dev samples: uneven over 2, 3 and 4 processes
    for world_size in (1, 2, 3, 4):
        parts = [[pair for batch in common.eval_sampler(dev, args(batch_size=4), world_size, rank) for pair in batch]
                 for rank in range(world_size)]
        assert len({len(part) for part in parts}) == 1  # every process evaluates as many samples
        # What the Trainer gathers: each process's outputs, one after the other.
        indices = np.array([i for part in parts for i, _ in part])
        weights = np.array([w for part in parts for _, w in part])
        labels = np.array([dev.labels[i] for i in indices])
        kept, kept_labels = common.each_sample_once(indices, weights, labels)
        assert kept.tolist() == list(range(len(dev)))
        assert kept_labels.tolist() == dev.labels
        if world_size in (2, 3, 4):
            assert len(indices) > len(dev)  # there were repeats to drop


def test_batches_are_padded_to_their_longest_text_not_to_max_len():
    train, _, tokenizer = tiny_datasets()
    batch = common.PadBatch(tokenizer.pad_token_id)([train[0, 0.5], train[1, 0.5], train[2, 0.0]])
    lengths = [len(ids) for ids in train.input_ids[:3]]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    for row, length in enumerate(lengths):
        assert (batch["input_ids"][row, length:] == tokenizer.pad_token_id).all()
        assert batch["input_ids"][row, :length].tolist() == train[row, 1.0][1]
    assert batch["index"].tolist() == [0, 1, 2] and batch["labels"].dtype == torch.long
    assert batch["weight"].tolist() == [0.5, 0.5, 0.0]


def test_padding_to_a_multiple_gives_a_handful_of_shapes_that_differ_only_in_length():
    """--pad-to-multiple-of 16 (a GPU's default): each batch's length is its longest text rounded up to a
    multiple of 16, at most --max-seq-len (40 here: a ladder of 16, 32, 40), and the samplers fill a short
    micro-batch with repeats of weight 0, so every shape is (batch size, a length of the ladder)."""
    train, dev = common.split_records(RECORDS, 200, 0.2, 123)  # 160 and 40: short last batches over 3 x 8
    tokenizer, _ = models.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    train, dev = (common.EncodedDataset(records, tokenizer, 40) for records in (train, dev))
    for dataset, sampler in ((train, common.train_sampler), (dev, common.eval_sampler)):
        options = args(batch_size=8, pad_to_multiple_of=16, max_seq_len=40)
        for rank in range(3):
            batches = list(sampler(dataset, options, 3, rank))
            assert len(batches[-1]) == 8 and batches[-1][-1][1] == 0.0  # the short last one, filled
            shapes = set()
            for batch in batches:
                collated = common.PadBatch(tokenizer.pad_token_id, 16, 40)([dataset[key] for key in batch])
                longest = max(len(dataset.input_ids[index]) for index, _ in batch)
                assert collated["input_ids"].shape[1] == min(-(-longest // 16) * 16, 40)
                shapes.add(tuple(collated["input_ids"].shape))
            assert {batch for batch, _ in shapes} == {8} and {length for _, length in shapes} <= {16, 32, 40}
    # Without it (a CPU's default) the last micro-batch is as short as its share.
    assert len(list(common.train_sampler(train, args(batch_size=8), 3, 0))[-1]) < 8


def test_texts_are_truncated_to_max_seq_len():
    train, _ = common.split_records(RECORDS, 200, 0.2, 123)
    tokenizer, _ = models.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    encoded = common.EncodedDataset(train, tokenizer, 8)
    assert max(len(ids) for ids in encoded.input_ids) == 8


def test_tiny_model_is_deterministic_from_texts_and_seed():
    texts = ["今天 天气 真好", "气死 我 了 abc"]
    tok_a, model_a = models.build_tiny_model(texts, 1, {"num_labels": 6})
    tok_b, model_b = models.build_tiny_model(texts, 1, {"num_labels": 6})
    _, model_c = models.build_tiny_model(texts, 2, {"num_labels": 6})
    assert tok_a.get_vocab() == tok_b.get_vocab()
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert not torch.equal(model_a.classifier.weight, model_c.classifier.weight)
    ids = tok_a("今天abc")["input_ids"]
    assert tok_a.unk_token_id not in ids
