"""Small models for the tests, loaded through model specs such as `toymodels:dynamic`.

Every factory carries `@pdtool.factory`, so that plan files may name it (`pdtool.consent`);
`Dynamic`, `CALLABLE` and `run_command` are not factories and stay unmarked."""
import torch
from torch import nn

import pdtool
from torch.nn import functional as F


class Dynamic(nn.Module):
    """Data-dependent control flow (torch.fx cannot trace it) and a functional skip connection."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.act = nn.ReLU()
        self.c = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        h = self.act(self.a(x))
        if h.sum() > -1e9:
            h = h * self.scale
        y = self.b(h)
        return self.c(y + h)


def _batch(n):
    return torch.randn(n, 8), torch.randint(0, 4, (n,))


@pdtool.factory
def dynamic():
    return Dynamic(), _batch, F.cross_entropy


@pdtool.factory
def fixed_sample():
    """A factory that returns one fixed minibatch of 3 instead of a batch maker."""
    return nn.Linear(8, 4), (torch.randn(3, 8), torch.randint(0, 4, (3,))), F.cross_entropy


@pdtool.factory
def wrong_shape():
    """A model whose sample input has the wrong width: the model rejects it."""
    return nn.Linear(8, 4), (lambda n: (torch.randn(n, 5), torch.randint(0, 4, (n,)))), F.cross_entropy


@pdtool.factory
def raises(reason="no such size"):
    raise ValueError(reason)


@pdtool.factory
def not_a_model():
    return 42


@pdtool.factory
def vector_loss():
    return nn.Linear(8, 4), _batch, lambda out, target: out  # not a scalar


NOT_CALLABLE = 3


@pdtool.factory
def inplace():
    """torchvision style: ReLU(inplace=True) and an in-place residual addition."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
            self.head = nn.Linear(4 * 8 * 8, 2)

        def forward(self, x):
            y = self.relu(self.conv1(x))
            z = self.conv2(y)
            z += y
            return self.head(self.relu(z).flatten(1))

    return Net(), (lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 2, (n,)))), F.cross_entropy


_CALLS = {"count": 0}


@torch.fx.wrap
def _fail_after(x, after: int, how: str):
    """Kept as one call in the traced graph; after `after` calls in this process it raises
    (how="raise") or kills its own process with SIGKILL (how="kill")."""
    _CALLS["count"] += 1
    if _CALLS["count"] > after:
        if how == "kill":
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"boom after {after} forwards")
    return x


class _Failing(nn.Module):
    def __init__(self, after, how):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.after, self.how = after, how

    def forward(self, x):
        return _fail_after(self.lin(x), self.after, self.how)


def _failing_chain(after, how, dropout=0.0):
    _CALLS["count"] = 0
    drop = [nn.Dropout(dropout)] if dropout else []
    model = nn.Sequential(nn.Linear(8, 8), *drop, nn.Linear(8, 8), *drop, _Failing(after, how))
    return model, (lambda n: (torch.randn(n, 8), torch.randint(0, 8, (n,)))), F.cross_entropy


@pdtool.factory
def exploding(after=6):
    """A 3-layer chain whose last layer raises after `after` forwards (in the worker that runs it)."""
    return _failing_chain(after, "raise")


@pdtool.factory
def slow_start(delay=0.0, rank=None, **kwargs):
    """pdtool.zoo's mlp, built after `delay` seconds (a model whose building takes a while), in
    every process or only in the worker of rank `rank`."""
    import os
    import time

    from pdtool.zoo import mlp

    if rank is None or os.environ.get("RANK") == str(rank):
        time.sleep(delay)
    return mlp(**kwargs)


@pdtool.factory
def dying(after=6, dropout=0.0):
    """A 3-layer chain whose last layer's worker is killed by a signal after `after` forwards;
    with `dropout`, an nn.Dropout after each of its first two layers."""
    return _failing_chain(after, "kill", dropout)


