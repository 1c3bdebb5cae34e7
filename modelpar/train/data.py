"""Real data without downloads, and the layout-independent sampler.

- Text: the Python standard library's own ``.py`` sources (found through ``sysconfig``), without test
  folders and site-packages, or any text file/folder given by ``--data``; byte-level tokens (vocab 256).
  The validation split is chosen per file by a hash of its relative path, so it is the same on every
  machine that has the same files. ``CorpusInfo`` (file count, byte count, hash of the file list) goes
  into the run record so runs on different installs can be told apart.
- Images: scikit-learn's bundled 8x8 digits.

Sampling: the samples of optimizer step ``s`` are drawn from ``(seed, s)`` alone, so every layout
sees the same samples in the same order. A data-parallel rank takes a contiguous, disjoint slice of
each global batch (see `global_batch_slice`), and every rank runs the same number of steps by
construction (steps are counted, not epochs).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class CorpusInfo:
    source: str          # folder or file the corpus was read from
    num_files: int
    num_bytes: int       # train + validation bytes
    train_bytes: int
    val_bytes: int
    files_sha256: str    # hash of the sorted relative file list

    def to_dict(self) -> dict:
        return asdict(self)


def stdlib_dir() -> Path:
    """The standard library folder of the running interpreter (``sysconfig`` 'stdlib')."""
    return Path(sysconfig.get_paths()["stdlib"])


def _text_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    if not root.exists():
        raise ValueError(f"--data {str(root)!r} does not exist")
    is_stdlib = root.resolve() == stdlib_dir().resolve()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # sorted walk: the same order on every machine
        dirnames[:] = sorted(d for d in dirnames
                             if d not in TEST_DIRS and d != "site-packages" and d != "__pycache__"
                             and not d.startswith("."))
        for f in sorted(filenames):
            if (is_stdlib and f.endswith(".py")) or (not is_stdlib and not f.startswith(".")):
                out.append(Path(dirpath) / f)
    return out


def _is_val(rel: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return (h % 10_000) < val_fraction * 10_000


def load_text_corpus(path: str | os.PathLike | None = None, *, val_fraction: float = 0.05,
                     max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, CorpusInfo]:
    """Read a byte-level corpus.

    Args:
        path: a text file or folder; None for the Python standard library's sources.
        val_fraction: share of files (by hash of the relative path) held out for validation.
        max_bytes: cap on bytes read (files taken in sorted order), None for all.

    Returns:
        ``(train, val, info)``: two uint8 tensors of shape (n_bytes,) and the corpus description.

    Raises:
        ValueError: the path does not exist, or a split would be too small to sample from.
    """
    root = Path(path) if path is not None else stdlib_dir()
    files = _text_files(root)
    train_parts, val_parts, rels = [], [], []
    total = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        rel = f.name if root.is_file() else str(f.relative_to(root))
        rels.append(rel)
        (val_parts if (len(files) > 1 and _is_val(rel, val_fraction)) else train_parts).append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if len(files) == 1 or not val_parts:      # one file: the last val_fraction of its bytes
        blob = b"".join(train_parts + val_parts)
        cut = int(len(blob) * (1 - val_fraction))
        train_b, val_b = blob[:cut], blob[cut:]
    else:
        train_b, val_b = b"".join(train_parts), b"".join(val_parts)
    info = CorpusInfo(source=str(root), num_files=len(rels), num_bytes=len(train_b) + len(val_b),
                      train_bytes=len(train_b), val_bytes=len(val_b),
                      files_sha256=hashlib.sha256("\n".join(rels).encode()).hexdigest())
    if len(train_b) < 2 or len(val_b) < 2:
        raise ValueError(f"corpus at {str(root)!r} is too small: {len(train_b)} train and {len(val_b)} "
                         f"validation bytes")
    to_t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return to_t(train_b), to_t(val_b), info


def step_generator(seed: int, step: int) -> torch.Generator:
    """The RNG of one optimizer step, derived from (seed, step) only (no per-rank state)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 7919 + 17) % (2**63 - 1))
    return g


