"""The token stream of a language-model run: bytes, a tokenizer file, or a pre-tokenized token file.

Three sources, chosen by `TrainConfig` fields:

- bytes (the default): the text of ``--data`` (`modelpar.train.data.load_text_corpus`), one token per
  byte, ids 0..255, so the model's vocabulary must hold at least 256;
- ``--tokenizer path/tokenizer.json``: the same text encoded by a Hugging Face ``tokenizers`` file
  (``tokenizers.Tokenizer.from_file``; no special tokens added), ids below the tokenizer's vocabulary
  size (added tokens included);
- ``--token-dtype uint16|uint32``: ``--data`` is already tokenized, a flat little-endian array of
  token ids without header, the format nanoGPT-style ``prepare.py`` scripts write (``np.memmap`` of
  ``uint16``): a folder with ``train.bin`` and ``val.bin``, or one file whose last 5% is held out for
  validation.

`check_lm_data` checks a run against its model before any process starts: the sequence length within
the model's positions, and every token id within its vocabulary (the largest id of a token file, the
tokenizer's vocabulary size, or 256 for bytes). The arrays are held as int32 tensors (ids below 2**31).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

TOKEN_DTYPES = ("uint16", "uint32")
VAL_FRACTION = 0.05
_ENCODE_CHUNK = 1 << 20          # characters of text encoded per tokenizer call


def check_token_options(cfg) -> None:
    """``tokenizer`` / ``token_dtype`` / ``data`` agree with each other and exist.

    Raises:
        ValueError: an unknown ``token_dtype``, both a tokenizer and a token file, a token file without
            ``--data``, or a path that does not exist.
    """
    if cfg.token_dtype and cfg.token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype={cfg.token_dtype!r} is unknown; valid: {', '.join(TOKEN_DTYPES)} (or '' "
                         f"for text)")
    if cfg.token_dtype and cfg.tokenizer:
        raise ValueError(f"tokenizer={cfg.tokenizer!r} and token_dtype={cfg.token_dtype!r} were both given: a "
                         f"token file is already tokenized; drop one")
    if cfg.token_dtype and not cfg.data:
        raise ValueError(f"token_dtype={cfg.token_dtype!r} reads --data as a token file, but no --data was given")
    if cfg.tokenizer and not os.path.isfile(cfg.tokenizer):
        raise ValueError(f"tokenizer={cfg.tokenizer!r}: no such file (a tokenizer.json of the tokenizers library)")
    if cfg.token_dtype:
        _token_files(cfg.data)


def _token_files(path: str) -> tuple[Path, Path | None]:
    p = Path(path)
    if p.is_dir():
        train, val = p / "train.bin", p / "val.bin"
        if not train.is_file() or not val.is_file():
            raise ValueError(f"--data {path!r} is a folder without train.bin and val.bin (a token folder holds "
                             f"both; or give one token file)")
        return train, val
    if not p.is_file():
        raise ValueError(f"--data {path!r} does not exist")
    return p, None


def _read(path: Path, dtype: str):
    import numpy as np

    size = np.dtype(dtype).itemsize
    n = path.stat().st_size
    if n % size:
        raise ValueError(f"--data {str(path)!r} has {n} bytes, not a multiple of {size} (token_dtype={dtype}); "
                         f"is it a token file of that dtype?")
    return np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)


def load_token_file(path: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(train, val, info)`` of a token file or folder (see the module docstring): two int32 tensors
    of shape (n_tokens,) and a description (source, token counts, largest id, sha256 of the bytes).

    Raises:
        ValueError: see `check_token_options`; a file whose size is not a multiple of the dtype's, an
            id >= 2**31.
    """
    import numpy as np

    train_f, val_f = _token_files(path)
    arrays = [_read(train_f, dtype)] + ([_read(val_f, dtype)] if val_f else [])
    if val_f is None:
        cut = int(len(arrays[0]) * (1 - VAL_FRACTION))
        arrays = [arrays[0][:cut], arrays[0][cut:]]
    h = hashlib.sha256()
    for f in (train_f, val_f):
        if f is not None:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
    top = max((int(a.max()) for a in arrays if len(a)), default=-1)
    if top >= 2**31:
        raise ValueError(f"--data {path!r} holds token id {top}, beyond int32")
    train, val = (torch.from_numpy(np.asarray(a, dtype=np.int32)) for a in arrays)
    info = {"source": str(path), "format": f"token file ({dtype})", "train_tokens": train.numel(),
            "val_tokens": val.numel(), "max_id": top, "sha256": h.hexdigest(),
            "description": f"{train.numel() + val.numel():,} tokens ({dtype}) from {path}"}
    return train, val, info


