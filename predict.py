"""Classify texts with a model saved by any script of this suite.

    python predict.py --checkpoint output/single-gpu-cls/model 今天天气真好 气死我了
    python predict.py --checkpoint output/multi-gpu-deepspeed-cls/model --file texts.txt
    cat texts.txt | python predict.py --checkpoint output/single-gpu-cls/model --file -

Prints one line per text: the predicted emotion, its probability, and the text.
"""
import argparse
import sys
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError

import common
from support import cli, options


# A tokenizer's vocabulary, as save_pretrained writes it (the fast tokenizer's file, or the WordPiece list).
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt")


def load_checkpoint(path):
    path = Path(path)
    if not (path / "config.json").is_file():
        raise cli.UserError(f"no saved model at {path} (expected the model/ folder a training run writes)")
    if not any((path / name).is_file() for name in VOCABULARY_FILES):  # else every character is [UNK]
        raise cli.UserError(f"the model at {path} has no tokenizer ({' or '.join(VOCABULARY_FILES)}): copy the whole "
                            "model/ folder a training run writes")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(path)
    except (OSError, ValueError, SafetensorError) as error:  # SafetensorError: a truncated model.safetensors
        raise cli.UserError(f"could not load the model at {path}: {str(error).strip().splitlines()[0]}") from None
    return tokenizer, model.eval()


def read_texts(args):
    texts = list(args.texts)
    for number, text in enumerate(texts, 1):
        if common.empty_text(text):  # as training refuses it
            raise cli.UserError(f"text {number} of the arguments is empty (only spaces, control or zero-width "
                                "characters): nothing to classify")
    if args.file:
        lines = read_lines(args.file)
        texts += [line.strip() for line in lines if line.strip()]
        empty = [number for number, line in enumerate(lines, 1) if line.strip() and common.empty_text(line)]
        if empty:
            raise cli.UserError(f"{args.file}: line {empty[0]} holds only control or zero-width characters: "
                                "nothing to classify")
    if not texts:
        raise cli.UserError("no text to classify: give texts as arguments or --file (--file - reads standard input)")
    return texts


def read_lines(name):
    """The lines of --file: a file, a pipe (/dev/stdin, <(...)), or '-' for standard input."""
    try:
        if name == "-":
            return sys.stdin.buffer.read().decode("utf-8").splitlines()
        return Path(name).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise cli.UserError(f"text file not found: {name}") from None
    except IsADirectoryError:
        raise cli.UserError(f"--file {name} is a folder: give a file with one text per line") from None
    except OSError as error:
        raise cli.UserError(f"--file {name} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise cli.UserError(f"{'standard input' if name == '-' else name} is not UTF-8 text (one text per line): "
                            f"{error}") from None


@torch.no_grad()
def predict(tokenizer, model, texts, max_seq_len=128, batch_size=64):
    """Return (label name, probability) for each text."""
    results = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], padding=True, truncation=True,
                          max_length=max_seq_len, return_tensors="pt")
        probabilities = model(**batch).logits.softmax(dim=-1)
        best = probabilities.max(dim=-1)
        results += [(model.config.id2label[int(i)], float(p)) for p, i in zip(best.values, best.indices)]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a model/ folder written by a training script")
    parser.add_argument("--file", help="a UTF-8 file with one text per line; - reads standard input")
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("texts", nargs="*", help="texts to classify")
    args = parser.parse_args()
    options.check_max_seq_len(args.max_seq_len)

    texts = read_texts(args)
    tokenizer, model = load_checkpoint(args.checkpoint)
    options.check_max_seq_len(args.max_seq_len, model.config.max_position_embeddings)
    # As in training: the spaces of word-segmented text removed.
    normalized = [common.normalize_text(text) for text in texts]
    for text, (label, probability) in zip(texts, predict(tokenizer, model, normalized, args.max_seq_len)):
        print(f"{label}\t{probability:.4f}\t{text}")


if __name__ == "__main__":
    cli.run(main)
