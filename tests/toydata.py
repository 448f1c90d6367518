"""Small dataset factories for the tests, loaded through data specs such as `toydata:squares`."""
import numpy as np
import torch


class Squares(torch.utils.data.Dataset):
    """Item i is (tensor [i, i], i * i): easy to tell which samples a minibatch holds."""

    def __init__(self, size: int = 10):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return torch.tensor([float(i), float(i)]), i * i


def squares(size: int = 10):
    return Squares(size)


def two_inputs():
    """Items with two inputs (a tuple) and NumPy values."""
    return [((np.full(3, i, dtype=np.float32), torch.tensor([i])), np.int64(i % 2)) for i in range(6)]


def raises():
    raise ValueError("no such split")


def not_a_dataset():
    return 42


def bare_tensors():
    """Items that are single tensors, not (input, target) pairs."""
    return [torch.zeros(2) for _ in range(8)]


def ragged():
    """Item 3 has a different input shape from the others."""
    return [(torch.zeros(2 if i != 3 else 5), 0) for i in range(8)]


def strings():
    return [("text", 0) for _ in range(8)]


def empty():
    return []


NOT_CALLABLE = 3


def objects():
    """Inputs that are NumPy arrays of Python objects."""
    return [(np.array([object()]), 0) for _ in range(8)]


def halves(train=True):
    """A dataset factory with a held-out split: 12 items for training, 4 held out."""
    items = [(torch.full((3,), float(i)), i % 2) for i in range(16)]
    return items[:12] if train else items[12:]


class LabelledTokens(torch.utils.data.Dataset):
    """Hugging Face style items: dicts of keyword inputs, the labels among them (no target),
    their keys in another order than the model's sample (`pdtool.zoo.hf:gpt2` with labels=True)."""

    def __init__(self, size: int = 32, vocab: int = 64, seq_len: int = 8, train: bool = True):
        generator = torch.Generator().manual_seed(0 if train else 1)
        self.tokens = torch.randint(0, vocab, (size, seq_len), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"labels": self.tokens[i], "input_ids": self.tokens[i]}


def labelled_tokens(train=True):
    return LabelledTokens(train=train)


def other_shapes_held_out(train=True):
    """Training items of 8 features, held-out items of 9: the held-out split does not fit the model."""
    width = 8 if train else 9
    return torch.utils.data.TensorDataset(torch.randn(16, width), torch.randint(0, 4, (16,)))