class TokenBatches:
    """Random windows of a byte stream: ``(x, y)`` of shape (n, seq_len) int64, y = x shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        if data.numel() <= seq_len + 1:
            raise ValueError(f"the data has {data.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        self.data, self.seq_len = data, seq_len

    def offsets(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.data.numel() - self.seq_len - 1, (n,), generator=generator)

    def at(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = offsets[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.data[idx].long()
        return w[:, :-1], w[:, 1:]

    def global_batch(self, seed: int, step: int, global_batch_size: int):
        return self.at(self.offsets(global_batch_size, step_generator(seed, step)))

    def eval_batches(self, num_samples: int, seed: int = 1234) -> torch.Tensor:
        """Fixed validation offsets (the same for every evaluation of a run)."""
        return self.offsets(num_samples, step_generator(seed, -1))

    def global_rows(self, seed: int, step: int, global_batch_size: int) -> tuple[GlobalRows, GlobalRows]:
        """`global_batch` read only where sliced: ``(x, y)`` of the same samples, each row read from
        the data when a rank takes it (`GlobalRows`)."""
        offsets = self.offsets(global_batch_size, step_generator(seed, step))
        window = _LastWindow(lambda a, b: self.at(offsets[a:b]))
        return GlobalRows(global_batch_size, window, 0), GlobalRows(global_batch_size, window, 1)


class _LastWindow:
    """``(x, y)`` rows [a, b) of a step's global batch from ``read(a, b)``; the last range read is kept,
    so x and y of the same slice read the data once."""

    def __init__(self, read):
        self.read, self.key, self.rows = read, None, None

    def __call__(self, a: int, b: int):
        if self.key != (a, b):
            self.key, self.rows = (a, b), self.read(a, b)
        return self.rows


class GlobalRows:
    """One side (``part`` 0: inputs, 1: targets) of a step's global batch of ``n`` samples, which
    every rank draws alike, but whose rows are read only when sliced (``rows[a:b]``, a tensor).

    Each rank runs only its own slices of the global batch (`global_batch_slice`); reading the whole
    batch on every rank, as `global_batch` does, costs each rank the global batch's tokens per step
    (3,072 sequences of 4,096 tokens: 100 MB of int64 gathered, from a token file read on every
    rank) where a rank runs a few of them.

    Raises:
        ValueError: a slice with a step, or an index that is not a slice."""

    def __init__(self, n: int, window: _LastWindow, part: int):
        self.n, self.window, self.part = n, window, part

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl):
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise ValueError(f"GlobalRows takes a contiguous slice, got {sl!r}")
        a, b, _ = sl.indices(self.n)
        return self.window(a, max(a, b))[self.part]


class TensorBatches:
    """Random samples of an in-memory (inputs, targets) dataset, drawn with replacement-free permutations."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if len(inputs) != len(targets):
            raise ValueError(f"inputs ({len(inputs)}) and targets ({len(targets)}) differ in length")
        self.inputs, self.targets = inputs, targets

    def _indices(self, seed: int, step: int, global_batch_size: int) -> torch.Tensor:
        return torch.randint(0, len(self.inputs), (global_batch_size,), generator=step_generator(seed, step))

    def global_batch(self, seed: int, step: int, global_batch_size: int):
        idx = self._indices(seed, step, global_batch_size)
        return self.inputs[idx], self.targets[idx]

    def global_rows(self, seed: int, step: int, global_batch_size: int) -> tuple[GlobalRows, GlobalRows]:
        """`global_batch`, each row gathered when a rank takes it (`GlobalRows`)."""
        idx = self._indices(seed, step, global_batch_size)
        window = _LastWindow(lambda a, b: (self.inputs[idx[a:b]], self.targets[idx[a:b]]))
        return GlobalRows(global_batch_size, window, 0), GlobalRows(global_batch_size, window, 1)


def synthetic_images(channels: int, size: int, classes: int, n: int = 1024, seed: int = 0, val: int = 64):
    """A learnable image dataset of a given shape: pixels N(0, 1) of shape ``(n, channels, size, size)``
    float32, labels int64 in ``[0, classes)`` from a fixed random linear teacher on the flattened pixels
    (as the MLPs' synthetic teacher). Returns ``(train TensorBatches, (val inputs, val labels), info)``
    with the first ``val`` samples held out; the same tensors on every rank for a given ``seed``."""
    g = torch.Generator().manual_seed(seed + 77)
    x = torch.randn(n, channels, size, size, generator=g)
    w = torch.randn(channels * size * size, classes, generator=g)
    y = (x.flatten(1) @ w).argmax(-1)
    info = {"source": f"synthetic images {channels}x{size}x{size}, {classes} classes (a fixed linear teacher)",
            "num_samples": n}
    return TensorBatches(x[val:], y[val:]), (x[:val], y[:val]), info


def synthetic_inputs(shape: tuple[int, ...], classes: int, n: int = 1024, seed: int = 0, val: int = 64):
    """`synthetic_images` for any per-sample ``shape`` (a factory classifier's input): inputs N(0, 1) of
    ``(n, *shape)`` float32, labels int64 in ``[0, classes)`` from a fixed random linear teacher on the
    flattened inputs. Returns ``(train TensorBatches, (val inputs, val labels), info)``, the first
    ``val`` samples held out; the same tensors on every rank for a given ``seed``."""
    g = torch.Generator().manual_seed(seed + 55)
    x = torch.randn(n, *shape, generator=g)
    w = torch.randn(x[0].numel(), classes, generator=g)
    y = (x.flatten(1) @ w).argmax(-1)
    info = {"source": f"synthetic inputs {'x'.join(map(str, shape))}, {classes} classes (a fixed linear teacher)",
            "num_samples": n}
    return TensorBatches(x[val:], y[val:]), (x[:val], y[:val]), info


def load_digits(val_fraction: float = 0.2) -> tuple[TensorBatches, tuple[torch.Tensor, torch.Tensor], dict]:
    """scikit-learn's bundled digits: (n, 1, 8, 8) float in [0, 1], labels int64 (10 classes)."""
    from sklearn.datasets import load_digits as _ld
    d = _ld()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    n_val = int(len(x) * val_fraction)
    val, tr = perm[:n_val], perm[n_val:]
    info = {"source": "sklearn.datasets.load_digits", "num_samples": len(x), "num_val": n_val}
    return TensorBatches(x[tr], y[tr]), (x[val], y[val]), info


def global_batch_slice(global_batch_size: int, *, accum_step: int, num_accum: int, dp_rank: int,
                       dp_degree: int) -> slice:
    """Which samples of the global batch one data-parallel rank runs in one accumulation step.

    The global batch is cut into ``num_accum`` consecutive chunks of ``local x dp`` samples; chunk
    ``a`` is cut into ``dp`` consecutive local batches. The union over ranks and accumulation steps is
    the whole global batch exactly once.
    """
    local = global_batch_size // (num_accum * dp_degree)
    start = (accum_step * dp_degree + dp_rank) * local
    return slice(start, start + local)


def eval_shard(num_samples: int, dp_rank: int, dp_degree: int) -> slice:
    """Disjoint, possibly uneven contiguous slice of ``num_samples`` for one DP rank (no padding,
    so no sample is counted twice; metrics are reduced as (sum, count), case C2)."""
    base, rem = divmod(num_samples, dp_degree)
    start = dp_rank * base + min(dp_rank, rem)
    return slice(start, start + base + (1 if dp_rank < rem else 0))