def tokenizer_vocab_size(path: str) -> int:
    """Vocabulary size of a ``tokenizer.json``, added tokens included."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)


def encode_bytes(tokenizer_path: str, data: torch.Tensor) -> torch.Tensor:
    """Encode UTF-8 bytes (a uint8 tensor; invalid sequences replaced) with a tokenizer file, in
    chunks of lines; int32 ids, no special tokens added."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    text = bytes(data.numpy()).decode("utf-8", errors="replace")
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _ENCODE_CHUNK)
        end = len(text) if end < 0 else end + 1
        chunks.append(text[start:end])
        start = end
    ids = [i for enc in tok.encode_batch(chunks, add_special_tokens=False) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int32)


def load_lm_data(cfg) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(train, val, info)`` token streams of a run (see the module docstring); ``info`` goes into the
    run record and has a one-line ``description``."""
    from modelpar.train.data import load_text_corpus

    check_token_options(cfg)
    if cfg.token_dtype:
        return load_token_file(cfg.data, cfg.token_dtype)
    train, val, corpus = load_text_corpus(cfg.data)
    info = corpus.to_dict()
    what = f"{info['num_files']} files, {info['num_bytes']:,} bytes from {info['source']} (file list sha256 " \
           f"{info['files_sha256'][:16]}...)"
    if not cfg.tokenizer:
        return train, val, {**info, "format": "bytes", "description": what}
    train, val = encode_bytes(cfg.tokenizer, train), encode_bytes(cfg.tokenizer, val)
    return train, val, {**info, "format": f"tokenizer {cfg.tokenizer}", "train_tokens": train.numel(),
                        "val_tokens": val.numel(),
                        "description": f"{what}, {train.numel() + val.numel():,} tokens by {cfg.tokenizer}"}


def check_lm_data(cfg, *, model: str, vocab: int, max_positions: int | None, seq_len: int) -> None:
    """A language-model run fits its model: ``seq_len`` within ``max_positions`` (None: no limit) and
    every token id below ``vocab``; with ``--data`` given, each split long enough for one sample.
    Reads the token file's ids (its largest) and the tokenizer's vocabulary, not the text.

    Raises:
        ValueError: one message naming the field, the value and the model's limit.
    """
    check_token_options(cfg)
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 for a language model, got {seq_len}")
    from modelpar.models.spec import is_hf_name

    hf, factory = is_hf_name(model), ":" in model and not is_hf_name(model)
    if max_positions is not None and seq_len > max_positions:
        where = ("the max_positions its factory declares" if factory else
                 "max_position_embeddings / n_positions" if hf else "its seq_len")
        raise ValueError(f"seq_len={seq_len} exceeds the positions of --model {model} ({where} = {max_positions}); "
                         f"pass --seq-len <= {max_positions}")
    if cfg.token_dtype:
        train, val, info = load_token_file(cfg.data, cfg.token_dtype)
        if info["max_id"] >= vocab:
            raise ValueError(f"--data {cfg.data!r} (token_dtype={cfg.token_dtype}) holds token ids up to "
                             f"{info['max_id']}, but --model {model} has vocab_size={vocab}: every id must be "
                             f"< vocab_size")
        sizes = (train.numel(), val.numel())
    elif cfg.tokenizer:
        n = tokenizer_vocab_size(cfg.tokenizer)
        if n > vocab:
            raise ValueError(f"tokenizer={cfg.tokenizer!r} has a vocabulary of {n} tokens, more than the "
                             f"vocab_size={vocab} of --model {model}")
        sizes = None                       # known after encoding (TokenBatches checks it)
    else:
        if vocab < 256:
            raise ValueError(f"byte-level tokens (ids 0..255, the default without --tokenizer or --token-dtype) "
                             f"need vocab_size >= 256, but --model {model} has vocab_size={vocab}; raise it "
                             f"{'in its factory (its model and the vocab_size it declares)' if factory else 'in --model-config'}"
                             f", or give --tokenizer / a token file")
        sizes = None
        if cfg.data is not None:
            from modelpar.train.data import load_text_corpus

            train_b, val_b, _ = load_text_corpus(cfg.data)      # raises for a missing or tiny corpus
            sizes = (train_b.numel(), val_b.numel())
    if sizes is not None and min(sizes) < seq_len + 2:
        raise ValueError(f"--data {cfg.data!r} has {sizes[0]} train and {sizes[1]} validation tokens; each split "
                         f"needs at least seq_len + 2 = {seq_len + 2}")
