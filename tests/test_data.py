"""The shared data pipeline: a split that no strategy can change, sharding, padding."""
import types

import torch

import common
from conftest import ROOT

RECORDS = common.load_records(ROOT / "data" / "train.json")


def args(**overrides):
    values = dict(batch_size=4, no_shuffle=False, group_by_length=False, seed=123, num_workers=0)
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
    tokenizer, _ = common.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    return (common.EncodedDataset(train, tokenizer, 128), common.EncodedDataset(dev, tokenizer, 128), tokenizer)


def global_batches(dataset, world_size, batch_size, shuffle=True, group_by_length=False):
    """The samples of each optimizer step across all processes, as sets of dataset indices."""
    shards = []
    for rank in range(world_size):
        sampler = common.train_sampler(dataset, args(batch_size=batch_size, no_shuffle=not shuffle,
                                                     group_by_length=group_by_length),
                                       num_replicas=world_size, rank=rank)
        sampler.set_epoch(1)
        order = list(sampler)
        shards.append([order[i:i + batch_size] for i in range(0, len(order), batch_size)])
    return [set().union(*(shard[step] for shard in shards)) for step in range(len(shards[0]))]


def test_sharded_training_sees_the_same_global_batches_as_one_process():
    train, _, _ = tiny_datasets()
    one = global_batches(train, 1, 32)
    for shuffle in (True, False):
        assert global_batches(train, 2, 16, shuffle) == global_batches(train, 1, 32, shuffle)
        assert global_batches(train, 4, 8, shuffle) == global_batches(train, 1, 32, shuffle)
    assert set().union(*one) == set(range(len(train)))


def test_shuffle_changes_with_the_epoch_and_no_shuffle_keeps_order():
    train, _, _ = tiny_datasets()
    sampler = common.train_sampler(train, args())
    sampler.set_epoch(1)
    first = list(sampler)
    sampler.set_epoch(2)
    assert list(sampler) != first and sorted(first) == list(range(len(train)))
    fixed = common.train_sampler(train, args(no_shuffle=True))
    assert list(fixed) == list(range(len(train)))


def test_length_grouping_covers_every_sample_and_shards_like_the_plain_sampler():
    train, _, _ = tiny_datasets(1000)
    batches = global_batches(train, 2, 16, group_by_length=True)
    assert set().union(*batches) == set(range(len(train)))
    assert batches == global_batches(train, 1, 32, group_by_length=True)
    lengths = [len(ids) for ids in train.input_ids]
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    random_spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b)
                        for b in global_batches(train, 1, 32)) / len(batches)
    assert spread < random_spread / 2


def test_eval_shards_cover_the_dev_set_once_after_dropping_padding():
    _, dev, _ = tiny_datasets(205)  # 41 dev samples: uneven over 2 and 4 processes
    for world_size in (1, 2, 4):
        seen = [i for rank in range(world_size) for i in common.eval_sampler(dev, world_size, rank)]
        assert set(seen) == set(range(len(dev)))
        assert len(seen) >= len(dev)


def test_batches_are_padded_to_their_longest_text_not_to_max_len():
    train, _, tokenizer = tiny_datasets()
    batch = common.PadToLongest(tokenizer.pad_token_id)([train[0], train[1], train[2]])
    lengths = [len(train[i][1]) for i in range(3)]
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    for row, length in enumerate(lengths):
        assert (batch["input_ids"][row, length:] == tokenizer.pad_token_id).all()
        assert batch["input_ids"][row, :length].tolist() == train[row][1]
    assert batch["index"].tolist() == [0, 1, 2] and batch["labels"].dtype == torch.long


def test_texts_are_truncated_to_max_seq_len():
    train, _ = common.split_records(RECORDS, 200, 0.2, 123)
    tokenizer, _ = common.build_tiny_model([t for t, _ in train], 123, {"num_labels": 6})
    encoded = common.EncodedDataset(train, tokenizer, 8)
    assert max(len(ids) for ids in encoded.input_ids) == 8


def test_tiny_model_is_deterministic_from_texts_and_seed():
    texts = ["今天 天气 真好", "气死 我 了 abc"]
    tok_a, model_a = common.build_tiny_model(texts, 1, {"num_labels": 6})
    tok_b, model_b = common.build_tiny_model(texts, 1, {"num_labels": 6})
    _, model_c = common.build_tiny_model(texts, 2, {"num_labels": 6})
    assert tok_a.get_vocab() == tok_b.get_vocab()
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert not torch.equal(model_a.classifier.weight, model_c.classifier.weight)
    ids = tok_a("今天abc")["input_ids"]
    assert tok_a.unk_token_id not in ids