class _Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace a model that contains it."""

    def forward(self, x):
        if x.sum() > -1e9:
            x = x * 1.0
        return x


@pdtool.factory
def gated_sequential():
    """An nn.Sequential torch.fx cannot trace: pdtool profiles its leaf modules and splits it by children."""
    model = nn.Sequential(nn.Linear(8, 16), _Gate(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, _batch, F.cross_entropy


class _TiedLM(nn.Module):
    """A tiny language model whose output head is its token embedding (tied, as in GPT-2)."""

    def __init__(self, vocab=11, width=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.act = nn.Tanh()
        self.mid2 = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.mid2(self.act(self.mid(self.emb(idx)))))


@pdtool.factory
def tied_lm(vocab=11):
    """Tokens in, per-token logits out; the loss is next-token-style cross entropy."""
    def batch(n):
        return torch.randint(0, vocab, (n, 5)), torch.randint(0, vocab, (n, 5))

    return _TiedLM(vocab), batch, lambda logits, target: F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))


class _ShapeBranch(nn.Module):
    """Branches on the input's size: torch.fx cannot trace it, torch.export takes the branch of the
    sample (static shapes), so `rare` never runs and its parameters are in no layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.common = nn.Linear(8, 4)
        self.rare = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.rare(h) if x.shape[0] > 1000 else self.common(h)


@pdtool.factory
def shape_branch():
    return _ShapeBranch(), _batch, F.cross_entropy


@pdtool.factory
def tied_dynamic(vocab=11):
    """A tied language model with data-dependent control flow: neither tracer captures it."""
    class Gated(_TiedLM):
        def forward(self, idx):
            h = self.mid(self.emb(idx))
            if h.sum() > -1e9:
                h = self.act(h)
            return self.head(self.mid2(h))

    def batch(n):
        return torch.randint(0, vocab, (n, 5)), torch.randint(0, vocab, (n, 5))

    return Gated(vocab), batch, lambda logits, target: F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))


from subprocess import run as run_command  # noqa: E402,F401  (a tool's function re-exported: not a factory)


class _Callable:
    def __call__(self, **kwargs):
        return dynamic()


CALLABLE = _Callable()  # callable, but not a function: not a factory


def not_an_optimizer(param_groups, lr):
    """An --optimizer factory that returns something else (the launcher refuses it)."""
    return param_groups


@pdtool.factory
def dropout_classifier(hidden=32, dropout=0.5):
    """A classifier of the digits (64 features, 10 classes) with dropout after each hidden layer:
    what it scores in eval mode differs from training mode."""
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Dropout(dropout), nn.Linear(hidden, 10))
    return model, (lambda n: (torch.randn(n, 64), torch.randint(0, 10, (n,)))), F.cross_entropy


class _Decay(nn.Module):
    """A block that computes a value from its own parameter alone (as Mamba's A = -exp(A_log))."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.A_log = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return self.lin(x) * -torch.exp(self.A_log.float())


@pdtool.factory
def parameter_only(blocks=3):
    """Blocks whose parameters are read only by their own block, one of them through `.float()`
    (torch.export checks the tensor it converts with a node that has no consumer)."""
    model = nn.Sequential(*[_Decay() for _ in range(blocks)], nn.Linear(8, 4))
    return model, (lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,)))), F.cross_entropy


class _Amplify(nn.Module):
    """Multiplies by `factor`: past fp16's range (65504) in an fp16 forward."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


@pdtool.factory
def fp16_overflow(factor=1e6):
    """A 3-layer chain whose middle amplifies its input beyond fp16's range (fine in fp32 and bf16)."""
    model = nn.Sequential(nn.Linear(8, 8), _Amplify(factor), nn.Linear(8, 8))
    return model, (lambda n: (torch.randn(n, 8), torch.randint(0, 8, (n,)))), F.cross_entropy


def ignores_its_groups(param_groups, lr):
    """An --optimizer factory that builds its optimizer over a parameter of its own, not the ones it is given."""
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


class _Temperature(nn.Module):
    """Divides by a learned scalar (a parameter without dimensions, as a softmax temperature)."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return x / self.t


@pdtool.factory
def scalar_parameter():
    """A chain with a parameter of no dimensions between two layers."""
    model = nn.Sequential(nn.Linear(8, 8), _Temperature(), nn.Linear(8, 4))
    return model, (lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,)))), F.cross_entropy
